"""``python -m dumper run ... --calibrate``: a baseline that carries its own noise.

The baseline is recorded, then the benign variants its engine offers re-run the same prompts
(transformers: the other attention kernel, a chunked prefill, a padded batch of every prompt, and the
other kernel with two more chunk sizes: :func:`variant_configs`),
and ``comparator calibrate`` measures the baseline's noise from them, per tensor and per row
(:mod:`comparator.judging.row_noise`). The noise goes inside the baseline's directory as
``NOISE.json`` and its side file, where ``python -m comparator BASELINE TARGET`` finds it and
judges by it without a flag.

Everything is made in a staging directory beside ``--out`` and renamed into place last, so an
interrupted run leaves no baseline that looks calibrated, nor one that looks complete; the
variants' dumps are removed.

Example::

    python -m dumper run --model DIR --dtype bfloat16 --layers all --out dumps/base --calibrate
    python -m comparator dumps/base dumps/candidate     # judged by dumps/base/NOISE.json
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dumper.errors import UsageError
from dumper.format import Manifest
from dumper.format.remote import is_url

__all__ = ["variant_configs", "record_calibrated"]

_CHUNK = 16
"""The chunked-prefill variant's chunk size, where the shortest prompt is longer (else half of it)."""


def variant_configs(cfg, seqs: list[list[int]]) -> dict[str, object]:
    """The benign variants of the transformers job ``cfg`` over prompts ``seqs``, by name (their ``out`` unset).

    The other attention kernel, a chunked prefill and a padded batch of every prompt; then the other kernel
    again with two more chunk sizes. On a CPU the same kernel's chunks and batches are often bit-identical
    to one pass (they measure nothing), while each chunk layout of the other kernel rounds its rows its own
    way: several such layouts are what lets each row's noise cover a layout the calibration did not run.
    """
    other = "sdpa" if cfg.attn == "eager" else "eager"
    shortest = min(len(s) for s in seqs)
    sizes = [c for c in (_CHUNK, 7, 24) if c < shortest] or [max(1, shortest // 2)]
    out = {f"attn-{other}": replace(cfg, attn=other)}
    if cfg.chunk_size is None:
        out[f"chunk-{sizes[0]}"] = replace(cfg, chunk_size=sizes[0])
    else:
        out["one-pass"] = replace(cfg, chunk_size=None)
    if len(seqs) > 1:
        out["batch-1" if cfg.batch_size > 1 else f"batch-{len(seqs)}"] = replace(
            cfg, batch_size=1 if cfg.batch_size > 1 else len(seqs)
        )
    for size in sizes[1:]:
        out[f"attn-{other}-chunk-{size}"] = replace(cfg, attn=other, chunk_size=size)
    return out


def record_calibrated(
    cfg, run: Callable[[object], Manifest], say: Callable[[str], None] = lambda _: None
) -> tuple[Manifest, object]:
    """Record ``cfg`` (through ``run``) and its benign variants, calibrate, and put the baseline with its noise at
    ``cfg.out``; the baseline's manifest and the noise."""
    from comparator import BASELINE_NOISE, calibrate, save_noise

    if cfg.engine != "transformers":
        raise UsageError(
            f"--calibrate: the {cfg.engine} engine's variants are not built in yet; record them with "
            "--engine-arg (docs/engines.md) and run python -m comparator calibrate BASELINE VARIANT... "
            "--out NOISE.json"
        )
    if is_url(cfg.out):
        raise UsageError(f"--calibrate: --out {cfg.out} is a URL; calibrate into a local directory, then upload it")
    if cfg.new_tokens or cfg.sketch is not None:
        raise UsageError("--calibrate: prefill dumps of full rows only (not with --new-tokens or --sketch)")
    final = Path(cfg.out)
    if final.exists():
        raise UsageError(f"{final}: already exists; --calibrate creates the baseline directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.calibrating-", dir=final.parent))
    try:
        base = work / "baseline"
        manifest = run(replace(cfg, out=str(base)))
        seqs = [list(s) for s in manifest.extra.get("input_ids") or []]
        variants = []
        for name, variant in variant_configs(cfg, seqs).items():
            say(f"calibrating: benign variant {name}")
            run(replace(variant, out=str(work / name)))
            variants.append(work / name)
        noise = calibrate(base, variants)
        noise = replace(noise, baseline=str(final), variants=tuple(f"{final} ({p.name})" for p in variants))
        save_noise(noise, base / BASELINE_NOISE)
        os.rename(base, final)  # the last step: a complete, calibrated baseline appears at once
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest, noise
