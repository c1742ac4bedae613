"""``--engine-arg KEY=VALUE``: every key and value is checked against its engine's table before the engine is imported.

The CLI runs in one child process (so what it imported is its own, whatever this test process
imported before); after each run the child lists the engine packages in ``sys.modules``. None
may be there: a bad value is refused from the table alone, so these tests pass whether or not
the engines are installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dumper.engines import ENGINES, engine_adapter
from dumper.engines.base import EngineArg, check_engine_args
from dumper.errors import UsageError
from dumper.prefill.run import RunConfig
from tests.conftest import ROOT, subprocess_env

PACKAGES = ("vllm", "llama_cpp", "onnxruntime_genai", "onnxruntime", "onnx", "transformers")
"""What a refused ``--engine-arg`` must not have imported: every engine, and transformers."""

CASES = {
    "vllm": [
        ("kv_cache_dtype", "fp4", "one of auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16"),
        ("enable_prefix_caching", "yes", "true or false"),
        ("max_num_seqs", "0", "a positive integer (at most 65536)"),
        ("max_model_len", "1e9", "a positive integer (at most 2147483647)"),
        ("max_num_seqs", "²", "a positive integer (at most 65536)"),
    ],
    "llama.cpp": [
        ("kv", "q4_0", "one of f32, f16, bf16"),
        ("flash_attn", "maybe", "one of auto, off, on"),
        ("threads", "0", "a positive integer (at most 1024)"),
        ("threads", "99999999999999999999999", "a positive integer (at most 1024)"),
        ("verbose", "\x1b[31m", "true or false"),
    ],
    "onnxruntime-genai": [("hf_dir", "", "a path")],
}
"""Per engine: (key, bad value, the values the error must list)."""

_CHILD = """
import contextlib, io, json, sys
from dumper.cli.main import main
results = []
for engine, key, value in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["run", "--engine", engine, "--model", "no-such-model", "--out", "no-such-out",
                   "--input-ids", "1,2", "--quiet", "--engine-arg", f"{key}={value}"])
    results.append({"rc": rc, "err": err.getvalue(), "imported": [m for m in sys.argv[2:] if m in sys.modules]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def refused() -> dict[tuple[str, str, str], dict]:
    """Each bad ``--engine-arg`` of :data:`CASES` (and one unknown key per engine) run through the CLI in one child."""
    cases = [(engine, key, value) for engine, rows in CASES.items() for key, value, _ in rows]
    cases += [(engine, "no_such_key", "1") for engine in ENGINES]
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases), *PACKAGES],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert r.returncode == 0, r.stderr
    return {tuple(c): res for c, res in zip(cases, json.loads(r.stdout.splitlines()[-1]), strict=True)}


@pytest.mark.parametrize("engine", list(CASES))
def test_a_bad_value_is_refused_naming_the_argument_and_its_values_without_importing_the_engine(refused, engine):
    for key, value, allowed in CASES[engine]:
        res = refused[(engine, key, value)]
        lines = res["err"].strip().splitlines()
        shown = value.encode("unicode_escape").decode() if not value.isprintable() else value
        assert res["rc"] == 2 and len(lines) == 1, res
        assert lines[0].startswith(f"error: --engine-arg {key}={shown}: expected {allowed} ("), lines[0]
        assert res["imported"] == [], (engine, key, res["imported"])


@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_unknown_key_is_refused_listing_the_keys_without_importing_the_engine(refused, engine):
    res = refused[(engine, "no_such_key", "1")]
    lines = res["err"].strip().splitlines()
    assert res["rc"] == 2 and len(lines) == 1, res
    assert lines[0].startswith(f"error: --engine-arg no_such_key: --engine {engine} does not take it (it takes: "), (
        lines
    )
    for key in engine_adapter(engine).ENGINE_ARGS:
        assert f"{key}=" in lines[0]
    assert res["imported"] == [], res


def test_every_table_entry_parses_to_its_type_and_the_last_value_wins():
    cfg = RunConfig(
        out="x",
        engine="llama.cpp",
        engine_args=(("kv", "F16"), ("threads", "4"), ("verbose", "True"), ("hf_dir", "ckpt"), ("threads", "2")),
    )
    assert check_engine_args(cfg, engine_adapter("llama.cpp").ENGINE_ARGS) == {
        "kv": "f16",
        "threads": 2,
        "verbose": True,
        "hf_dir": "ckpt",
    }
    cfg = RunConfig(out="x", engine="vllm", engine_args=(("max_model_len", "4096"), ("kv_cache_dtype", "fp8_e5m2")))
    assert check_engine_args(cfg, engine_adapter("vllm").ENGINE_ARGS) == {
        "max_model_len": 4096,
        "kv_cache_dtype": "fp8_e5m2",
    }
    for engine in ENGINES:  # every key of every table says what it takes
        for key, arg in engine_adapter(engine).ENGINE_ARGS.items():
            assert isinstance(arg, EngineArg) and arg.help and (arg.kind != "choice" or arg.choices), (engine, key)
    with pytest.raises(UsageError, match=r"^--engine-arg threads=3 \(twice\): expected a positive integer"):
        check_engine_args(
            RunConfig(out="x", engine="llama.cpp", engine_args=(("threads", "3 (twice)"),)),
            engine_adapter("llama.cpp").ENGINE_ARGS,
        )
