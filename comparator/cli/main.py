"""``python -m comparator BASELINE TARGET``: parse flags, call :func:`compare_dumps`, print, exit.

Subcommands (dispatched on the first argument): ``logprobs`` and ``collect`` (prompt logprobs
from a live server, :mod:`comparator.logprobs.sources.collect`) here, ``regress`` and ``store`` (golden baselines
in a run store, :mod:`comparator.cli.store`).

Exit codes: 0 every matched tensor passed; 1 divergence; 2 unusable input (bad arguments,
missing/incomplete/corrupt dump, zero matched tensors, shapes that cannot be aligned).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence

from dumper.cli.common import Parser, guarded_main
from dumper.errors import EXIT_DIVERGED, EXIT_OK, UsageError
from dumper.format import MANIFEST_NAME, write_json_atomic

from comparator.cli.args import (compare_config, logprob_threshold_flags, logprob_thresholds, noise_args, noise_flags,
                                 output_flags, parse_args, threshold_flags, warn)
from comparator.cli.args import stdout_console as _console
from comparator.cli.args import write_output as _write
from comparator.hidden.compare import compare_dumps
from comparator.hidden.identity import check_distinct
from comparator.reports.outputs import add_output_flags, progress_callback, write_outputs
from comparator.outcome import headline, status, verdict_notes
from comparator.reports.text import render_logprobs, render_report
from comparator.logprobs.sources import compare_logprob_sources
from comparator.cli.store import run_regress, run_store

__all__ = ["main", "build_parser", "build_logprobs_parser", "build_collect_parser", "build_calibrate_parser"]


def build_calibrate_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m comparator calibrate",
               description="Measure the noise of a baseline from benign variants (re-runs of its inputs with another "
                           "attention backend, chunk size, batch layout or thread count) and write it as NOISE.json "
                           "for `python -m comparator BASELINE TARGET --noise NOISE.json`.")
    p.add_argument("baseline", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file")
    p.add_argument("variants", nargs="+", metavar="VARIANT", help="benign re-runs of the baseline's inputs")
    p.add_argument("--out", required=True, metavar="NOISE.json", help="noise file to write (atomically)")
    p.add_argument("--threads", type=int, default=2, help="metric worker threads (default 2)")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="calibrate from variants that are not re-runs of the baseline's model (another model "
                        "spelling in cross-engine runs, other weights); the differences are recorded in the noise "
                        "file and every verdict judged by it warns about them")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    return p


def run_calibrate(argv: Sequence[str]) -> int:
    from comparator.noise.calibrate import calibrate
    from comparator.reports.text import render_noise

    args = build_calibrate_parser().parse_args(argv)
    with progress_callback(not args.quiet) as progress:
        noise = calibrate(args.baseline, args.variants, threads=args.threads,
                          allow_model_mismatch=args.allow_model_mismatch, progress=progress)
    noise.save(args.out)
    warn(f"variant {v}: {d} (allowed, recorded in {args.out})" for v, d in noise.model_mismatch)
    console = _console()
    if not args.quiet:
        render_noise(noise, console)
    parts = []
    if noise.tensors:
        positions = max(t.positions for t in noise.tensors.values())
        parts.append(f"{len(noise.tensors)} tensors ({positions} per-token values each)")
    if noise.logprobs is not None:
        parts.append(f"logprobs ({noise.logprobs.positions} positions per variant)")
    console.print(f"wrote {args.out}: noise of {' and '.join(parts)} from {len(noise.variants)} variants",
                  markup=False, highlight=False)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m comparator", description="Compare two driftscope dumps layer by layer "
               "(and their logprobs). `python -m comparator logprobs BASE TARGET` compares logprobs only, "
               "of dumps or engine JSONL files.")
    p.add_argument("baseline", help="dump directory (or SGLang dumper directory) of the trusted run")
    p.add_argument("target", help="dump directory (or SGLang dumper directory) of the run under test")
    threshold_flags(p)
    output_flags(p, json="the report", csv=True)
    p.add_argument("--tensors", action="store_true", help="also print one row per tensor")
    p.add_argument("--threads", type=int, default=None, help="metric worker threads (default 2)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    p.add_argument("--require-all", action="store_true",
                   help="exit 2 when either dump holds tensors the other lacks (default: compare the common "
                        "ones and say so in the verdict)")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="compare dumps of different models (architecture, layer count, hidden size, config "
                        "hash), e.g. cross-engine or quantized runs; the differences are reported")
    logprob_threshold_flags(p, threshold_row=True, noise_from="with --noise")
    noise_flags(p)
    add_output_flags(p)
    return p


def build_logprobs_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m comparator logprobs",
               description="Compare per-token logprobs of two sources: driftscope dumps recorded with --logprobs, "
                           "or JSONL files of SGLang /generate, vLLM prompt_logprobs or OpenAI completions responses.")
    p.add_argument("baseline", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file "
                                    "of the trusted run")
    p.add_argument("target", help="dump directory, engine JSONL file or llama.cpp KL-divergence base file "
                                  "of the run under test")
    output_flags(p, json="the verdict")
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="compare dumps of different models (architecture, layer count, hidden size, config hash)")
    logprob_threshold_flags(p, threshold_row=True, noise_from="with --noise")
    noise_flags(p)
    return p


def build_collect_parser() -> argparse.ArgumentParser:
    from comparator.logprobs.sources.collect import API_NAMES
    from comparator.logprobs.sources.server_http import retries_arg, timeout_arg

    p = Parser(prog="python -m comparator collect",
               description="Score fixed prompts on a live server (vLLM, SGLang, OpenAI-compatible) and write the "
                           "prompt logprobs as JSONL for `python -m comparator logprobs`.")
    p.add_argument("--server", required=True, metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api", required=True, choices=API_NAMES,
                   help="vllm (/v1/completions with prompt_logprobs), sglang (/generate), openai (echo + logprobs)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='JSONL: {"text": ...} or {"input_ids": [...]} per line')
    src.add_argument("--input-ids", action="append", default=None, help="comma-separated token ids (repeatable)")
    p.add_argument("--top-k", type=int, default=0, help="top-K logprobs per position besides the actual token")
    p.add_argument("--model", default=None, help="served model name (default: the first one /v1/models lists)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="JSONL file to write (one line per prompt)")
    p.add_argument("--timeout", type=timeout_arg, default=60.0,
                   help="seconds per request: connect, send and the whole answer (default 60, at most 86400)")
    p.add_argument("--retries", type=retries_arg, default=3,
                   help="retries on connection errors, timeouts, cut answers and HTTP 429/5xx, with backoff "
                        "(default 3, at most 100)")
    p.add_argument("--quiet", action="store_true", help="no summary line")
    return p


def run_collect(argv: Sequence[str]) -> int:
    from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids, read_prompts_file

    from comparator.logprobs.sources.collect import collect, prompts_from
    from comparator.logprobs.sources.server_http import ServerClient

    args = build_collect_parser().parse_args(argv)
    texts, ids = list(args.prompt or ()), [list(s) for s in parse_input_ids(args.input_ids or ())]
    if args.prompts:
        texts, ids = read_prompts_file(args.prompts)
    client = ServerClient(args.server, timeout=args.timeout, retries=args.retries)
    results = collect(client, args.api, prompts_from(texts or ([] if ids else list(BUILTIN_PROMPTS)), ids),
                      args.out, top_k=args.top_k, model=args.model)
    if not args.quiet:
        print(f"wrote {args.out}: {len(results)} requests, {sum(len(r.sequence) for r in results)} prompt positions "
              f"scored, top-k {args.top_k} ({args.api} at {client.base_url})")
    return EXIT_OK


def run_logprobs(argv: Sequence[str]) -> int:
    args = parse_args(build_logprobs_parser(), argv)
    noise = noise_args(args)
    if "rel_diff" in noise["noise_floors"]:
        raise UsageError("--noise-floor: comparator logprobs takes NAME=VALUE with NAME a logprob metric "
                         "(mse, mean_abs_err, max_abs_err, k3_mean, kl_mean, kl_max, topk_max_err)")
    verdict = compare_logprob_sources(args.baseline, args.target, model=args.threshold_row,
                                      explicit=logprob_thresholds(args.logprob_threshold),
                                      allow_model_mismatch=args.allow_model_mismatch, **noise)
    warn(verdict.noise.warnings if verdict.noise is not None else ())
    console = _console()
    if args.quiet:
        sides = [f"only in the {side}: {', '.join(map(repr, names[:3]))}"
                 f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
                 for side, names in (("baseline", verdict.unmatched_baseline), ("target", verdict.unmatched_target))
                 if names]
        note = f" (not compared, {'; '.join(sides)})" if sides else ""
        console.print(status(verdict.passed, ", ".join(verdict.failures())) + note,
                      markup=False, emoji=False, highlight=False)
    else:
        render_logprobs(verdict, console)
    _write(args.json, lambda p: write_json_atomic(p, verdict.to_json()))
    return EXIT_OK if verdict.passed else EXIT_DIVERGED


def run(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["logprobs"]:
        return run_logprobs(argv[1:])
    if argv[:1] == ["collect"]:
        return run_collect(argv[1:])
    if argv[:1] == ["calibrate"]:
        return run_calibrate(argv[1:])
    if argv[:1] == ["import-sglang"]:
        from dumper.engines.sglang import main_import

        return main_import(argv[1:])
    if argv[:1] == ["regress"]:
        return run_regress(argv[1:])
    if argv[:1] == ["store"]:
        return run_store(argv[1:])
    args = parse_args(build_parser(), argv)
    config = compare_config(args)
    check_distinct(args.baseline, args.target)  # before an SGLang side is converted into a temporary dump
    # either side may be an SGLang dumper directory: read as a temporary driftscope dump (dumper.engines.sglang)
    with _dump_side(args.baseline) as base, _dump_side(args.target) as target:
        with progress_callback(not args.quiet) as progress:
            report = compare_dumps(base, target, config, progress=progress)
        report = dataclasses.replace(report, baseline=args.baseline, target=args.target)  # the user's paths
        warn(report.warnings)
        if args.format == "table":  # with --format json, stdout carries the JSON report alone
            console = _console()
            if args.quiet:
                notes = verdict_notes(report)
                console.print(headline(report) + (f" ({'; '.join(notes)})" if notes else ""), markup=False, emoji=False,
                              highlight=False, soft_wrap=True)  # one line, whatever its length
            else:
                render_report(report, console, tensors=args.tensors)
        _write(args.json, report.write_json)
        _write(args.csv, report.write_csv)
        write_outputs(report, args, base, target)
    return EXIT_OK if report.passed else EXIT_DIVERGED


def _dump_side(path: str) -> contextlib.AbstractContextManager[str]:
    """``path`` itself, or for an SGLang dumper directory a temporary driftscope dump of it.

    :mod:`dumper.engines.sglang` (and torch with it) is imported only for a directory without
    a driftscope manifest, so comparing two driftscope dumps stays torch-free.
    """
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        from dumper.engines.sglang import is_sglang_dump, open_dump_side

        if is_sglang_dump(path):
            return open_dump_side(path)
    return contextlib.nullcontext(path)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: user errors become one line on stderr and a distinct exit code."""
    return guarded_main(run, argv)
