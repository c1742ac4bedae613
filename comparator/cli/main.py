"""``python -m comparator BASELINE TARGET``: parse flags, call :func:`compare_dumps`, print, exit.

Subcommands, named by the first argument (:mod:`comparator.cli.parser`; ``--help`` lists them):
``logprobs``, ``collect`` (prompt logprobs from a live server, :mod:`comparator.logprobs.sources.collect`),
``calibrate`` and ``import-sglang`` here, ``regress`` and ``store`` (golden baselines in a run store,
:mod:`comparator.cli.store`), ``bisect`` (which build broke it, :mod:`comparator.cli.bisect`), ``drill``
(two builds' drill logs op by op, :mod:`comparator.cli.drill`).
:func:`build_parser` parses every command line of them all.

Exit codes: 0 every matched tensor passed; 1 divergence; 2 unusable input (bad arguments,
missing/incomplete/corrupt dump, zero matched tensors, shapes that cannot be aligned).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence

from comparator.cli.args import (
    VERDICT_ONLY,
    allow_model_mismatch_flag,
    compare_config,
    git_bisect_flag,
    logprob_threshold_flags,
    logprob_thresholds,
    noise_args,
    noise_flags,
    output_flags,
    parse_args,
    print_line,
    tensors_flag,
    threads_flag,
    threshold_flags,
    warn,
)
from comparator.cli.args import stdout_console as _console
from comparator.cli.args import write_output as _write
from comparator.cli.bisect import build_bisect_parser, cmd_bisect, git_bisect_exit, git_skip
from comparator.cli.drill import build_drill_parser, cmd_drill
from comparator.cli.parser import CommandParser, add_command
from comparator.cli.store import build_regress_parser, build_store_parser
from comparator.config import CompareConfig
from comparator.judging.logprob_metrics import metric_names
from comparator.judging.noise_thresholds import DEFAULT_FACTOR
from comparator.noise.file import BASELINE_NOISE
from comparator.reports.outputs import add_output_flags
from dumper.cli.common import (
    add_import_sglang_flags,
    guarded_main,
    out_flag,
    prompt_source_flags,
    quiet_flag,
    top_k_flag,
)
from dumper.errors import EXIT_DIVERGED, EXIT_OK, DriftscopeError, UsageError
from dumper.format import MANIFEST_NAME, write_json_atomic
from dumper.format.remote import fetched, is_url
from dumper.format.remote_read import dump_manifest

__all__ = [
    "main",
    "run",
    "build_parser",
    "build_logprobs_parser",
    "build_collect_parser",
    "build_calibrate_parser",
    "build_import_sglang_parser",
    "COMMANDS",
]

_MODEL_MISMATCH = "compare dumps of different models (architecture, layer count, hidden size, config hash)"
"""``--allow-model-mismatch``'s help where two dumps are compared."""


