"""What ``python -m comparator regress`` and ``python -m comparator store`` do (their flags:
:mod:`comparator.cli.store`, imported without this module's store and rich tables).

Thin: each command takes its parsed flags, calls :func:`comparator.store.regress` or a :class:`RunStore` method,
prints, and maps the result to an exit code (0 passed, 1 divergence, 2 unusable).

Text from the store (run ids, folder names, models, problems) is printed as plain text, never
as rich markup: a folder named ``m[/]`` is shown, not interpreted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table
from rich.text import Text

from comparator.cli.args import compare_config, stdout_console, warn, write_output
from comparator.cli.bisect import GIT_SKIP, git_skip
from comparator.config import CompareConfig
from comparator.noise.calibrate import calibrate
from comparator.outcome import UNUSABLE, status
from comparator.reports.text import render_report
from comparator.store import Label, RunEntry, RunStore, StoreError
from comparator.store.record import RunRecord
from comparator.store.regress import RegressResult, regress
from comparator.store.select import current_baselines
from dumper.errors import EXIT_UNUSABLE, CorruptDumpError, DriftscopeError, UsageError
from dumper.format import MANIFEST_NAME, load_manifest, write_json_atomic
from dumper.format.describe import describe_lines
from dumper.format.files import printable
from dumper.format.manifest import parse_manifest
from dumper.format.remote import fetched

__all__ = ["cmd_regress", "cmd_store"]


def cmd_regress(args: argparse.Namespace) -> int:
    """``python -m comparator regress``: judge the run, store it, print; exit with the result's code."""
    config = compare_config(args)
    if args.build is not None and not args.git_bisect:
        raise UsageError("--build labels a run of --git-bisect")
    if args.git_bisect:
        if args.bootstrap:
            raise UsageError("--git-bisect judges a commit against the store's baseline; it never bootstraps one")
        try:  # the run under test is this commit's: its problems are a skip
            with fetched(args.run_dir) as run_dir:
                load_manifest(run_dir)
        except DriftscopeError as e:
            return git_skip(e)
    with fetched(args.run_dir) as run_dir:  # a dump at a URL: judged and stored from a local copy
        result = regress(
            run_dir,
            args.store,
            model=args.run_group,
            bootstrap=args.bootstrap,
            allow_env_mismatch=args.allow_env_mismatch,
            config=config,
            cache_dir=args.cache_dir,
            require_all=not args.allow_missing,
            calibrate_from=args.calibrate,
            build=(args.build or "git bisect") if args.git_bisect else None,
        )
    warn(result.warnings)
    _print_result(result, stdout_console(), quiet=args.quiet, tensors=args.tensors)
    write_output(args.json, lambda p: write_json_atomic(p, result.to_json()))
    return GIT_SKIP if args.git_bisect and result.exit_code == EXIT_UNUSABLE else result.exit_code


def _print_result(result: RegressResult, console: Console, *, quiet: bool, tensors: bool) -> None:
    if result.report is not None and not quiet:
        render_report(result.report, console, tensors=tensors)
    style = "bold green" if result.exit_code == 0 else "bold red"
    console.print(Text(result.message, style=style))


def _open(url: str) -> RunStore:
    store = RunStore(url)
    if not store.exists():
        raise StoreError(
            f"{url}: no run store here (no runs/ folder); python -m comparator regress RUN_DIR "
            f"--store {url} --bootstrap creates one"
        )
    return store


def cmd_store(args: argparse.Namespace) -> int:
    """``python -m comparator store ...``: the store command ``args.command`` names."""
    store = _open(args.url)
    console = stdout_console()
    if args.command == "ls":
        _ls(store, console, run_group=args.run_group, label=args.label)
    elif args.command == "show":
        _show(store, args.run_id, console)
    elif args.command == "promote":
        _promote(store, args, console)
    else:
        res = store.prune(args.keep, dry_run=args.dry_run)
        verb = "would delete" if args.dry_run else "deleted"
        for name in res.deleted:
            console.print(Text(f"{verb} {printable(name)}"))
        for name in res.protected:
            console.print(Text(f"kept {name} (current baseline)"))
        warn([f"left alone: {printable(s)}" for s in res.skipped])
        console.print(f"{verb} {len(res.deleted)} entries; kept {len(res.kept) + len(res.protected)} runs")
    return 0


