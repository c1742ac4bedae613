"""Single-token sensitivity on a real trained model in bfloat16: the smallest bug each noise rule names.

SmolLM2-135M-Instruct (:mod:`tests.real_model`) on its three real prompts, every layer, points
``input,attn_output,mlp_input,mlp_output``. The baseline (eager) is calibrated from the benign
variants ``dumper run --calibrate`` records (SDPA, chunks of 16, a padded batch of 3, SDPA in chunks
of 7 and of 24); the three the issue tried (SDPA, chunks of 16, a batch of 3) are measured too. For
each point a bug adds a
fraction of one token's row norm (a seeded random direction) at a fixed layer and token; each
fraction is judged by the pooled noise (one number per tensor, the rule before row noise) and by
row noise. A bug is *named* when the verdict's first divergence is exactly its layer, point and
token (a residual-stream bug at layer L's output: layer L+1's ``input``). Four benign variants
outside the calibration are judged too (false alarms). Reports, per point, the smallest named
fraction under each rule, and the calibration's time and side-file size.

    python bench/bench_row_noise.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comparator import CompareConfig, calibrate, compare_dumps, load_noise, save_noise  # noqa: E402
from dumper.prefill.presets import load_model  # noqa: E402
from dumper.prefill.run import RunConfig, dump_sequences  # noqa: E402
from tests.real_model import real_prompt_ids, smollm2_dir  # noqa: E402

POINTS = ("input", "attn_output", "mlp_input", "mlp_output")
BUGS = {
    "input": ("layer", 17, 25),
    "attn_output": ("self_attn", 22, 33),
    "mlp_input": ("post_attention_layernorm", 12, 28),
    "mlp_output": ("mlp", 8, 30),
}
"""Point -> (module of the layer whose output the bug changes, layer, token)."""
FRACTIONS = (0.0025, 0.005, 0.01, 0.02, 0.05, 0.1)
CALIBRATION = {
    "sdpa": {"attn": "sdpa"},
    "chunk-16": {"chunk_size": 16},
    "batch-3": {"batch_size": 3},
    "sdpa-chunk-7": {"attn": "sdpa", "chunk_size": 7},
    "sdpa-chunk-24": {"attn": "sdpa", "chunk_size": 24},
}
SETS = {"--calibrate's five": list(CALIBRATION), "sdpa, chunk-16, batch-3": ["sdpa", "chunk-16", "batch-3"]}
BENIGN = {
    "chunk-24": {"chunk_size": 24},
    "batch-2": {"batch_size": 2},
    "sdpa-chunk-16": {"attn": "sdpa", "chunk_size": 16},
    "sdpa-batch-2": {"attn": "sdpa", "batch_size": 2},
    "sdpa-chunk-11": {"attn": "sdpa", "chunk_size": 11},
    "sdpa-chunk-5": {"attn": "sdpa", "chunk_size": 5},
    "sdpa-chunk-32": {"attn": "sdpa", "chunk_size": 32},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    model_dir, ids = smollm2_dir(), real_prompt_ids()
    models: dict[str, torch.nn.Module] = {}

    def dump(name: str, attn: str = "eager", bug: tuple[str, int, int, float] | None = None, **kw: object) -> Path:
        out = root / name
        if (out / "manifest.json").exists():
            return out
        if attn not in models:
            models[attn] = load_model(str(model_dir), dtype="bfloat16", attn=attn)[0]
        m, handle = models[attn], None
        if bug is not None:
            where, layer, token, frac = bug
            block = m.model.layers[layer]
            direction = torch.randn(m.config.hidden_size, generator=torch.Generator().manual_seed(layer))
            direction /= direction.norm()

            def hook(module, inputs, output):
                h = output[0] if isinstance(output, tuple) else output
                rows = torch.arange(h.shape[1]) == token
                add = frac * h.float().norm(dim=-1, keepdim=True) * direction * rows[None, :, None]
                h.copy_((h.float() + add).to(h.dtype))
                return output

            handle = (block if where == "layer" else getattr(block, where)).register_forward_hook(hook)
        try:
            dump_sequences(
                m,
                ids,
                RunConfig(
                    out=str(out), model=str(model_dir), layers="all", points=POINTS, dtype="bfloat16", attn=attn, **kw
                ),
            )  # type: ignore[arg-type]
        finally:
            if handle is not None:
                handle.remove()
        return out

    base = dump("base")
    done = {n: dump(n, **kw) for n, kw in CALIBRATION.items()}  # type: ignore[arg-type]
    for label, names in SETS.items():
        print(f"\n== calibrated on {label}")
        judge(root, base, [done[n] for n in names], dump, label.split(",")[0].split("'")[0].strip() or "cal")


def judge(root: Path, base: Path, variants: list[Path], dump, tag: str) -> None:
    """Calibrate on ``variants``; judge the benign variants outside them and the seeded bugs by both rules."""
    t = time.perf_counter()
    noise = calibrate(base, variants)
    took = time.perf_counter() - t
    path = root / f"NOISE-{len(variants)}.json"
    save_noise(noise, path)
    noise = load_noise(path)
    side = path.with_name(path.name[:-5] + ".rows.safetensors").stat().st_size
    rows = sum(r.values.size for r in noise.rows.tensors.values())
    print(
        f"calibrate ({len(variants)} variants, {len(noise.identical_variants())} bit-identical to the baseline; "
        f"{len(noise.tensors)} tensors, {rows // len(noise.tensors)} rows each): {took:.1f} s; side file {side} bytes "
        f"= {side / rows:.2f} bytes per row per tensor"
    )
    rules = {"pooled": dataclasses.replace(noise, rows=None), "rows": noise}
    for name, kw in BENIGN.items():
        target = dump(name, **kw)  # type: ignore[arg-type]
        out = []
        for r, n in rules.items():
            rep = compare_dumps(base, target, CompareConfig(noise=n))
            worst = max(t.token_noise_ratio for t in rep.tensors) / 3
            out.append(f"{r}: {'PASS' if rep.passed else 'FALSE ALARM'} (worst {worst:.2f}x its threshold)")
        print(f"benign {name:14s} " + "  ".join(out))
    print(f"\n{'point':12s} {'bug at':18s} " + " ".join(f"{f:>7.2%}" for f in FRACTIONS) + "   smallest named")
    for point, (where, layer, token) in BUGS.items():
        named_layer = layer + 1 if where == "layer" else layer
        for rule, n in rules.items():
            marks, smallest = [], None
            for frac in FRACTIONS:
                target = dump(f"bug-{point}-{frac}", bug=(where, layer, token, frac))
                fd = compare_dumps(base, target, CompareConfig(noise=n)).first_divergent
                named = fd is not None and (fd.layer, fd.point, fd.token) == (named_layer, point, token)
                marks.append("named" if named else "-" if fd is None else "other")
                if named and smallest is None:
                    smallest = frac
            print(
                f"{point:12s} {f'L{layer} tok {token} {rule}':18s} "
                + " ".join(f"{m:>7s}" for m in marks)
                + f"   {'-' if smallest is None else f'{smallest:.2%}'}"
            )


if __name__ == "__main__":
    main()
