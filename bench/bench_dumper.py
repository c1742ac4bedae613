"""Dumper overhead: forward time with every layer captured vs. without, in the same run.

A float32 Llama with hidden 1024 and 8 layers runs a 2048-token prefill (the capture is
8 x 2048 x 1024 x 4 B = 64 MiB a pass). Runs alternate plain / captured to cancel drift and
ratios of medians are reported: the forward pass itself under capture, the same plus closing
the capture (the last pass's write, fsync and manifest, which a one-pass capture must wait
for), and three passes in one capture, where each pass's write overlaps the next forward.

    python bench/bench_dumper.py [--reps 3] [--tokens 2048] [--hidden 1024] [--layers 8] [--points input,...]

``--points`` chooses the capture points (default ``input``); ``input,attn_output,mlp_input,mlp_output``
prices the points inside a layer (4x the bytes of ``input`` alone).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import dumper


def build(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None, help="where to write dumps (default: a temp dir)")
    ap.add_argument("--points", default="input", help="capture points, comma-separated (default input)")
    args = ap.parse_args()
    points = tuple(args.points.split(","))
    torch.set_num_threads(2)
    model = build(args.hidden, args.layers, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    root = Path(args.dir or tempfile.mkdtemp(prefix="driftscope-bench-"))
    in_hooks: list[float] = []  # seconds spent inside Capture.record, the work hooks add to a forward
    record = dumper.Capture.record

    def timed_record(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return record(self, *a, **kw)
        finally:
            in_hooks.append(time.perf_counter() - t0)

    dumper.Capture.record = timed_record
    plain, captured, closing, multi_plain, multi_captured = [], [], [], [], []
    with torch.inference_mode():
        model(input_ids=ids[:, :64])  # warm-up
        for rep in range(args.reps):
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            plain.append(time.perf_counter() - t)
            out = root / f"rep{rep}"
            t = time.perf_counter()
            with dumper.capture(model, out, layers="all", points=points):
                model(input_ids=ids, use_cache=False)
                captured.append(time.perf_counter() - t)
                t = time.perf_counter()
            closing.append(time.perf_counter() - t)
            shutil.rmtree(out)
        # production-like: several passes in one capture, so each pass's write overlaps the next forward
        for rep in range(max(1, args.reps // 3)):
            t = time.perf_counter()
            for _ in range(3):
                model(input_ids=ids, use_cache=False)
            multi_plain.append(time.perf_counter() - t)
            out = root / f"multi{rep}"
            t = time.perf_counter()
            with dumper.capture(model, out, layers="all", points=points):
                for _ in range(3):
                    model(input_ids=ids, use_cache=False)
            multi_captured.append(time.perf_counter() - t)
            shutil.rmtree(out)
    mib = len(points) * args.layers * args.tokens * args.hidden * 4 / 2**20
    med = statistics.median
    print(
        f"model: llama hidden={args.hidden} layers={args.layers} tokens={args.tokens} float32; "
        f"points {args.points}: capture {mib:.0f} MiB/pass"
    )
    print(f"plain    forward: median {med(plain):.3f}s  runs {[round(x, 3) for x in plain]}")
    print(f"captured forward: median {med(captured):.3f}s  runs {[round(x, 3) for x in captured]}")
    print(f"  then closing the capture (drain the writer, fsync, manifest): median {med(closing):.3f}s")
    hook_s = sum(in_hooks) / (args.reps + 3 * max(1, args.reps // 3))
    print(
        f"time inside the hooks (snapshot + enqueue): {hook_s * 1e3:.1f} ms a pass = "
        f"{hook_s / med(plain):.2%} of a plain forward"
    )
    print(f"fastest runs: captured / plain {min(captured) / min(plain):.3f}x")
    print(
        f"forward overhead (captured / plain): {med(captured) / med(plain):.3f}x; "
        f"including the final drain: {(med(captured) + med(closing)) / med(plain):.3f}x"
    )
    print(
        f"3 passes in one capture (writes overlap later forwards): plain {med(multi_plain):.3f}s, "
        f"captured incl. close {med(multi_captured):.3f}s = {med(multi_captured) / med(multi_plain):.3f}x"
    )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
