"""What ``python -m comparator BASE TARGET`` loads: nothing the verdict of those two dumps does not need.

Start-up is part of what a user waits for (bench/bench_comparator.py); these tests keep a plain
hidden-state comparison from loading the logprob and routing verdicts, the run store, the Markdown
report, rich and torch, and check that dumps holding logprobs still get their verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dumper
from tests.conftest import subprocess_env

NOT_FOR_A_PLAIN_COMPARISON = (
    "comparator.logprobs.types",
    "comparator.logprobs.verdict",
    "comparator.routing.compare",
    "comparator.store.runstore",
    "comparator.store.types",
    "comparator.reports.markdown",
    "rich",
    "fsspec",
    "torch",
)


def _dump(path: Path, scale: float, *, logprobs: float | None = None) -> Path:
    """Three layers' inputs times ``scale``; with ``logprobs``, five positions' logprobs of that value."""
    gen = torch.Generator().manual_seed(0)
    with dumper.capture(None, path) as cap:
        for layer in range(3):
            x = torch.randn(6, 16, generator=gen)
            cap.record(
                f"model.layers.{layer}.input",
                x * scale,
                layer=layer,
                point="input",
                positions=range(6),
                sequence_ids=[0] * 6,
            )
        if logprobs is not None:
            cap.record(
                dumper.format.LOGPROB_VALUE,
                torch.full((5, 1), logprobs),
                point=dumper.format.LOGPROB_POINT,
                positions=range(1, 6),
                sequence_ids=[0] * 5,
            )
            cap.record(
                dumper.format.LOGPROB_TOKEN_ID,
                torch.arange(5).view(5, 1),
                point=dumper.format.LOGPROB_POINT,
                positions=range(1, 6),
                sequence_ids=[0] * 5,
            )
        cap.step()
    return path


def _loaded(base: Path, target: Path) -> tuple[int, list[str], str]:
    """Exit code, modules loaded and output of ``python -m comparator BASE TARGET --quiet`` run in a fresh process."""
    script = (
        "import contextlib, io, json, sys\nfrom comparator.cli.main import main\nout = io.StringIO()\n"
        f"with contextlib.redirect_stdout(out):\n    rc = main([{str(base)!r}, {str(target)!r}, '--quiet'])\n"
        "print(json.dumps([rc, sorted(sys.modules), out.getvalue()]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return tuple(json.loads(r.stdout.splitlines()[-1]))


def test_a_plain_comparison_loads_only_what_its_verdict_needs(tmp_path):
    rc, modules, out = _loaded(_dump(tmp_path / "a", 1.0), _dump(tmp_path / "b", 1.5))
    assert rc == 1 and out.startswith("DIVERGED at layer 0"), out  # the verdict itself is still computed
    loaded = [m for m in NOT_FOR_A_PLAIN_COMPARISON if m in modules]
    assert not loaded, f"a comparison of hidden states loaded {loaded}"


@pytest.mark.parametrize("target_logprob", [-1.5, -3.0])
def test_dumps_holding_logprobs_still_get_their_verdict(tmp_path, target_logprob):
    """Same hidden states: the logprobs alone decide (-3.0 against -1.5 everywhere fails)."""
    rc, modules, out = _loaded(
        _dump(tmp_path / "a", 1.0, logprobs=-1.5), _dump(tmp_path / "b", 1.0, logprobs=target_logprob)
    )
    assert "comparator.logprobs.verdict" in modules
    assert rc == (0 if target_logprob == -1.5 else 1), out
    assert out.startswith("PASS" if target_logprob == -1.5 else "DIVERGED"), out
    assert ("logprob" in out) == (target_logprob != -1.5), out