def build_calibrate_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``calibrate BASELINE VARIANT... --out NOISE.json``: a subparser of ``sub``, or a parser of its own."""
    p = add_command(
        sub,
        "calibrate",
        "Measure a baseline's noise from benign re-runs. The variants re-run its inputs "
        "with another attention backend, chunk size, batch layout or thread count; the noise is written "
        "as NOISE.json for `python -m comparator BASELINE TARGET --noise NOISE.json`.",
    )
    p.add_argument("baseline", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file")
    p.add_argument("variants", nargs="+", metavar="VARIANT", help="benign re-runs of the baseline's inputs")
    out_flag(p, help="noise file to write (atomically)", metavar="NOISE.json")
    threads_flag(p)
    allow_model_mismatch_flag(
        p,
        help="calibrate from variants that are not re-runs of the baseline's model (another "
        "model spelling in cross-engine runs, other weights); the differences are "
        "recorded in the noise file and every verdict judged by it warns about them",
    )
    quiet_flag(p, help="print only the summary line")
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    from comparator.noise.calibrate import calibrate
    from comparator.noise.file import save_noise
    from comparator.reports.outputs import progress_callback
    from comparator.reports.text import render_noise

    with progress_callback(not args.quiet) as progress, contextlib.ExitStack() as sides:
        base, *variants = (
            sides.enter_context(_fetched_str(p)) if is_url(p) else p for p in (args.baseline, *args.variants)
        )
        noise = calibrate(
            base, variants, threads=args.threads, allow_model_mismatch=args.allow_model_mismatch, progress=progress
        )
        if any(is_url(p) for p in (args.baseline, *args.variants)):  # the URLs, not the local copies, in the file
            noise = dataclasses.replace(noise, baseline=args.baseline, variants=tuple(args.variants))
    save_noise(noise, args.out)
    warn(f"variant {v}: {d} (allowed, recorded in {args.out})" for v, d in noise.model_mismatch)
    warn(w for w in (noise.identical_warning(), noise.holdout_warning(DEFAULT_FACTOR)) if w is not None)
    console = _console()
    if not args.quiet:
        render_noise(noise, console)
    parts = []
    if noise.tensors:
        positions = max(t.positions for t in noise.tensors.values())
        parts.append(f"{len(noise.tensors)} tensors ({positions} per-token values each)")
    if noise.logprobs is not None:
        parts.append(f"logprobs ({noise.logprobs.positions} positions per variant)")
    if noise.router:
        parts.append(f"the routing of {len(noise.router)} MoE layers")
    console.print(
        f"wrote {args.out}: noise of {' and '.join(parts)} from {len(noise.variants)} variants",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )  # one line, however long the path
    return EXIT_OK


def build_parser() -> CommandParser:
    """The parser of every ``python -m comparator`` command line: ``BASELINE TARGET [options]`` (compare),
    or a subcommand named by the first word; ``args.subcommand`` says which (``"compare"``)."""
    prog = "python -m comparator"
    p = CommandParser(
        prog=prog,
        default="compare",
        usage=f"{prog} BASELINE TARGET [options]\n       {prog} COMMAND ...",
        description="Compare two driftscope dumps layer by layer (and their logprobs), or run the "
        "command the first word names: `python -m comparator logprobs BASE TARGET` compares "
        "logprobs only, of dumps or engine JSONL files.",
    )
    _compare_flags(p)
    for add in (
        build_bisect_parser,
        build_calibrate_parser,
        build_collect_parser,
        build_drill_parser,
        build_import_sglang_parser,
        build_logprobs_parser,
        build_regress_parser,
        build_store_parser,
    ):
        add(p.commands)
    return p


def _compare_flags(p: argparse.ArgumentParser) -> None:
    """The arguments of the compare command (``python -m comparator BASELINE TARGET``)."""
    p.add_argument(
        "baseline",
        help="dump directory (or SGLang dumper directory) of the trusted run; one recorded "
        f"with dumper run --calibrate holds its noise ({BASELINE_NOISE}), which then "
        "judges the target unless --noise or --ignore-baseline-noise is given",
    )
    p.add_argument("target", help="dump directory (or SGLang dumper directory) of the run under test")
    p.add_argument(
        "--ignore-baseline-noise",
        action="store_true",
        help=f"judge by the fixed thresholds although the baseline holds its noise ({BASELINE_NOISE})",
    )
    threshold_flags(p)
    output_flags(p, json="the report", csv=True)
    tensors_flag(p)
    threads_flag(p)
    quiet_flag(p, help=VERDICT_ONLY)
    p.add_argument(
        "--require-all",
        action="store_true",
        help="exit 2 when either dump holds tensors the other lacks (default: compare the common "
        "ones and say so in the verdict)",
    )
    allow_model_mismatch_flag(
        p, help=f"{_MODEL_MISMATCH}, e.g. cross-engine or quantized runs; the differences are reported"
    )
    git_bisect_flag(
        p,
        help="exit as `git bisect run` reads it: 0 good, 1 bad, 125 when the target cannot be judged "
        "(skip), 128 when the baseline or the flags are unusable (git stops)",
    )
    logprob_threshold_flags(p, threshold_row=True, noise_from="with --noise")
    noise_flags(p)
    add_output_flags(p)


def build_logprobs_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``logprobs BASE TARGET``: a subparser of ``sub``, or a parser of its own."""
    p = add_command(
        sub,
        "logprobs",
        "Compare the per-token logprobs of two sources. A source is a driftscope dump "
        "recorded with --logprobs, a JSONL file of SGLang /generate, vLLM prompt_logprobs or OpenAI "
        "completions responses, or a llama.cpp KL-divergence base file.",
    )
    p.add_argument(
        "baseline", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file of the trusted run"
    )
    p.add_argument(
        "target", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file of the run under test"
    )
    output_flags(p, json="the verdict")
    quiet_flag(p, help=VERDICT_ONLY)
    allow_model_mismatch_flag(p, help=_MODEL_MISMATCH)
    logprob_threshold_flags(p, threshold_row=True, noise_from="with --noise")
    noise_flags(p)
    return p


