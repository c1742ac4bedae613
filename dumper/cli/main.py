"""``python -m dumper run|replay|selfcheck|sweep|collect|ls``: thin CLI over
:func:`dumper.prefill.run.run_dump`, :func:`dumper.jobs.replay.replay`, :func:`dumper.jobs.sweep.run.sweep`
(:mod:`dumper.cli.sweep`) and :mod:`dumper.format`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from dumper.cli.collect import add_collect, cmd_collect
from dumper.cli.common import (
    Parser,
    guarded_main,
    input_ids_flag,
    json_flag,
    out_flag,
    prompt_flag,
    quiet_flag,
    split_debug,
)
from dumper.cli.drill import add_drill, cmd_drill
from dumper.cli.flags import MODEL_HELP, baseline_flag, model_flag, model_setting_flags
from dumper.cli.run import add_run, cmd_run
from dumper.cli.sweep import add_sweep, cmd_sweep
from dumper.cli.values import check_device
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError
from dumper.format import load_manifest
from dumper.format.describe import describe_lines

__all__ = ["main", "build_parser"]

_DASH_VALUE_OPTIONS = ("--layers", "--input-ids")
"""Options whose value may start with a minus: ``--layers -3..-1``, ``--layers -1,-2``."""
_DASH_VALUE = re.compile(r"-[0-9]")
_WITH_SERVER = "with --server: "
"""The help prefix of ``selfcheck``'s flags that apply only to a live server."""


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``--layers -3..-1`` -> ``--layers=-3..-1``, so argparse does not read the value as an option.

    argparse takes a word starting with ``-`` for a value only when it is a plain negative
    number (``-1``), not for ``-3..-1`` or ``-1,-2``; joined with ``=`` it always is a value.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + list(argv[i:])
        if a in _DASH_VALUE_OPTIONS and i + 1 < len(argv) and _DASH_VALUE.match(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


class _DumperParser(Parser):
    """The top-level parser: parses a command line as :func:`main` reads it, ``--layers -3..-1`` and
    ``--debug`` included (:func:`join_dash_values`; ``--debug`` is :func:`~dumper.cli.common.guarded_main`'s)."""

    def parse_known_args(
        self,
        args: Sequence[str] | None = None,
        namespace: Any = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        argv, _ = split_debug(join_dash_values(sys.argv[1:] if args is None else args))
        return super().parse_known_args(argv, namespace)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m dumper``: one subcommand per job, each with its flags; ``parse_args(argv)``
    accepts exactly the command lines :func:`main` runs."""
    p = _DumperParser(prog="python -m dumper", description="Capture hidden states of a model into a dump directory.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (add_run, _add_selfcheck, _add_replay, add_drill, add_sweep, add_collect, _add_ls):
        add(sub)
    return p


def _add_selfcheck(sub: argparse._SubParsersAction) -> None:
    """``selfcheck``: a local model, or a live server with ``--server``."""
    from dumper.server.flags import api_flag, request_flags, served_model_flag, server_flag

    sc = sub.add_parser("selfcheck", help="decode <-> prefill logprob self-consistency of a model")
    model_flag(sc)
    prompt_flag(sc, help="prompt text (repeatable; default: built-in)")
    input_ids_flag(sc)
    sc.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to generate (default 16)")
    sc.add_argument(
        "--mode",
        default="all",
        choices=["all", "no-cache", "prefill-hit", "decode-hit"],
        help="no-cache, the cache-hit variants, or all three (default)",
    )
    sc.add_argument("--threshold", type=float, default=None, help="max mean k3 (default 1e-3)")
    model_setting_flags(sc)
    json_flag(sc, "the results")
    server_flag(sc, required=False, help="check a live server instead of a local model (http://HOST:PORT); needs --api")
    api_flag(
        sc, required=False, help=f"{_WITH_SERVER}vllm (/v1/completions), sglang (/generate), openai (text prompts only)"
    )
    served_model_flag(sc, when=_WITH_SERVER)
    request_flags(sc, when=_WITH_SERVER)


def _add_replay(sub: argparse._SubParsersAction) -> None:
    """``replay``: the flags of :class:`dumper.jobs.replay.ReplayConfig`."""
    rp = sub.add_parser("replay", help="run each decoder layer on the baseline's residual input: per-layer local error")
    model_flag(rp, help=f"the model under test: {MODEL_HELP}")
    baseline_flag(rp, help="dump holding the residual point (dumper run --points residual)")
    out_flag(rp)
    model_setting_flags(rp)
    rp.add_argument(
        "--force-routing",
        choices=["ids", "all"],
        default=None,
        help="MoE models: replay each MoE layer (with --split: each MoE block) with the baseline's expert "
        "choice for the same token (the baseline needs the router point too): ids = its expert ids, "
        "weighted by the router under test from its own logits; all = its expert ids and weights",
    )
    rp.add_argument(
        "--split",
        action="store_true",
        help="run each layer's attention and MLP apart, each on the baseline's input of that half (the "
        "baseline needs --points input,attn_output,mlp_input,mlp_output): what each half adds",
    )
    rp.add_argument(
        "--reference",
        choices=["float64"],
        default=None,
        help="with --split: also run each half in float64 and measure both sides against it",
    )
    quiet_flag(rp)


def _add_ls(sub: argparse._SubParsersAction) -> None:
    """``ls``: what a dump holds."""
    ls = sub.add_parser("ls", help="show what a dump holds")
    ls.add_argument("dir", help="dump directory")
    ls.add_argument("--tensors", action="store_true", help="list every tensor")


def _cmd_replay(args: argparse.Namespace) -> int:
    from dumper.jobs.replay import ReplayConfig, replay
    from dumper.progress import progress_bar

    check_device(args.device)
    cfg = ReplayConfig(
        model=args.model,
        baseline=args.baseline,
        out=args.out,
        dtype=args.dtype,
        attn=args.attn,
        device=args.device,
        seed=args.seed,
        force_routing=args.force_routing,
    )
    if args.split or args.reference:
        return _cmd_split_replay(args, cfg)
    with progress_bar(not args.quiet, "replaying", unit="layers") as progress:
        manifest = replay(cfg, progress=progress)
    if not args.quiet:
        forced = f" with its expert choice forced ({args.force_routing})" if args.force_routing else ""
        print(
            f"wrote {args.out}: decoder layers {manifest.extra['replay']['layers']} of {args.model} replayed on "
            f"the residuals of {args.baseline}{forced}; compare with: python -m comparator {args.baseline} {args.out}"
        )
    return EXIT_OK


def _cmd_split_replay(args: argparse.Namespace, cfg: Any) -> int:
    """``replay --split [--reference float64]``: one line per layer, what its attention and its MLP add."""
    from dumper.jobs.replay_split import split_replay
    from dumper.progress import progress_bar

    if not args.split:
        raise UsageError("--reference needs --split (it measures each half of a layer)")
    with progress_bar(not args.quiet, "replaying", unit="halves") as progress:
        halves = split_replay(cfg, reference=args.reference, progress=progress)
    for layer in sorted({h.layer for h in halves}):
        print(f"layer {layer}: " + ", ".join(str(h) for h in halves if h.layer == layer))
    if not args.quiet:
        print(f"wrote {args.out}: each half's output; compare with: python -m comparator {args.baseline} {args.out}")
    return EXIT_OK


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from comparator import (
        GREEDY_K3_NOTE,
        status,  # the words every verdict uses
    )
    from dumper.format import write_json_atomic
    from dumper.jobs.selfcheck import DEFAULT_K3_THRESHOLD, MODES, check_inputs, selfcheck, vocab_size_of
    from dumper.prefill.presets import load_model
    from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids

    threshold = DEFAULT_K3_THRESHOLD if args.threshold is None else args.threshold
    if not threshold >= 0:
        raise UsageError(f"--threshold must be >= 0, got {args.threshold}")
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.server is not None or args.api is not None:
        return _cmd_server_selfcheck(args, threshold)
    model, tok = load_model(args.model, dtype=args.dtype, attn=args.attn, device=args.device, seed=args.seed)
    prompts = [list(p) for p in parse_input_ids(args.input_ids or ())]
    if not prompts:
        if tok is None:
            raise UsageError(f"{args.model}: no tokenizer; pass --input-ids")
        prompts = [tok.encode(t) for t in (args.prompt or BUILTIN_PROMPTS)]
    modes = MODES if args.mode == "all" else (args.mode,)
    for i, p in enumerate(prompts):  # every prompt and mode before the first one runs
        for m in modes:
            try:
                check_inputs(p, vocab_size=vocab_size_of(model), new_tokens=args.new_tokens, mode=m)
            except UsageError as e:
                raise UsageError(f"{args.model}: prompt {i}: {e}") from None
    results = [
        selfcheck(model, p, new_tokens=args.new_tokens, mode=m, threshold=threshold) for p in prompts for m in modes
    ]
    for i, r in enumerate(results):
        print(
            f"prompt {i // len(modes)} {r.mode:>11}: k3 mean {r.k3_mean:.3e} max {r.k3_max:.3e} "
            f"(position {r.k3_max_position}), max |dlogprob| {r.max_abs_err:.3e}, "
            f"cache hit {r.cache_hit_tokens} tokens: {status(r.passed)}"
        )
    passed = all(r.passed for r in results)
    print(f"{status(passed)}: decode vs prefill over {len(results)} runs, mean k3 <= {threshold:g} ({GREEDY_K3_NOTE})")
    if args.json:
        write_json_atomic(args.json, {"passed": passed, "threshold": threshold, "runs": [r.to_json() for r in results]})
    return EXIT_OK if passed else EXIT_DIVERGED


def _cmd_server_selfcheck(args: argparse.Namespace, threshold: float) -> int:
    """``selfcheck --server URL --api API``: :func:`dumper.jobs.server_selfcheck.server_selfcheck` per prompt."""
    from comparator import GREEDY_K3_NOTE, status
    from dumper.format import write_json_atomic
    from dumper.jobs.server_selfcheck import server_selfcheck
    from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids
    from dumper.server.api import prompts_from, served_model
    from dumper.server.client import ServerClient

    if args.server is None or args.api is None:
        raise UsageError("--server and --api go together: --server URL --api vllm|sglang|openai")
    if args.mode != "all":
        raise UsageError("--mode is for a local model; a server's own caches decide what it reuses")
    ids = [list(p) for p in parse_input_ids(args.input_ids or ())]
    prompts = prompts_from(args.prompt or ([] if ids else list(BUILTIN_PROMPTS)), ids)
    client = ServerClient(args.server, timeout=args.timeout, retries=args.retries)
    model = args.served_model or (served_model(client) if args.api != "sglang" else None)
    results = [
        server_selfcheck(client, args.api, p, new_tokens=args.new_tokens, threshold=threshold, model=model)
        for p in prompts
    ]
    for r in results:
        print(
            f"prompt {r.request}: {len(r.k3)} tokens from position {r.positions[0]}: k3 mean {r.k3_mean:.3e} "
            f"max {r.k3_max:.3e} (position {r.k3_max_position}), max |dlogprob| {r.max_abs_err:.3e}: "
            f"{status(r.passed)}"
        )
        for pos, q, p, k in zip(r.positions, r.decode_logprobs, r.prefill_logprobs, r.k3, strict=True):
            print(f"  position {pos:>5}  decode {q:+.6f}  prefill {p:+.6f}  k3 {k:.3e}")
    passed = all(r.passed for r in results)
    print(
        f"{status(passed)}: decode vs prefill on {client.base_url} ({args.api}) over "
        f"{len(results)} prompts, mean k3 <= {threshold:g} ({GREEDY_K3_NOTE})"
    )
    if args.json:
        write_json_atomic(
            args.json,
            {
                "passed": passed,
                "threshold": threshold,
                "server": client.base_url,
                "api": args.api,
                "runs": [r.to_json() for r in results],
            },
        )
    return EXIT_OK if passed else EXIT_DIVERGED


def _cmd_ls(args: argparse.Namespace) -> int:
    """``ls DIR [--tensors]``: the summary :mod:`dumper.format.describe` gives (``store show`` prints it too)."""
    print("\n".join(describe_lines(load_manifest(args.dir), tensors=args.tensors)))
    return EXIT_OK


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(join_dash_values(sys.argv[1:] if argv is None else argv))
    if args.command == "run":
        return cmd_run(args)
    if args.command == "selfcheck":
        return _cmd_selfcheck(args)
    if args.command == "replay":
        return _cmd_replay(args)
    if args.command == "drill":
        return cmd_drill(args)
    if args.command == "sweep":
        return cmd_sweep(args)
    if args.command == "collect":
        return cmd_collect(args)
    return _cmd_ls(args)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: user errors become one line on stderr and a distinct exit code."""
    return guarded_main(run, argv)
