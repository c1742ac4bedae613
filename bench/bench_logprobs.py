"""Input-token logprob + top-k computation: chunked rows vs a naive full log_softmax, same run.

Synthetic float32 logits of ``--rows`` x ``--vocab`` (default 32k x 150k, ~19.7 GB: more than
this machine can hold) are streamed in chunks of ``--chunk-rows`` rows; each chunk goes through
:func:`dumper.prefill.logprobs.row_logprobs` (target logprob + top-k). Peak extra anonymous memory is
sampled every 2 ms and reported against the bound chunk_rows x V x 4 B x 3 (the chunk itself,
which a real engine already holds, is not counted as extra). The naive full log_softmax
materializes [rows, V] float32 and cannot run at 32k x 150k here; it is measured on
``--naive-rows`` rows and extrapolated linearly.

    python bench/bench_logprobs.py [--rows 32768] [--vocab 150000] [--chunk-rows 2048] [--top-k 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from anonpeak import AnonPeak  # bench/ is on sys.path when run as a script

from dumper.prefill.logprobs import row_logprobs


def chunks(rows: int, vocab: int, chunk_rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        yield start, 4 * torch.randn(n, vocab, generator=gen), torch.randint(0, vocab, (n,), generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--naive-rows", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(2)
    chunk_bytes = args.chunk_rows * args.vocab * 4
    compute_s = 0.0
    extra_peak = 0
    for _start, logits, targets in chunks(args.rows, args.vocab, args.chunk_rows):
        base = AnonPeak.now()  # the chunk is allocated: count only what the computation adds
        with AnonPeak() as mem:
            t = time.perf_counter()
            out = row_logprobs(logits, targets, top_k=args.top_k, chunk_rows=args.chunk_rows)
            compute_s += time.perf_counter() - t
        extra_peak = max(extra_peak, mem.peak - base)
        del logits, out
    bound = 3 * chunk_bytes
    print(f"chunked: {args.rows} x {args.vocab} float32 logits in chunks of {args.chunk_rows} rows, top-{args.top_k}")
    print(
        f"  compute time {compute_s:.2f}s ({args.rows / compute_s:.0f} rows/s); peak extra anonymous memory "
        f"{extra_peak / 2**30:.2f} GiB (bound chunk x V x 4 B x 3 = {bound / 2**30:.2f} GiB)"
    )
    # naive: a full log_softmax over every row, measured on fewer rows and extrapolated
    gen = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(args.naive_rows, args.vocab, generator=gen)
    targets = torch.randint(0, args.vocab, (args.naive_rows,), generator=gen)
    base = AnonPeak.now()
    with AnonPeak() as mem:
        t = time.perf_counter()
        full = torch.log_softmax(logits, dim=-1)
        lp = full.gather(1, targets[:, None])
        top = full.topk(args.top_k, dim=-1)
        naive_s = time.perf_counter() - t
    del full, lp, top
    scale = args.rows / args.naive_rows
    print(
        f"naive full log_softmax on {args.naive_rows} rows: {naive_s:.2f}s, peak extra "
        f"{(mem.peak - base) / 2**30:.2f} GiB; extrapolated to {args.rows} rows: {naive_s * scale:.1f}s, "
        f"{(mem.peak - base) * scale / 2**30:.1f} GiB"
    )
    print(f"chunked / naive time (same rows): {compute_s / (naive_s * scale):.2f}x")


if __name__ == "__main__":
    main()
