"""Dumps shared by the run-store tests of the record types and of old stores (built once per session)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from dumper.prefill.run import RunConfig, run_dump
from tests.conftest import ROOT
from tests.storeutil import synth_dump

OLD_COMMIT = "c4efa80237796b76dac7cba03c20a68f6fcdfd94"
"""The last commit whose run records were loose dicts (before ``RunSummary``, ``Calibration`` and
``Label``, issue 21): stores it wrote must read with today's code."""


@pytest.fixture(scope="session")
def tiny_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real tiny-llama dumps (the default prompts, every layer): the baseline, two benign variants
    of it (SDPA attention, 50-token chunks), and other weights (seed 1); two synthetic dumps of
    one signature and two hidden sizes, which cannot be compared (an unusable run)."""
    root = tmp_path_factory.mktemp("tiny-dumps")
    runs = {"base": {}, "sdpa": {"attn": "sdpa"}, "chunk": {"chunk_size": 50}, "buggy": {"seed": 1}}
    for name, settings in runs.items():
        run_dump(RunConfig(out=str(root / name), layers="all", **settings))  # type: ignore[arg-type]
    out = {name: root / name for name in runs}
    out["synth"] = synth_dump(root / "synth")
    out["shifted"] = synth_dump(root / "shifted", hidden=8)  # same signature, other hidden size
    return out


@pytest.fixture(scope="session")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages as of :data:`OLD_COMMIT`, exported from this repository's history (read only)."""
    root = tmp_path_factory.mktemp("old-code")
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", OLD_COMMIT, "comparator", "dumper", "configs"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"commit {OLD_COMMIT[:7]} is not in this checkout's history (a shallow clone?): {e}")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))  # type: ignore[arg-type]
    return root
