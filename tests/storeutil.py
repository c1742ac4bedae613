"""Dumps for the run-store tests: small synthetic ones, and edited copies of a manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

import dumper
from dumper.format import MANIFEST_NAME, write_json_atomic


def synth_dump(
    out: Path,
    *,
    seed: int = 0,
    layers: int = 3,
    rows: int = 12,
    hidden: int = 16,
    bump: tuple[int, int] | None = None,
    model_name: str = "synth",
    passes: int = 1,
    shard_bytes: int = 512 << 20,
) -> Path:
    """A dump of ``layers`` self-attention inputs with positions; ``bump=(layer, token)`` perturbs one row."""
    g = torch.Generator().manual_seed(seed)
    with dumper.capture(None, out, model_name=model_name, shard_bytes=shard_bytes):
        for p in range(passes):
            for layer in range(layers):
                x = torch.randn(rows, hidden, generator=g)  # [tokens, hidden]
                if bump is not None and bump[0] == layer:
                    x[bump[1]] += 10.0
                dumper.dump(
                    f"model.layers.{layer}.self_attn.input",
                    x,
                    layer=layer,
                    point="input",
                    positions=range(p * rows, (p + 1) * rows),
                    sequence_ids=[0] * rows,
                )
            dumper.step()
    return out


def edited_copy(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of a dump whose manifest has top-level sections updated (e.g. ``environment={...}``)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST_NAME).read_text())
    for key, value in changes.items():
        m[key] = {**m[key], **value} if isinstance(value, dict) else value
    write_json_atomic(dst / MANIFEST_NAME, m)
    return dst


OTHER_GPU = {"torch": "2.99.0+cu999", "cuda": "12.9", "device_type": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
"""Environment fields of a run made on another machine and software stack."""
