"""The engine-start plugin (``tests/engine_starts.py``) on a real engine: a pytest run of its own in a
subprocess, whose tests start llama.cpp with and without ``@pytest.mark.engine``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, subprocess_env
from tests.dumper.engines.test_engine_vllm import need
from tests.engine_models import build_checkpoint, to_gguf

XDIST = ("-n", "2")
"""Two xdist workers, as the suite runs (README: ``python -m pytest -q -n 2``), here dealt single tests (xdist's
own ``load``), so that both start engines into the one log the controller reports."""


def _inner_pytest(tmp_path: Path, code: str, *args: str) -> str:
    """Output of a pytest run of its own (this plugin and the project's markers only, then ``args``) over
    ``code`` as ``test_inner.py``."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(code))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "tests.engine_starts",
            "-p",
            "no:cacheprovider",
            *args,
            str(tmp_path / "test_inner.py"),
        ],
        cwd=ROOT,
        env=subprocess_env(PYTEST_ADDOPTS=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.engine
@pytest.mark.parametrize("args", [(), XDIST], ids=["one process", "xdist workers"])
def test_an_unmarked_test_that_starts_an_engine_fails_and_every_start_is_counted(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    need("llama.cpp")
    gguf = to_gguf(build_checkpoint(tmp_path / "ckpt"), tmp_path / "m.gguf", "f32")
    out = _inner_pytest(
        tmp_path,
        f"""
        import subprocess, sys
        import pytest
        from llama_cpp import Llama

        GGUF = {str(gguf)!r}

        def test_unmarked_in_process():
            Llama(model_path=GGUF, verbose=False)

        def test_unmarked_in_a_subprocess():  # driftscope's own llama.cpp engine, through the low-level API
            subprocess.run([sys.executable, "-m", "dumper", "run", "--engine", "llama.cpp", "--model", GGUF,
                            "--input-ids", "1,2,3", "--out", {str(tmp_path / "dump")!r}, "--quiet"], check=True)

        @pytest.mark.engine
        def test_marked():
            Llama(model_path=GGUF, verbose=False)

        def test_no_engine():
            assert True
    """,
        *args,
    )
    assert "4 passed, 2 errors" in out, out  # failed at teardown, once every process of the test is done
    assert ("bringing up nodes" in out) == bool(args), out
    for name in ("test_unmarked_in_process", "test_unmarked_in_a_subprocess"):
        assert f"test_inner.py::{name} started 1 engine(s) (llama.cpp) without @pytest.mark.engine" in out, out
    assert "3 engine starts" in out and "llama.cpp: 3 starts" in out, out
    assert "test_marked" not in out and "test_no_engine" not in out  # counted, not failed


def test_a_test_that_skips_for_want_of_cuda_without_the_gpu_marker_fails(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nothing skips for want of it")
    out = _inner_pytest(
        tmp_path,
        """
        import pytest
        import torch

        needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

        @needs_cuda
        def test_unmarked():
            pass

        @pytest.mark.gpu
        @needs_cuda
        def test_marked():
            pass
    """,
    )
    assert "1 skipped, 1 error" in out, out  # the skip is in setup: the failure is an error there
    assert "test_inner.py::test_unmarked skips for want of CUDA without @pytest.mark.gpu" in out, out
