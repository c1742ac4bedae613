"""Benign routing variation per MoE family: flip rates of fp32 layouts and of bf16 against fp32.

Every family of :mod:`tests.moe_models` (seeded, built from a config) prefills ``--batch`` x
``--tokens`` random ids four times: fp32 eager (the baseline), fp32 SDPA, fp32 eager in two
batches of one sequence each (another layout), and bf16 eager. Each run is captured with the
``router`` point and compared with the baseline; per run the flip rate (tokens whose top-k expert
set differs, over all MoE layers), the largest router-score change, the largest |Δw| on agreeing
tokens, and whether the margin rule calls every flip benign.

``--router-scale`` multiplies the router weights after the build: the test models draw them
with std 0.2 so that choices are spread out; 0.1 gives std 0.02, a trained model's scale.

    python bench/bench_router_noise.py [--batch 2] [--tokens 128] [--router-scale 0.1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dumper  # noqa: E402
from comparator import compare_dumps  # noqa: E402
from tests.moe_models import FAMILIES, build_moe  # noqa: E402


def _model(family: str, scale: float, **kw):
    model = build_moe(family, **kw)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
                m.weight.mul_(scale)
    return model


def _dump(model, ids: torch.Tensor, out: Path, split: bool) -> Path:
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points="router") as cap:
        for i, part in enumerate(ids.split(1) if split else [ids]):
            if split:
                cap.set_sequence_ids([i])
            model(input_ids=part)
            cap.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--router-scale", type=float, default=1.0)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    ids = torch.randint(3, 256, (args.batch, args.tokens), generator=torch.Generator().manual_seed(3))
    root = Path(tempfile.mkdtemp(prefix="driftscope-bench-router-noise-"))
    print(f"{args.batch} x {args.tokens} tokens, router weights x {args.router_scale:g}")
    print(
        f"{'family':<12} {'variant':<14} {'flips':>7} {'flip rate':>10} {'max |Δscore|':>13} {'max |Δw|':>10} "
        f"{'margin rule':>12}"
    )
    for family in args.families.split(","):
        base = _dump(_model(family, args.router_scale), ids, root / f"{family}-base", False)
        variants = {
            "fp32 sdpa": (dict(attn="sdpa"), False),
            "fp32 1-by-1": ({}, True),
            "bf16 eager": (dict(dtype=torch.bfloat16), False),
        }
        for name, (kw, split) in variants.items():
            if family == "gpt_oss" and kw.get("attn") == "sdpa":
                print(f"{family:<12} {name:<14} {'(transformers has no SDPA for GPT-OSS)':>56}")
                continue
            out = _dump(
                _model(family, args.router_scale, **kw), ids, root / f"{family}-{name.replace(' ', '_')}", split
            )
            r = compare_dumps(base, out).router
            tokens = sum(la.tokens for la in r.layers)
            print(
                f"{family:<12} {name:<14} {r.flips:>7} {r.flips / tokens:>10.2%} "
                f"{max(la.score_delta_max for la in r.layers):>13.3e} "
                f"{max(la.weight_max_err for la in r.layers):>10.3e} {'pass' if r.passed else 'FAIL':>12}"
            )


if __name__ == "__main__":
    main()
