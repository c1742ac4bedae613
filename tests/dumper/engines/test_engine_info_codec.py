"""``EngineInfo`` reads back what it wrote: the ``engine`` entry of a real llama.cpp dump's manifest.

The tiny checkpoint is converted to f32 GGUF by llama.cpp's own converter and dumped through
the llama.cpp adapter; the manifest's ``extra["engine"]`` is ``EngineInfo.to_json()`` of the
adapter's info, and its ``environment`` holds ``EngineInfo.environment()``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dumper.engines import run_engine
from dumper.engines.base import EngineInfo
from dumper.prefill.run import RunConfig
from tests.engine_models import build_checkpoint, engine_missing, to_gguf


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory):
    why = engine_missing("llama.cpp")
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)
    root = tmp_path_factory.mktemp("engine_info")
    ckpt = build_checkpoint(root / "ckpt")
    gguf = to_gguf(ckpt, root / "m.gguf", "f32")
    cfg = RunConfig(
        out=str(root / "dump"),
        model=str(gguf),
        layers="first",
        input_ids=((1, 5, 9, 13),),
        engine="llama.cpp",
        engine_args=(("hf_dir", str(ckpt)),),
    )
    return run_engine(cfg, engine="llama.cpp")


def _wire(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.engine
def test_the_manifests_engine_entry_reads_back(manifest) -> None:
    stored = manifest.extra["engine"]
    info = EngineInfo.from_json(stored)
    assert info.name == "llama.cpp" and Path(info.checkpoint).name == "m.gguf" and info.settings["threads"] >= 1
    assert info.to_json() == stored
    # the same info wrote the manifest's environment: reading it back gives those fields again
    assert {k: v for k, v in manifest.environment.items() if k.startswith("engine")} == info.environment()


@pytest.mark.engine
def test_engine_info_round_trips(manifest) -> None:
    info = EngineInfo.from_json(manifest.extra["engine"])
    # the type also allows an unknown version, no settings, and None or float settings
    odd = replace(info, version=None, settings={**info.settings, "kv_cache_dtype": None, "rope_scale": 0.5})
    for case in (info, odd, replace(info, settings={})):
        back = EngineInfo.from_json(_wire(case.to_json()))
        assert back == case and back.to_json() == case.to_json()
        assert [type(v) for v in back.settings.values()] == [type(v) for v in case.settings.values()]
