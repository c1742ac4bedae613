"""Cost of the ``router`` capture point: bytes per token per layer, and capture time vs ``input`` alone.

A seeded HF Mixtral (``--hidden``, ``--layers``, ``--experts``, top-``--top-k``) prefills one batch
of ``--tokens`` random ids per sequence under three settings, alternated to cancel drift: no
capture, ``dumper.capture(points="input")`` and ``points="input,router"`` (closing the capture,
which writes and fsyncs, included). Bytes come from the dumps' own manifests. Medians and minima
of the wall times, and each as a ratio to the plain forward measured in the same run.

    python bench/bench_router.py [--reps 7] [--batch 4] [--tokens 512] [--hidden 1024] [--layers 4] [--experts 8]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dumper  # noqa: E402
from dumper.format import ROUTER_CHOICE_POINT, ROUTER_POINT, load_manifest  # noqa: E402


def _bytes(out: Path, points: tuple[str, ...]) -> int:
    m = load_manifest(out)
    return sum(
        math.prod(r.shape) * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}[r.dtype] for r in m.tensors if r.point in points
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=max(4096, args.tokens),
    )
    config._attn_implementation = "sdpa"
    model = MixtralForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    ids = torch.randint(3, 1024, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    root = Path(tempfile.mkdtemp(prefix="driftscope-bench-router-"))
    settings = {"plain": None, "input": ("input",), "input,router": ("input", "router")}
    times: dict[str, list[float]] = {k: [] for k in settings}
    sizes: dict[str, int] = {}
    try:
        with torch.inference_mode():
            model(ids)  # warm-up
            for rep in range(args.reps):
                for name, points in settings.items():
                    out = root / f"{name}-{rep}"
                    t0 = time.perf_counter()
                    if points is None:
                        model(ids)
                    else:
                        with dumper.capture(model, out, layers="all", points=points):
                            model(ids)
                    times[name].append(time.perf_counter() - t0)
                    if points is not None:
                        sizes[name] = _bytes(out, ("input", ROUTER_POINT, ROUTER_CHOICE_POINT))
                        if rep == 0 and name == "input,router":
                            sizes["router only"] = _bytes(out, (ROUTER_POINT, ROUTER_CHOICE_POINT))
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = args.batch * args.tokens * args.layers
    print(
        f"Mixtral hidden {args.hidden}, {args.layers} layers, {args.experts} experts, top-{args.top_k}, "
        f"{args.dtype}; batch {args.batch} x {args.tokens} tokens; {args.reps} reps, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(
        f"{'bytes per token per layer':<28} input {sizes['input'] / rows:.0f}, "
        f"router {sizes['router only'] / rows:.0f} "
        f"(logits {args.experts} x {4 if args.dtype == 'float32' else 2} B, ids {args.top_k} x 8 B, weights "
        f"{args.top_k} x 4 B), input+router {sizes['input,router'] / rows:.0f}"
    )
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<28} median {med * 1e3:8.1f} ms ({med / base:.3f}x plain), min {min(ts) * 1e3:8.1f} ms")
    r, i = statistics.median(times["input,router"]), statistics.median(times["input"])
    print(f"{'router over input alone':<28} {r / i:.3f}x (medians)")


if __name__ == "__main__":
    main()
