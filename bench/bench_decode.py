"""The decode path, measured: decode-vs-prefill benign noise per engine and dtype, and bytes per decode step.

For each dtype, a ``--new-tokens`` dump and its ``--tokens-from`` prefill counterpart (both through
the CLI, every layer, ``--logprobs --top-k 5``) are compared; the table gives, over the decode
rows only (positions past each prompt), the largest per-token rel_diff of any layer and the
largest |Δlogprob|, beside the same two over the prompt rows (which both sides computed as a
prefill: 0 unless the engines differ). Bytes per decode step per layer are the stored rows of one
step at one capture point (hidden size x dtype bytes per sequence), with ``--sketch K`` beside.

    python bench/bench_decode.py [--engine transformers|vllm] [--model tiny-llama|CKPT] [--new-tokens 64]
                                 [--dtypes float32,bfloat16] [--sketch 64] [--dir DIR]

With ``--engine vllm`` (``--model`` a checkpoint directory, default the tests' one) the decode
runs in vLLM's default engine and the counterpart is HF's prefill of the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(args[:3])}: exit {r.returncode}: {r.stderr[-2000:]}")
    return r


def measure(engine: str, model: str, dtype: str, new: int, sketch: int, root: Path) -> dict:
    from comparator import compare_dumps
    from dumper.format import load_manifest

    decode, prefill = root / f"{engine}-{dtype}-decode", root / f"{engine}-{dtype}-prefill"
    common = ("--model", model, "--dtype", dtype, "--layers", "all", "--logprobs", "--top-k", "5", "--quiet")
    _cli("dumper", "run", "--engine", engine, *common, "--new-tokens", str(new), "--out", str(decode))
    _cli("dumper", "run", *common, "--tokens-from", str(decode), "--out", str(prefill))
    m = load_manifest(decode)
    lengths = [len(p) for p in m.extra["input_ids"]]
    tokens: dict[str, float] = {"decode": 0.0, "prompt": 0.0}

    def sink(comparison, token_rel, decode_rows):  # every tensor's per-token rel_diff, split by phase
        if comparison.replica_side is not None:
            return
        assert decode_rows is not None, "a decode comparison marks its decode rows"
        for phase, sel in (("decode", decode_rows), ("prompt", ~decode_rows)):
            if sel.any():
                tokens[phase] = max(tokens[phase], float(token_rel[sel].max()))

    report = compare_dumps(prefill, decode, token_sink=sink)
    lp = _logprob_split(prefill, decode, lengths)
    step_rows = [
        t
        for t in m.tensors
        if t.point == "input"
        and t.layer == 0
        and t.row_positions() is not None
        and int(t.row_positions().min()) >= min(lengths)
    ]
    hidden = int(m.model.get("hidden_size") or 0)
    width = 4 if dtype == "float32" else 2
    return {
        "engine": engine,
        "dtype": dtype,
        "passed": report.passed,
        "steps": report.decode.steps,
        "decode_rel": tokens["decode"],
        "prompt_rel": tokens["prompt"],
        **lp,
        "bytes_step_layer": hidden * width,
        "bytes_step_layer_sketch": sketch * 4 + 8,
        "records": len(step_rows),
    }


def _logprob_split(prefill: Path, decode: Path, lengths: list[int]) -> dict:
    """Largest |Δlogprob| over generated tokens and over prompt tokens."""
    from comparator.logprobs.sources.dump import dump_logprobs
    from dumper.format import DumpReader

    a, b = dump_logprobs(DumpReader(prefill)), dump_logprobs(DumpReader(decode))
    out = {"decode_lp": 0.0, "prompt_lp": 0.0}
    for x, y in zip(a.sequences, b.sequences, strict=True):
        start = lengths[int(x.request)]
        for p, (u, v) in enumerate(zip(x.logprobs, y.logprobs, strict=False)):
            if u is None or v is None:
                continue
            key = "decode_lp" if p >= start else "prompt_lp"
            out[key] = max(out[key], abs(u - v))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--model", default=None, help="tiny-llama (transformers default) or a checkpoint directory")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sketch", type=int, default=64)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        if args.engine == "vllm":
            from tests.dumper.engines.test_engine_vllm import shared_checkpoint

            model = str(shared_checkpoint())
        else:
            model = "tiny-llama"
    root = Path(args.dir or tempfile.mkdtemp(prefix="driftscope-bench-decode-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = [measure(args.engine, model, d, args.new_tokens, args.sketch, root) for d in args.dtypes.split(",")]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.engine} decode of {args.new_tokens} tokens vs the HF prefill of the same tokens ({model})")
    print(
        f"{'dtype':9} {'pass':>5} {'steps':>6} {'decode rel_diff':>16} {'prompt rel_diff':>16} "
        f"{'decode |dlp|':>13} {'prompt |dlp|':>13} {'B/step/layer':>13} {'sketch B':>9}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9} {str(r['passed']):>5} {r['steps']:6d} {r['decode_rel']:16.3e} {r['prompt_rel']:16.3e} "
            f"{r['decode_lp']:13.3e} {r['prompt_lp']:13.3e} {r['bytes_step_layer']:13d} "
            f"{r['bytes_step_layer_sketch']:9d}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
