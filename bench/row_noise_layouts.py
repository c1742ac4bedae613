"""Row noise against layouts the calibration did not run: false alarms of benign SDPA chunk layouts, and 5% bugs.

On the real checkpoint (:mod:`tests.real_model`) in bfloat16, every layer at
``input,attn_output,mlp_input,mlp_output``, this dumps an eager one-pass baseline, the variants
``python -m dumper run --calibrate`` records (SDPA, chunks of 16, a batch of 3, SDPA in chunks of
7 and 24), SDPA in 11 more chunk sizes (3..32) and batches of 2 and 3, and single-token bugs (2% and 5% of the
row's norm: an MLP output at layer 8, an attention output at layer 22, the residual stream after
layer 17) as ``tests/e2e/test_real_checkpoint.py`` seeds them. From each dump's per-token rel_diff
against the baseline it prints, for each rule (which variants calibrate, the floor, smoothing of
each row's noise over neighbouring layers), how many held-out benign variants would fail
(``per-token > 3 x max(own row noise, floor)``), the worst one's ratio to its threshold, and each
bug's ratio to its threshold at its own row (over 1: named).

    python bench/row_noise_layouts.py --out DIR

Dumps already under ``DIR`` are reused.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comparator import CompareConfig, compare_dumps

CALIBRATION = ("sdpa", "chunk16", "batch3", "sdpa-c7", "sdpa-c24")
"""The variants of ``--calibrate`` (dumper.jobs.calibrated.variant_configs) for an eager baseline."""
VARIANTS: dict[str, dict] = {
    "sdpa": {"attn": "sdpa"},
    "chunk16": {"chunk_size": 16},
    "batch3": {"batch_size": 3},
    "sdpa-batch3": {"attn": "sdpa", "batch_size": 3},
    "sdpa-batch2": {"attn": "sdpa", "batch_size": 2},
    **{f"sdpa-c{c}": {"attn": "sdpa", "chunk_size": c} for c in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 20, 24, 32)},
}
BUGS = {
    "mlp8": (("mlp", 8, 30), "model.layers.8.mlp.output"),
    "attn22": (("self_attn", 22, 33), "model.layers.22.self_attn.output"),
    "res17": (("layer", 17, 25), "model.layers.18.self_attn.input"),
}
"""Name -> (the seed of tests/e2e/test_real_checkpoint.py: module, layer, token; the tensor it is named at)."""


def dumps(root: Path) -> None:
    import tests.e2e.test_real_checkpoint as real

    runs = real.Runs(root)
    for name, kw in {"base": {}, **VARIANTS}.items():
        if not (root / name / "manifest.json").is_file():
            t = time.perf_counter()
            runs.dump(name, attn=kw.get("attn", "eager"), **{k: v for k, v in kw.items() if k != "attn"})
            print(f"dumped {name} in {time.perf_counter() - t:.1f}s", flush=True)
    for fraction in (0.02, 0.05):
        real.FRACTION = fraction
        for bug, (seed, _) in BUGS.items():
            if not (root / f"bug-{bug}-{fraction}" / "manifest.json").is_file():
                runs.dump(f"bug-{bug}-{fraction}", bug=seed)


def per_token(root: Path, name: str) -> dict[tuple[str, int], np.ndarray]:
    out: dict[tuple[str, int], np.ndarray] = {}

    def sink(c, tokens, _decode) -> None:
        out[c.name, c.sequence] = np.asarray(tokens, dtype=np.float64).copy()

    compare_dumps(root / "base", root / name, CompareConfig(threshold=2.0, token_threshold=2.0), token_sink=sink)
    return out


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def thresholds(res: dict, cal: tuple[str, ...], quantile: float, smooth: int) -> dict:
    keys = list(res[cal[0]])
    noise = {k: np.max([res[c][k] for c in cal], axis=0) for k in keys}
    if smooth:
        near = {}
        for (name, s), v in noise.items():
            layer = _layer(name)
            near[name, s] = np.max(
                [
                    noise.get((name.replace(f"layers.{layer}.", f"layers.{layer + d}."), s), v)
                    for d in range(-smooth, smooth + 1)
                ],
                axis=0,
            )
        noise = near
    out = {}
    for name in {k[0] for k in keys}:
        seqs = [k for k in keys if k[0] == name]
        floor = max(float(np.quantile(np.concatenate([noise[k] for k in seqs]), quantile)), 1e-30)
        out.update({k: 3 * np.maximum(noise[k], floor) for k in seqs})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a folder of its own for the dumps (reused)")
    root = ap.parse_args().out
    root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    dumps(root)
    res = {
        p.name: per_token(root, p.name)
        for p in sorted(root.iterdir())
        if (p / "manifest.json").is_file() and p.name != "base"
    }
    wide = ("sdpa", "chunk16", "batch3", "sdpa-c5", "sdpa-c7", "sdpa-c11", "sdpa-c16", "sdpa-c24")
    rules = [
        ("--calibrate's variants, median floor (the default)", CALIBRATION, 0.5, 0),
        ("the same, p90 floor", CALIBRATION, 0.9, 0),
        ("the same, each row's noise the max over layers L-1..L+1", CALIBRATION, 0.5, 1),
        ("8 variants (SDPA chunks 5, 7, 11, 16, 24), median floor", wide, 0.5, 0),
    ]
    for label, cal, quantile, smooth in rules:
        thr = thresholds(res, cal, quantile, smooth)
        held = [v for v in res if v not in cal and not v.startswith("bug-")]
        worst = {
            v: max(float(np.max(res[v][k] / thr[k])) for k in thr if ".layers.0.self_attn.input" not in k[0])
            for v in held
        }
        alarms = sorted((v for v in held if worst[v] > 1), key=lambda v: -worst[v])
        print(
            f"\n{label}\n  false alarms: {len(alarms)} of {len(held)} held-out benign variants, worst "
            f"{max(worst.values()):.2f}x the threshold: " + ", ".join(f"{v} {worst[v]:.2f}" for v in alarms)
        )
        named = []
        for bug, ((_, _, token), tensor) in BUGS.items():
            for fraction in ("0.02", "0.05"):
                ratio = max(
                    float(res[f"bug-{bug}-{fraction}"][tensor, s][token] / thr[tensor, s][token]) for s in range(3)
                )
                named.append(f"{bug} {float(fraction):.0%} {ratio:.2f}")
        print("  bugs (ratio to the threshold at the bug's row, best sequence): " + ", ".join(named))
    print(f"\nbench wall time {time.perf_counter() - t:.0f}s")


if __name__ == "__main__":
    main()
