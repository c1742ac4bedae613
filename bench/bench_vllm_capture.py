"""Capture overhead inside vLLM: ``LLM.generate`` with every layer captured vs. plain, in the same run.

A Llama checkpoint written by ``tests.engine_models.build_checkpoint`` (the test suite's tiny
one by default; ``--hidden``/``--layers`` make it bigger) is loaded once into vLLM in this
process; ``--prompts`` prompts of ``--tokens`` random ids each are prefilled (``max_tokens=1``)
in one ``generate`` call. Runs alternate plain / captured to cancel drift, the prefix cache is
emptied before each, and medians and minima are reported (minima resist a busy machine).
"captured" includes closing the capture (the last pass's write, fsync and manifest), which a
caller waits for.

    python bench/bench_vllm_capture.py [--reps 9] [--prompts 8] [--tokens 256] [--hidden 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dumper  # noqa: E402
from dumper.engines.vllm.engine import env_defaults  # noqa: E402
from tests.engine_models import build_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint and dumps (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="driftscope-bench-vllm-"))
    ckpt = build_checkpoint(
        root / "ckpt", hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers
    )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process hook API measured here
    env_defaults("cpu")
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(ckpt), dtype=args.dtype, enforce_eager=True, max_model_len=max(512, args.tokens + 1))
    rng = np.random.default_rng(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[1] + rng.integers(3, 300, args.tokens - 1).tolist()) for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def plain() -> float:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    def captured(i: int) -> float:
        llm.reset_prefix_cache()
        out = root / f"dump{i}"
        t0 = time.perf_counter()
        with torch.inference_mode(), dumper.capture(llm, out, layers="all"):
            llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        shutil.rmtree(out)
        return dt

    plain(), captured(-1)  # warm-up: first-call costs of both paths
    p, c = [], []
    for i in range(args.reps):
        p.append(plain())
        c.append(captured(i))
    mp, mc = statistics.median(p), statistics.median(c)
    mib = args.prompts * args.tokens * args.hidden * args.layers * (4 if args.dtype == "float32" else 2) / 2**20
    print(
        f"vLLM {args.dtype}, {args.layers} layers x hidden {args.hidden}, {args.prompts} prompts x "
        f"{args.tokens} tokens ({mib:.1f} MiB captured), threads {os.environ.get('OMP_NUM_THREADS', 'vLLM default')}"
    )
    print(f"plain generate    median {mp * 1e3:8.1f} ms, min {min(p) * 1e3:8.1f} ms")
    print(f"captured generate median {mc * 1e3:8.1f} ms, min {min(c) * 1e3:8.1f} ms")
    print(f"captured/plain    {mc / mp:.2f}x (medians), {min(c) / min(p):.2f}x (minima)")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