def _promote(store: RunStore, args: argparse.Namespace, console: Console) -> None:
    """Relabel a run ``baseline``; with ``--calibrate``, first measure its noise against its stored dump."""
    rec = store.get(args.run_id)
    noise = None
    if args.calibrate:
        CompareConfig(threads=args.threads)  # checks the thread count before any work
        with store.local_dump(rec.run_id) as dump:
            noise = calibrate(
                dump, args.calibrate, threads=args.threads, allow_model_mismatch=args.allow_model_mismatch
            )
        noise = replace(noise, baseline=store.where(rec.run_id, "dump"))  # not the temporary copy of a remote dump
    new = store.promote(rec.run_id, noise)
    line = f"run {new.run_id} of model {printable(repr(new.model))} is a baseline now (was {rec.label})"
    if noise is not None:
        line += f"; calibrated from {len(noise.variants)} variants ({store.where(new.run_id, 'noise.json')})"
    elif new.calibration is None:
        line += (
            "; not calibrated: runs are judged against it by the fixed thresholds (--calibrate VARIANT ... "
            "measures its noise)"
        )
    else:
        line += f"; it keeps its noise from {new.calibration.variants} variants"
    console.print(Text(line))


def _calibration(store: RunStore, rec: RunRecord) -> str:
    """One line on a run's calibration, its ``noise.json`` read and checked (a problem is warned about)."""
    if rec.calibration is None:
        return "calibration: none (runs judged against this one use the fixed thresholds)"
    try:
        stored = store.noise(rec)
    except StoreError as e:
        warn([str(e)])
        return f"calibration: {UNUSABLE} ({e})"
    assert stored is not None
    cal = stored.calibration
    on = "this run" if cal.measured_on == rec.run_id else f"run {cal.measured_on} (inherited)"
    lp = f", logprobs over {stored.noise.logprobs.positions} positions" if stored.noise.logprobs is not None else ""
    return (
        f"calibration: noise of {len(stored.noise.tensors)} tensors{lp} from {cal.variants} variants, "
        f"measured on {on} at {printable(_created(cal.created_at))} ({store.where(rec.run_id, 'noise.json')})"
    )


def _created(rec_created: str) -> str:
    try:
        t = datetime.fromisoformat(rec_created).astimezone(timezone.utc)
    except (ValueError, OverflowError):
        return rec_created
    return f"{t:%Y-%m-%d %H:%M:%S}"


def _ls(store: RunStore, console: Console, *, run_group: str | None, label: str | None) -> None:
    entries = store.runs()
    current = current_baselines(entries)
    recs = [
        e.record
        for e in entries
        if e.record is not None
        and (not run_group or e.record.model == run_group)
        and (not label or e.record.label == label)
    ]
    builds = any(r.build is not None for r in recs)  # a build column only where a bisection stored runs
    table = Table(title=Text(f"runs in {store.url}"), title_justify="left")
    for col in ("run id", "created (UTC)", "model", "label", *("build",) * builds, "baseline", "verdict"):
        table.add_column(col, no_wrap=col in ("run id", "created (UTC)", "baseline"))
    for rec in recs:
        tag = rec.label.value + (" (current)" if rec.run_id in current else "")
        style = {Label.FAILED: "red", Label.BASELINE: "bold", Label.BISECT: "dim"}.get(rec.label)
        build = [Text(printable(rec.build or "-"))] * builds
        table.add_row(
            rec.run_id,
            Text(printable(_created(rec.created_at))),
            Text(printable(rec.model)),
            Text(tag, style=style or ""),
            *build,
            rec.baseline_run or "-",
            Text(printable(rec.verdict())),
        )
    broken: list[RunEntry] = [e for e in entries if not e.complete]
    for e in broken:
        table.add_row(
            Text(printable(e.name)),
            "-",
            "-",
            Text(e.status.upper(), style="bold yellow"),
            *["-"] * builds,
            "-",
            Text(e.problem or ""),
        )
    console.print(table)
    console.print(f"{len(recs)} runs shown; {len(broken)} incomplete, corrupt or staging entries")
    warn([e.problem for e in broken if e.status.warned and e.problem])


def _show(store: RunStore, run_id: str, console: Console) -> None:
    rec = store.get(run_id)
    console.print_json(json.dumps(rec.to_json()))
    for line in _dump_lines(store, run_id):
        console.print(Text(line), soft_wrap=True)  # one line each, as python -m dumper ls prints them
    console.print(Text(_calibration(store, rec)))
    report = store.report_json(run_id)
    if report is not None:
        matched = report.get("matched")
        console.print(
            Text(
                f"report: {matched if type(matched) is int else '?'} tensors compared against baseline "
                f"{rec.baseline_run}; {status(report.get('passed') is True)}"
            )
        )


def _dump_lines(store: RunStore, run_id: str) -> list[str]:
    """The stored dump described as ``python -m dumper ls`` describes a dump (:mod:`dumper.format.describe`).

    Its manifest passes every check of the dump format first; a broken one is one ``UNUSABLE`` line
    and a warning, so the run's record and calibration are still shown.
    """
    where = store.where(run_id, "dump", MANIFEST_NAME)
    try:
        manifest = parse_manifest(store.manifest_json(run_id), where)
    except CorruptDumpError as e:
        warn([str(e)])
        return [f"dump: {UNUSABLE} ({e})"]
    return list(describe_lines(manifest))
