"""Replay cost: ``replay_model`` (every layer on the baseline's residuals) against the dump it replays.

A float32 Llama (hidden 1024, 8 layers, sdpa) prefills one prompt of ``--tokens`` tokens under
capture with ``points=("input", "residual")``; then the same model is replayed on that dump,
and the replay is checked to reproduce the model's own forward bit for bit (the largest
difference of any replayed row is printed; it must be 0). Medians of ``--reps`` runs.

    python bench/bench_replay.py [--reps 3] [--tokens 2048] [--hidden 1024] [--layers 8] [--split]

``--split`` times ``replay --split`` instead (:mod:`dumper.jobs.replay_split`): the baseline captures
``input,attn_output,mlp_input,mlp_output``, every layer's attention and MLP run apart on it (each
half's output must equal the baseline's: the largest rel_diff is printed), and each half's total time
is set against a plain forward of the model, timed in the same rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_dumper import build

import dumper
from dumper.format import DumpReader
from dumper.jobs.replay import replay_model
from dumper.jobs.replay_split import split_replay_model


def max_difference(base: Path, replay: Path) -> float:
    """Largest |replay - baseline| over every replayed residual row (both dumps hold one sequence, one record per
    name)."""
    b, r = DumpReader(base), DumpReader(replay)
    by_name = {t.name: t for t in b.manifest.tensors}
    worst = 0.0
    for t in r.manifest.tensors:
        x, y = r.rows(t).astype(np.float64), b.rows(by_name[t.name]).astype(np.float64)
        worst = max(worst, float(np.abs(x - y).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--split", action="store_true", help="time each half of a layer (replay --split)")
    args = ap.parse_args()
    model = build(args.hidden, args.layers, vocab=4096)
    ids = torch.randint(0, 4096, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    if args.split:
        return split(model, ids, args)
    dump_s, replay_s = [], []
    root = Path(tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        for rep in range(args.reps):
            base, out = root / f"base{rep}", root / f"replay{rep}"
            t0 = time.perf_counter()
            with torch.inference_mode(), dumper.capture(model, base, layers="all", points=("input", "residual")):
                model(input_ids=ids, use_cache=False)
            t1 = time.perf_counter()
            replay_model(model, base, out)
            t2 = time.perf_counter()
            dump_s.append(t1 - t0)
            replay_s.append(t2 - t1)
        worst = max_difference(root / "base0", root / "replay0")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    d, r = statistics.median(dump_s), statistics.median(replay_s)
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, {args.layers} layers, {torch.get_num_threads()} threads: "
        f"captured forward {d:.2f} s, replay {r:.2f} s ({r / d:.2f}x); max |replay - baseline| {worst:g}"
    )


def split(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> None:
    """Time each half's split replay (per-half time from a timed wrap of the halves' forwards) vs a plain forward."""
    points = ("input", "attn_output", "mlp_input", "mlp_output")
    spent: dict[str, list[float]] = {"attention": [], "MLP": []}
    plain: list[float] = []
    root = Path(tempfile.mkdtemp(prefix="bench_replay_split_"))
    try:
        with torch.inference_mode(), dumper.capture(model, root / "base", layers="all", points=points):
            model(input_ids=ids, use_cache=False)
        for rep in range(args.reps):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False)
            plain.append(time.perf_counter() - t0)
            per = {"attention": 0.0, "MLP": 0.0}
            handles = [_timer(layer.self_attn, per, "attention") for layer in model.model.layers]
            handles += [_timer(layer.mlp, per, "MLP") for layer in model.model.layers]
            try:
                halves = split_replay_model(model, root / "base", root / f"split{rep}")
            finally:
                for h in handles:
                    h.remove()
            for k, v in per.items():
                spent[k].append(v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fwd = statistics.median(plain)
    worst = max(h.rel_diff for h in halves)
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, {args.layers} layers, {torch.get_num_threads()} threads: "
        f"plain forward {fwd:.2f} s; split replay, all layers: attention {statistics.median(spent['attention']):.2f} s "
        f"({statistics.median(spent['attention']) / fwd:.2f}x a forward), MLP {statistics.median(spent['MLP']):.2f} s "
        f"({statistics.median(spent['MLP']) / fwd:.2f}x); largest half rel_diff {worst:g}"
    )


def _timer(module: torch.nn.Module, per: dict[str, float], key: str) -> _Handles:
    """Add the wall time of ``module``'s forwards to ``per[key]`` (a pre-hook starts the clock, a hook stops it)."""
    start: list[float] = []
    pre = module.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter()))
    post = module.register_forward_hook(
        lambda m, a, o: per.__setitem__(key, per[key] + time.perf_counter() - start.pop())
    )
    return _Handles(pre, post)


class _Handles:
    """Hook handles removed together."""

    def __init__(self, *handles) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


if __name__ == "__main__":
    main()
