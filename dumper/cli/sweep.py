"""``python -m dumper sweep``: thin CLI over :func:`dumper.jobs.sweep.run.sweep`: its flags, a line per cell, the
table."""

from __future__ import annotations

import argparse
import sys

from dumper.cli.common import json_flag, out_flag, quiet_flag
from dumper.cli.flags import (
    MODEL_HELP,
    baseline_flag,
    check_logprob_options,
    engine_flags,
    layers_flag,
    logprob_flags,
    model_flag,
    model_setting_flags,
    padding_side_flag,
    points_flag,
    save_logits_flag,
)
from dumper.cli.values import check_device, engine_args, positive_int
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError

__all__ = ["add_sweep", "cmd_sweep"]


def add_sweep(sub: argparse._SubParsersAction) -> None:
    """``sweep``: the grid, the baseline, and ``run``'s flags that are fixed across cells."""
    from comparator import threshold_flags

    s = sub.add_parser("sweep", help="one capture per cell of a grid of settings, each compared with a baseline")
    model_flag(s, help=f"{MODEL_HELP}, as for run")
    engine_flags(s, engine_arg_help="engine setting fixed across cells (repeatable)")
    baseline_flag(s, help="dump every cell is compared with; its prompts are the job")
    s.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,...",
        help="an axis (repeatable; cells are the cartesian product): an --engine-arg key, chunk_size "
        "(none allowed), batch_size, new_tokens (decode cells, judged against their own prefill), "
        "speculative (off, or --speculative settings with ';' between a setting's keys; with new_tokens), "
        "or lengths (prompt lengths, or 'block' for block-1, block, block+1, 2*block-1, 2*block, "
        "2*block+1)",
    )
    s.add_argument(
        "--max-cells",
        type=positive_int,
        default=None,
        metavar="N",
        help="refuse a grid of more than N cells, the product of its axes' value counts (default "
        "4096), before anything is planned",
    )
    out_flag(s, help="new directory: cell-NNN/dump, cell-NNN/report.json, sweep.json")
    json_flag(s, "the sweep's results")
    s.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size for lengths=block (default: the engine's; vLLM's after it loads, 16 for transformers)",
    )
    layers_flag(s, from_baseline=True)
    points_flag(s, from_baseline=True)
    model_setting_flags(s, from_baseline=True)
    padding_side_flag(s)
    logprob_flags(s, help="also record and compare input-token logprobs (not in prefix-caching cells)")
    save_logits_flag(s)
    threshold_flags(s)
    quiet_flag(s, help="no line per cell; the table and the verdict only")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Build the :class:`~dumper.jobs.sweep.run.SweepConfig`, run it, print a line per cell and the table."""
    from comparator import CompareConfig, stdout_console
    from dumper.format import write_json_atomic
    from dumper.hooks.layers import parse_points
    from dumper.jobs.sweep.grid import MAX_CELLS, parse_grid
    from dumper.jobs.sweep.run import SweepConfig, baseline_defaults, baseline_prompts, sweep
    from dumper.jobs.sweep.table import cell_line, render_sweep
    from dumper.prefill.logprob_records import LogprobSpec
    from dumper.prefill.run import RunConfig

    check_device(args.device)
    check_logprob_options(args, "--top-k", "--save-logits")
    if args.top_k < 0:
        raise UsageError("--top-k must be >= 0")
    axes = parse_grid(args.grid, max_cells=MAX_CELLS if args.max_cells is None else args.max_cells)
    defaults = baseline_defaults(baseline_prompts(args.baseline)[0])
    spec = LogprobSpec(top_k=args.top_k, save_logits=args.save_logits) if args.logprobs else None
    template = RunConfig(
        out=args.out,
        model=args.model,
        dtype=args.dtype or defaults["dtype"],
        attn=args.attn,
        layers=args.layers if args.layers is not None else defaults["layers"],
        device=args.device,
        seed=defaults["seed"] if args.seed is None else args.seed,
        padding_side=args.padding_side,
        logprobs=spec,
        engine=args.engine,
        engine_args=engine_args(args.engine_arg or ()),
        points=parse_points(args.points) if args.points is not None else defaults["points"],
    )
    compare = CompareConfig.resolve(threshold=args.threshold, token_threshold=args.token_threshold)
    cfg = SweepConfig(
        baseline=args.baseline, out=args.out, template=template, grid=axes, block_size=args.block_size, compare=compare
    )

    def line(cell, total):  # one line per finished cell, on stderr: stdout carries the table
        print(cell_line(cell, total), file=sys.stderr, flush=True)

    result = sweep(cfg, on_cell=None if args.quiet else line)
    render_sweep(result, stdout_console())
    if args.json:
        try:
            write_json_atomic(args.json, result.to_json())
        except OSError as e:
            raise UsageError(f"--json {args.json}: cannot write it ({e.strerror})") from None
    return EXIT_OK if result.passed else EXIT_DIVERGED
