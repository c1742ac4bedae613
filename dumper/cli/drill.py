"""``python -m dumper drill``: one half of one layer of the engine under test, op by op, on the baseline's input.

Thin over :func:`dumper.jobs.drill.drill`: prints the log's one-line verdict and exits 1 when an op is far
beyond its rounding, 0 when none is (:mod:`dumper.errors` has the other codes).
"""

from __future__ import annotations

import argparse

from dumper.cli.common import factor_flag, out_flag, quiet_flag
from dumper.cli.flags import baseline_flag, engine_flags, model_flag, model_setting_flags
from dumper.cli.values import check_device, engine_args
from dumper.errors import EXIT_DIVERGED, EXIT_OK

__all__ = ["add_drill", "cmd_drill"]


def _positions(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positions like 3,20") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positions >= 0")
    return out


def add_drill(sub: argparse._SubParsersAction) -> None:
    """``drill``: the flags of :class:`dumper.jobs.drill.DrillConfig`."""
    from dumper.hooks.drill.record import DEFAULT_FACTOR

    p = sub.add_parser(
        "drill",
        help="run one half of one layer of the engine under test on the baseline's input, op by op: the first "
        "op far beyond its float64 rounding",
    )
    baseline_flag(p, help="dump holding the half's input (--points input,attn_output,mlp_input,mlp_output)")
    out_flag(p, help="directory for the drill log (drill.json, ops.safetensors)")
    model_flag(p, help="the model under test (a preset or checkpoint directory)")
    model_setting_flags(p)
    engine_flags(p, "engine setting (repeatable), as for run; vLLM's drill engine runs eager in this process")
    p.add_argument("--from-report", default=None, metavar="REPORT.json", help="drill the half the report names")
    p.add_argument("--layer", type=int, default=None, help="the decoder layer (with --half)")
    p.add_argument("--half", choices=["attn", "mlp"], default=None, help="attn or mlp (with --layer)")
    p.add_argument("--sequence", type=int, default=None, help="the baseline's sequence (default: the report's, or 0)")
    p.add_argument(
        "--tokens", type=_positions, default=(), help="positions whose op outputs the log keeps (default: all)"
    )
    factor_flag(
        p,
        default=DEFAULT_FACTOR,
        help=f"an op is far beyond its rounding at F times it (default {DEFAULT_FACTOR:g})",
    )
    p.add_argument("--repro", default=None, metavar="DIR", help="write a standalone repro of the op it names")
    quiet_flag(p)


def cmd_drill(args: argparse.Namespace) -> int:
    from dumper.jobs.drill import DrillConfig, drill

    check_device(args.device)
    cfg = DrillConfig(
        baseline=args.baseline,
        out=args.out,
        model=args.model,
        engine=args.engine,
        dtype=args.dtype,
        attn=args.attn,
        device=args.device,
        seed=args.seed,
        layer=args.layer,
        half=args.half,
        from_report=args.from_report,
        sequence=args.sequence,
        tokens=args.tokens,
        factor=args.factor,
        repro=args.repro,
        engine_args=engine_args(args.engine_arg or ()),
    )
    log = drill(cfg)
    print(log.summary())
    bad = log.first_beyond()
    if not args.quiet:
        check = log.header.get("half_check") or {}
        if "rel_diff" in check:
            print(
                f"the drilled half's output against the baseline's {check['point']}: "
                f"rel_diff {float(check['rel_diff']):.2g}"
            )
        tail = f"; repro in {args.repro}" if args.repro and bad is not None else ""
        if args.repro and bad is None:
            tail = "; no repro written (no op beyond its rounding)"
        print(f"wrote {args.out} ({len(log.ops)} ops){tail}; compare two builds with: python -m comparator drill A B")
    return EXIT_DIVERGED if bad is not None else EXIT_OK
