"""Shared fixtures: real tiny HF models built from configs with a fixed seed, and CLI runners."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Every property test without a deadline: on a loaded 2-core machine (two xdist workers beside engine starts)
# one example's first call took 552 ms, over Hypothesis's default 200 ms, and failed the run as "flaky" although
# the property held (tests/comparator/logprobs/test_logprobs_metrics.py::test_k3_is_half_square_for_small_delta).
settings.register_profile("driftscope", deadline=None)
settings.load_profile("driftscope")

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.engine_starts", "tests.xdist_schedule", "pytester"]
# The suite starts hundreds of Python subprocesses (CLIs, engine workers): where the environment disables
# bytecode caching, each compiled driftscope's modules from source again (~0.1 s a process). The
# session's workers and subprocesses cache it, in __pycache__ as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess a test starts: the repository first on ``PYTHONPATH``, then what the
    session put there (``tests/engine_starts.py``: the engine-start log), then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_cli(
    module: str,
    *args: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <module> args...`` in a real subprocess and capture its output."""
    full_env = subprocess_env(**(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=600,
    )


@contextlib.contextmanager
def serve_in_thread(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (a free port) answering with ``handler``; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_cli


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(2)


@contextlib.contextmanager
def forward_hook(module: torch.nn.Module | None, hook: Callable) -> Iterator[None]:
    """Inside: ``hook`` runs after every forward of ``module`` (None: nothing is hooked); removed on the way out."""
    handle = module.register_forward_hook(hook) if module is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def tiny_llama(attn: str = "eager", dtype: str = "float32"):
    from dumper.prefill.presets import load_model

    model, tok = load_model("tiny-llama", attn=attn, dtype=dtype)
    return model, tok


def prompt_ids(tok, n_tokens: int = 96) -> torch.Tensor:
    """A [1, n] batch of real byte-tokenized text."""
    text = "Inference engines change daily; each change can shift numerics without an error. " * 8
    ids = tok.encode(text)[:n_tokens]
    return torch.tensor([ids])
