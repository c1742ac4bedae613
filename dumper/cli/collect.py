"""``python -m dumper collect``: thin CLI over :func:`dumper.jobs.collect.collect_dump` (a dump from a live vLLM
server).

Exit codes: 0 the dump was written; 2 unusable input: the server is unreachable or not vLLM, it
refused a request, ``--spool`` is not a directory, or no capture part appeared within ``--part-timeout``
(the server runs without the driftscope tap or records into another spool).
"""

from __future__ import annotations

import argparse
import sys

from dumper.cli.common import out_flag, prompt_source_flags, quiet_flag
from dumper.cli.flags import check_logprob_options, logprob_flags
from dumper.errors import EXIT_OK

__all__ = ["add_collect", "cmd_collect"]


def add_collect(sub: argparse._SubParsersAction) -> None:
    """``collect``: the server, its spool, the prompts and what to record."""
    from dumper.jobs.collect import MAX_CONCURRENCY, PART_WAIT_S
    from dumper.server.flags import request_flags, served_model_flag, server_flag

    c = sub.add_parser(
        "collect",
        help="dump the requests this client sends to a live vllm serve (started with the "
        "driftscope tap and DRIFTSCOPE_VLLM_SPOOL)",
    )
    server_flag(c, required=True, help="the vLLM server (http://HOST:PORT)")
    c.add_argument(
        "--spool",
        required=True,
        metavar="DIR",
        help="the directory the server records into: its DRIFTSCOPE_VLLM_SPOOL (on this machine)",
    )
    out_flag(c)
    c.add_argument(
        "--model",
        default=None,
        metavar="CKPT",
        help="the HF checkpoint directory the server serves: the dump's model identity and the tokenizer "
        "of text prompts (default: the identity the server reports; token-id prompts only)",
    )
    prompt_source_flags(c, prompt_help="prompt text (repeatable; needs --model)")
    logprob_flags(
        c,
        help="also record the prompt logprobs the server returns (vLLM then computes every position, "
        "never reading its prefix cache)",
    )
    c.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="ask for N greedy tokens per prompt (no stop at EOS) and record the decode steps that feed "
        "them (docs/decode.md); with --logprobs also each generated token's logprob",
    )
    served_model_flag(c)
    request_flags(c)
    c.add_argument(
        "--part-timeout",
        type=float,
        default=PART_WAIT_S,
        metavar="SECONDS",
        help="seconds to wait for the server's capture parts after the last answer "
        f"(default {PART_WAIT_S:g}); none in time: the server has no tap or another spool, exit 2",
    )
    c.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help=f"requests in flight at once, batched by the server (default 8, at most {MAX_CONCURRENCY})",
    )
    quiet_flag(c)


def cmd_collect(args: argparse.Namespace) -> int:
    """Build the :class:`~dumper.jobs.collect.CollectConfig`, collect, print one line."""
    from dumper.jobs.collect import CollectConfig, collect_dump, missing_note
    from dumper.prefill.logprob_records import LogprobSpec
    from dumper.progress import progress_bar
    from dumper.prompts import parse_input_ids, read_prompts_file

    prompts: tuple[str, ...] = tuple(args.prompt or ())
    ids = parse_input_ids(args.input_ids or ())
    if args.prompts:
        texts, file_ids = read_prompts_file(args.prompts)
        prompts, ids = tuple(texts), tuple(tuple(s) for s in file_ids)
    check_logprob_options(args, "--top-k")
    cfg = CollectConfig(
        server=args.server,
        spool=args.spool,
        out=args.out,
        model=args.model,
        prompts=prompts,
        input_ids=ids,
        logprobs=LogprobSpec(top_k=args.top_k) if args.logprobs else None,
        served_model=args.served_model,
        part_timeout=args.part_timeout,
        request_timeout=args.timeout,
        retries=args.retries,
        concurrency=args.concurrency,
        new_tokens=args.new_tokens,
    )
    with progress_bar(not args.quiet, "collecting", unit="tokens") as progress:
        manifest = collect_dump(cfg, progress=progress)
    missing = manifest.extra["missing_positions"]
    note = f"; {missing_note(missing)}" if any(missing) else ""
    if not args.quiet:
        seqs = manifest.extra["input_ids"]
        print(
            f"wrote {args.out}: {len(manifest.tensors)} tensors, "
            f"layers {manifest.capture_signature.get('layers', [])}, "
            f"{len(seqs)} prompts ({sum(map(len, seqs))} positions) from {manifest.extra['server']}{note}"
        )
    elif note:
        print(f"warning: {args.out}{note}", file=sys.stderr)
    return EXIT_OK
