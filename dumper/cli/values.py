"""Values of flags both ``python -m dumper`` and its subcommands (``sweep``) read: a seed, a device,
``--engine-arg``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dumper.errors import UsageError
from dumper.format.sketch import SketchSpec

__all__ = ["seed_value", "positive_int", "check_device", "engine_args", "sketch_spec"]


def seed_value(text: str) -> int:
    """``--seed`` value: an integer in 0..2^63-1 (what ``torch.manual_seed`` and the manifest's int64 hold)."""
    from dumper.prefill.run import MAX_SEED

    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_SEED}, got {text}")
    return seed


def positive_int(text: str) -> int:
    """A count flag's value (``sweep --max-cells``): an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return n


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without CUDA, in one line."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine")


def engine_args(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``["kv=f16", "hf_dir=ck"]`` -> (("kv", "f16"), ("hf_dir", "ck")); a word without ``=`` is a usage error."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--engine-arg {item!r}: expected KEY=VALUE")
        out.append((key.strip(), value))
    return tuple(out)


def sketch_spec(k: int | None, seed: int | None) -> SketchSpec | None:
    """``--sketch K`` and ``--sketch-seed S`` as the projection to store (None: full dumps); bad values refused."""
    if k is None:
        if seed is not None:
            raise UsageError("--sketch-seed needs --sketch K")
        return None
    return SketchSpec(k=k, seed=0 if seed is None else seed)