def build_collect_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``collect --server URL --api API --out FILE.jsonl``: a subparser of ``sub``, or a parser of its own."""
    from dumper.server.flags import api_flag, request_flags, served_model_flag, server_flag

    p = add_command(
        sub,
        "collect",
        "Score prompts on a live server into logprob JSONL. The server is vLLM, SGLang "
        "or OpenAI-compatible; the prompt logprobs are written as JSONL for `python -m comparator "
        "logprobs`.",
    )
    server_flag(p, required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    api_flag(p, required=True)
    prompt_source_flags(p)
    top_k_flag(p, help="top-K logprobs per position besides the actual token")
    served_model_flag(p, flag="--model")  # this command's name for it; dumper collect and selfcheck: --served-model
    out_flag(p, help="JSONL file to write (one line per prompt)", metavar="FILE.jsonl")
    request_flags(p)
    quiet_flag(p, help="no summary line")
    return p


def cmd_collect(args: argparse.Namespace) -> int:
    from comparator.logprobs.sources.collect import collect
    from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids, read_prompts_file
    from dumper.server.api import prompts_from
    from dumper.server.client import ServerClient

    texts, ids = list(args.prompt or ()), [list(s) for s in parse_input_ids(args.input_ids or ())]
    if args.prompts:
        texts, ids = read_prompts_file(args.prompts)
    client = ServerClient(args.server, timeout=args.timeout, retries=args.retries)
    results = collect(
        client,
        args.api,
        prompts_from(texts or ([] if ids else list(BUILTIN_PROMPTS)), ids),
        args.out,
        top_k=args.top_k,
        model=args.model,
    )
    if not args.quiet:
        print(
            f"wrote {args.out}: {len(results)} requests, {sum(len(r.sequence) for r in results)} prompt positions "
            f"scored, top-k {args.top_k} ({args.api} at {client.base_url})"
        )
    return EXIT_OK


def cmd_logprobs(args: argparse.Namespace) -> int:
    from comparator.logprobs.judge import compare_logprob_sources
    from comparator.outcome import status
    from comparator.reports.text import render_logprobs

    noise = noise_args(args)
    if "rel_diff" in noise["noise_floors"]:
        raise UsageError(
            "--noise-floor: comparator logprobs takes NAME=VALUE with NAME a logprob metric "
            f"({', '.join(metric_names())})"
        )
    verdict = compare_logprob_sources(
        args.baseline,
        args.target,
        model=args.threshold_row,  # a URL: read in place
        explicit=logprob_thresholds(args.logprob_threshold),
        allow_model_mismatch=args.allow_model_mismatch,
        **noise,
    )
    warn(verdict.noise.warnings if verdict.noise is not None else ())
    console = _console()
    if args.quiet:
        sides = [
            f"only in the {side}: {', '.join(map(repr, names[:3]))}"
            f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
            for side, names in (("baseline", verdict.unmatched_baseline), ("target", verdict.unmatched_target))
            if names
        ]
        note = f" (not compared, {'; '.join(sides)})" if sides else ""
        console.print(
            status(verdict.passed, ", ".join(verdict.failures())) + note, markup=False, emoji=False, highlight=False
        )
    else:
        render_logprobs(verdict, console)
    _write(args.json, lambda p: write_json_atomic(p, verdict.to_json()))
    return EXIT_OK if verdict.passed else EXIT_DIVERGED


def build_import_sglang_parser(sub: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """``import-sglang SRC --out DST``: the flags of :func:`dumper.engines.sglang.main_import` (which runs it),
    here so that parsing and ``--help`` never load torch."""
    p = add_command(
        sub,
        "import-sglang",
        "Convert an SGLang dump into a driftscope dump. The source is a directory of SGLang dumper .pt files.",
    )
    add_import_sglang_flags(p)
    return p


def cmd_regress(args: argparse.Namespace) -> int:
    """``regress``: :func:`comparator.cli.store_run.cmd_regress` (the run store loads only for it)."""
    from comparator.cli.store_run import cmd_regress as run_regress

    return run_regress(args)


def cmd_store(args: argparse.Namespace) -> int:
    """``store``: :func:`comparator.cli.store_run.cmd_store`."""
    from comparator.cli.store_run import cmd_store as run_store

    return run_store(args)


COMMANDS = {
    "bisect": cmd_bisect,
    "calibrate": cmd_calibrate,
    "collect": cmd_collect,
    "drill": cmd_drill,
    "logprobs": cmd_logprobs,
    "regress": cmd_regress,
    "store": cmd_store,
}
"""The subcommands run here by their parsed arguments (``import-sglang`` runs in :mod:`dumper.engines.sglang`)."""


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (:func:`build_parser`) and run the command it names."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(build_parser(), argv)
    if args.subcommand == "import-sglang":  # torch loads only now, for the conversion
        from dumper.engines.sglang import main_import

        return main_import(argv[1:])
    if args.subcommand != "compare":
        return COMMANDS[args.subcommand](args)
    return cmd_compare(args)


def cmd_compare(args: argparse.Namespace) -> int:
    """``python -m comparator BASELINE TARGET``: compare, print, write the report files; exit 0 or 1.

    What only this command needs is imported here, so that the other commands and ``--help`` start
    without it, and ``--quiet`` never loads rich (a verdict line is what a script waits for).
    """
    from comparator.judging.identity import check_distinct

    if args.noise is None and not args.ignore_baseline_noise:  # a calibrated baseline (dumper run --calibrate)
        held = os.path.join(args.baseline, BASELINE_NOISE)
        args.noise = held if not is_url(args.baseline) and os.path.isfile(held) else None
    config = compare_config(args)
    check_distinct(args.baseline, args.target)  # before an SGLang side is converted into a temporary dump
    if args.git_bisect:  # the baseline and the flags are checked first: their problems are no commit's
        with _dump_side(args.baseline) as base:
            dump_manifest(base)
        try:
            return _compare(args, config)
        except DriftscopeError as e:
            return git_skip(e)
    return _compare(args, config)


def _compare(args: argparse.Namespace, config: CompareConfig) -> int:
    """Compare the two sides of ``args`` by ``config``, print, write the report files; exit 0 or 1."""
    from comparator.hidden.compare import compare_dumps
    from comparator.outcome import headline, verdict_notes
    from comparator.reports.files import write_csv, write_json
    from comparator.reports.outputs import progress_callback, write_outputs

    # either side may be an SGLang dumper directory: read as a temporary driftscope dump (dumper.engines.sglang)
    with _dump_side(args.baseline) as base, _dump_side(args.target) as target:
        with progress_callback(not args.quiet) as progress:
            report = compare_dumps(base, target, config, progress=progress)
        report = dataclasses.replace(report, baseline=args.baseline, target=args.target)  # the user's paths
        warn(report.warnings)
        if args.format == "table" and args.quiet:  # with --format json, stdout carries the JSON report alone
            notes = verdict_notes(report)
            print_line(headline(report) + (f" ({'; '.join(notes)})" if notes else ""))  # one line, whatever its length
        elif args.format == "table":
            from comparator.reports.text import render_report

            render_report(report, _console(), tensors=args.tensors)
        _write(args.json, lambda p: write_json(report, p))
        _write(args.csv, lambda p: write_csv(report, p))
        write_outputs(report, args, base, target)
    return EXIT_OK if report.passed else EXIT_DIVERGED


def _dump_side(path: str) -> contextlib.AbstractContextManager[str]:
    """``path`` itself (a URL too: :class:`~dumper.format.DumpReader` reads it in place, by ranges); for an
    SGLang dumper directory, a temporary driftscope dump of it.

    :mod:`dumper.engines.sglang` (and torch with it) is imported only for a directory without
    a driftscope manifest, so comparing two driftscope dumps stays torch-free.
    """
    if not is_url(path) and os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        from dumper.engines.sglang import open_dump_side
        from dumper.engines.sglang_files import is_sglang_dump

        if is_sglang_dump(path):
            return open_dump_side(path)
    return contextlib.nullcontext(path)


@contextlib.contextmanager
def _fetched_str(url: str) -> Iterator[str]:
    """A local copy of the dump at ``url`` (:func:`dumper.format.remote.fetched`): ``calibrate`` reads its
    variants through it."""
    with fetched(url) as local:
        yield str(local)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: user errors become one line on stderr and a distinct exit code (``--git-bisect``: git's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return git_bisect_exit(args, guarded_main(run, args))
