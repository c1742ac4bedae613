"""``python -m dumper sweep``: thin CLI over :func:`dumper.jobs.sweep.run.sweep`: its flags, a line per cell, the table."""

from __future__ import annotations

import argparse
import sys

from dumper.cli.values import check_device, engine_args, positive_int, seed_value
from dumper.engines import ENGINES
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError
from dumper.format.dtypes import MODEL_DTYPES

__all__ = ["add_sweep", "cmd_sweep"]


def add_sweep(sub: argparse._SubParsersAction) -> None:
    """``sweep``: the grid, the baseline, and ``run``'s flags that are fixed across cells."""
    from comparator import threshold_flags

    s = sub.add_parser("sweep", help="one capture per cell of a grid of settings, each compared with a baseline")
    s.add_argument("--model", default="tiny-llama", help="local HF model directory or preset, as for run")
    s.add_argument("--engine", default="transformers", choices=list(ENGINES), help="inference engine (default "
                   "transformers)")
    s.add_argument("--baseline", required=True, help="dump every cell is compared with; its prompts are the job")
    s.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="an axis (repeatable; cells are the cartesian product): an --engine-arg key, chunk_size "
                        "(none allowed), batch_size, new_tokens (decode cells, judged against their own prefill), "
                        "or lengths (prompt lengths, or 'block' for block-1, block, block+1, 2*block-1, 2*block, "
                        "2*block+1)")
    s.add_argument("--max-cells", type=positive_int, default=None, metavar="N",
                   help="refuse a grid of more than N cells, the product of its axes' value counts (default "
                        "4096), before anything is planned")
    s.add_argument("--out", required=True, help="new directory: cell-NNN/dump, cell-NNN/report.json, sweep.json")
    s.add_argument("--json", metavar="FILE", help="also write the sweep's results as JSON here")
    s.add_argument("--block-size", type=int, default=None,
                   help="KV block size for lengths=block (default: the engine's; vLLM's after it loads, 16 for "
                        "transformers)")
    s.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="engine setting fixed across cells (repeatable)")
    s.add_argument("--layers", default=None, help="layer spec (default: the baseline's layers)")
    s.add_argument("--points", default=None, help="capture points, as dumper run's (default: the baseline's)")
    s.add_argument("--dtype", default=None, choices=list(MODEL_DTYPES), help="default: the baseline's")
    s.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="attention implementation")
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    s.add_argument("--seed", type=seed_value, default=None, help="seed for preset weights (default: the baseline's)")
    s.add_argument("--padding-side", default="right", choices=["right", "left"], help="where batches are padded")
    s.add_argument("--logprobs", action="store_true", help="also record and compare input-token logprobs "
                   "(not in prefix-caching cells)")
    s.add_argument("--top-k", type=int, default=0, help="with --logprobs: record the top-K logprobs per position")
    s.add_argument("--save-logits", action="store_true", help="with --logprobs: also dump logits rows (for KL)")
    threshold_flags(s)
    s.add_argument("--quiet", action="store_true", help="no line per cell; the table and the verdict only")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Build the :class:`~dumper.jobs.sweep.run.SweepConfig`, run it, print a line per cell and the table."""
    from comparator import CompareConfig, stdout_console
    from dumper.format import write_json_atomic
    from dumper.prefill.run import LogprobSpec, RunConfig
    from dumper.hooks.layers import parse_points
    from dumper.jobs.sweep.run import SweepConfig, baseline_defaults, baseline_prompts, parse_grid, sweep
    from dumper.jobs.sweep.grid import MAX_CELLS
    from dumper.jobs.sweep.table import cell_line, render_sweep

    check_device(args.device)
    if (args.top_k or args.save_logits) and not args.logprobs:
        raise UsageError("--top-k and --save-logits need --logprobs")
    if args.top_k < 0:
        raise UsageError("--top-k must be >= 0")
    axes = parse_grid(args.grid, max_cells=MAX_CELLS if args.max_cells is None else args.max_cells)
    defaults = baseline_defaults(baseline_prompts(args.baseline)[0])
    spec = LogprobSpec(top_k=args.top_k, save_logits=args.save_logits) if args.logprobs else None
    template = RunConfig(out=args.out, model=args.model, dtype=args.dtype or defaults["dtype"], attn=args.attn,
                         layers=args.layers if args.layers is not None else defaults["layers"], device=args.device,
                         seed=defaults["seed"] if args.seed is None else args.seed, padding_side=args.padding_side,
                         logprobs=spec, engine=args.engine, engine_args=engine_args(args.engine_arg or ()),
                         points=parse_points(args.points) if args.points is not None else defaults["points"])
    compare = CompareConfig.resolve(threshold=args.threshold, token_threshold=args.token_threshold)
    cfg = SweepConfig(baseline=args.baseline, out=args.out, template=template, grid=axes, block_size=args.block_size,
                      compare=compare)

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
