"""An invariance sweep: one capture per cell of a grid of settings, each compared with one baseline.

The job is the baseline dump's own (its manifest's ``extra.input_ids``). Each cell runs it
through the engine's ``run_dump`` (what ``python -m dumper run`` calls) with the cell's
settings (:mod:`dumper.jobs.sweep.grid`), writes ``OUT/cell-NNN/dump``, compares it with
:func:`comparator.compare_dumps` and writes ``OUT/cell-NNN/report.json``; ``OUT/sweep.json``
holds the :class:`~dumper.jobs.sweep.results.SweepResult`.

Two kinds of cell record part of the baseline's rows by design, and are judged on those rows
only (``CompareConfig(subset=True)``, :mod:`comparator.hidden.subset`):

- ``lengths=L``: the prompts cut to ``L`` tokens (shorter ones left out); by causality their
  rows are the baseline's first ``L`` positions;
- ``enable_prefix_caching=true`` (vLLM): the prompts run once unrecorded first
  (``RunConfig.warm_prefix_cache``), so the recorded run reads the prefix cache and records the
  rows computed on top of the reused KV blocks; the manifest's ``extra.prefix_cache_hits`` says
  how many positions of each prompt the cache served. Zero hits fails the cell (never a silent
  pass), and such a cell records no logprobs (vLLM never reads the cache for a request that
  asks for ``prompt_logprobs``).

A ``new_tokens=N`` cell (N > 0) decodes N tokens per prompt (:mod:`dumper.prefill.decode`); its
generated tokens are its own, so it is judged not against the baseline but against the
transformers prefill of the tokens it fed (``--tokens-from``), made with the baseline's model,
dtype, seed and attention into ``OUT/cell-NNN/prefill``.

Example::

    from dumper.prefill.run import RunConfig
    from dumper.jobs.sweep.run import SweepConfig, parse_grid, sweep

    result = sweep(SweepConfig(baseline="dumps/base", out="sweep", template=RunConfig(out="sweep", layers="all"),
                               grid=parse_grid(["chunk_size=none,5,16", "lengths=block"])))
    print(result.passed, [c.settings for c in result.cells if not c.passed])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from comparator import CompareConfig, Outcome, Report, clause, compare_dumps, status, write_json
from dumper.engines import RunDump, engine_runner
from dumper.errors import DriftscopeError, UsageError
from dumper.format import LOGITS_POINT, LOGPROB_POINT, PAD_SEQUENCE, Manifest, load_manifest, write_json_atomic
from dumper.format.decode import CACHE_HIT
from dumper.format.points import CACHE_POINTS, INPUT
from dumper.jobs.sweep.engine import engine_block_size, held_engine, pinned_engine_args, preflight
from dumper.jobs.sweep.grid import BLOCK, LENGTHS, Axis, Cell, describe, plan_cells
from dumper.jobs.sweep.results import PREFIX_CACHE_NOTE, ZERO_HITS, CellLogprobs, CellResult, SweepResult
from dumper.prefill.run import RunConfig, tokens_from
from dumper.progress import ProgressFn

__all__ = ["SweepConfig", "sweep", "plan_sweep", "run_cell", "baseline_prompts", "baseline_defaults"]

CellFn = Callable[[CellResult, int], None]
"""``on_cell(result, cells)``: called as each cell finishes, with the number of cells."""


@dataclass(frozen=True)
class SweepConfig:
    """What ``python -m dumper sweep`` does.

    Attributes:
        baseline: the dump every cell is compared with; its ``extra.input_ids`` are the job.
        out: a new directory: ``cell-NNN/dump``, ``cell-NNN/report.json`` and ``sweep.json``.
        template: the run settings fixed across cells (model, engine, layers, dtype, logprobs,
            ``--engine-arg``); its ``out``, ``prompts`` and ``input_ids`` are replaced per cell.
        grid: the axes (:func:`~dumper.jobs.sweep.grid.parse_grid`).
        block_size: the KV block size ``lengths=block`` expands with (None: the engine's).
        compare: the comparison's thresholds.
    """

    baseline: str
    out: str
    template: RunConfig
    grid: tuple[Axis, ...]
    block_size: int | None = None
    compare: CompareConfig = field(default_factory=CompareConfig)


def baseline_prompts(path: str) -> tuple[Manifest, list[list[int]]]:
    """The baseline's manifest and its job's token ids (``extra.input_ids`` of a ``dumper run`` dump)."""
    m = load_manifest(path)
    ids = m.extra.get("input_ids")
    if (
        m.extra.get("job") != "prefill"
        or not isinstance(ids, list)
        or not ids
        or not all(isinstance(s, list) and s and all(type(t) is int and t >= 0 for t in s) for s in ids)
    ):
        raise UsageError(
            f"{path}: not the dump of a prefill job with its prompts' token ids (extra.input_ids); "
            "sweep needs a baseline from `python -m dumper run`"
        )
    return m, ids


def baseline_defaults(manifest: Manifest) -> dict[str, Any]:
    """The ``dtype``, ``seed``, ``layers`` and capture ``points`` the baseline ran with: the sweep's defaults, so its
    cells match it (points inside a layer included)."""
    layers, points = manifest.capture_signature.get("layers"), manifest.capture_signature.get("points")
    seed = manifest.extra.get("seed")
    return {
        "dtype": manifest.extra.get("dtype") or "float32",
        "seed": seed if type(seed) is int else 0,
        "layers": ",".join(map(str, layers)) if layers else None,
        "points": tuple(points) if points else (INPUT,),
    }


def _without_block(axes: tuple[Axis, ...]) -> tuple[Axis, ...]:
    out = []
    for a in axes:
        values = tuple(v for v in a.values if a.key != LENGTHS or v.lower() != BLOCK)
        if values:
            out.append(Axis(a.key, values))
    return tuple(out)


def _check_inputs(cfg: SweepConfig, manifest: Manifest) -> None:
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {cfg.out}: exists and is not an empty directory; choose a new one")
    if cfg.block_size is not None and cfg.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {cfg.block_size}")
    if cfg.template.logprobs is not None and not any(r.point == LOGPROB_POINT for r in manifest.tensors):
        raise UsageError(
            f"--logprobs: the baseline {cfg.baseline} recorded no logprobs to compare with; "
            "dump it with --logprobs, or sweep without"
        )


def plan_sweep(cfg: SweepConfig) -> tuple[list[Cell], int | None]:
    """Every cell of ``cfg``, checked before any cell runs, and the block size ``lengths=block`` used.

    The grid is checked in full before an engine starts; only then is an engine loaded to read
    its block size (vLLM, for ``lengths=block`` without ``block_size``).
    """
    manifest, prompts = baseline_prompts(cfg.baseline)
    _check_inputs(cfg, manifest)
    template = replace(cfg.template, out=cfg.out, prompts=(), input_ids=tuple(tuple(s) for s in prompts))
    most = max((int(v) for a in cfg.grid if a.key == "new_tokens" for v in a.values if v.strip().isdigit()), default=0)
    template = pinned_engine_args(template, {a.key for a in cfg.grid}, new_tokens=most)  # bad values fail below
    block = cfg.block_size
    plan = {"prompts": prompts, "out": cfg.out, "baseline": cfg.baseline}
    if block is None and any(v.lower() == BLOCK for a in cfg.grid if a.key == LENGTHS for v in a.values):
        first = _preflight(plan_cells(template, _without_block(cfg.grid), block_size=None, **plan))
        block = engine_block_size(replace(first[0].config, input_ids=template.input_ids))
    return _preflight(plan_cells(template, cfg.grid, block_size=block, **plan)), block


def _preflight(cells: list[Cell]) -> list[Cell]:
    """``cells``, each passed by its engine adapter's own checks (:func:`~dumper.jobs.sweep.engine.preflight`)."""
    for cell in cells:
        try:
            preflight(cell.config)
        except DriftscopeError as e:
            raise type(e)(f"--grid {describe(cell.settings)}: {e}") from None
    return cells


def sweep(
    cfg: SweepConfig,
    *,
    runner: RunDump | None = None,
    on_cell: CellFn | None = None,
    progress: ProgressFn | None = None,
) -> SweepResult:
    """Run every cell of ``cfg`` in order and compare it with the baseline; write ``OUT/sweep.json``.

    ``runner`` runs one cell's :class:`RunConfig` (default: the engine's ``run_dump``; a test
    passes one with a model in hand). An error in a cell is raised with the cell's name and
    settings; a divergence is a cell with ``passed`` False, not an error.
    """
    start = time.perf_counter()
    run = runner or engine_runner(cfg.template.engine)
    cells, block = plan_sweep(cfg)
    results = []
    for cell in cells:
        try:
            result = run_cell(cell, cfg, run, progress=progress)
        except DriftscopeError as e:
            raise type(e)(f"{cell.name} ({describe(cell.settings)}): {e}") from None
        results.append(result)
        if on_cell is not None:
            on_cell(result, len(cells))
    out = SweepResult(
        baseline=cfg.baseline,
        out=cfg.out,
        engine=cfg.template.engine,
        block_size=block,
        wall_s=time.perf_counter() - start,
        cells=tuple(results),
    )
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(cfg.out) / "sweep.json", out.to_json())
    return out


def _row_starts(manifest: Manifest) -> dict[int, int]:
    """The first hidden-state position each sequence of a dump recorded."""
    starts: dict[int, int] = {}
    for rec in manifest.tensors:
        if (
            rec.point in (LOGPROB_POINT, LOGITS_POINT, *CACHE_POINTS)  # the cache points hold a hit's served rows
            or rec.positions is None
            or rec.sequence_ids is None
        ):
            continue
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        for s in np.unique(seq[seq != PAD_SEQUENCE]).tolist():
            first = int(pos[seq == s].min())
            starts[s] = min(first, starts.get(s, first))
    return starts


def _cache_hits(cell: Cell, manifest: Manifest) -> tuple[list[int] | None, list[str]]:
    """The prefix-cache hits the dump records (one per prompt) and what is wrong with them, if anything."""
    hits = manifest.extra.get("prefix_cache_hits")
    if not (isinstance(hits, list) and len(hits) == len(cell.sequence_map) and all(type(h) is int for h in hits)):
        return None, ["prefix caching on but the dump records no prefix_cache_hits"] if cell.prefix_cache else []
    reasons = [ZERO_HITS] if cell.prefix_cache and not any(hits) else []
    starts = _row_starts(manifest)
    wrong = [(s, starts[s], h) for s, h in enumerate(hits) if s in starts and starts[s] != h]
    if wrong:
        s, first, h = wrong[0]
        reasons.append(
            f"sequence {cell.sequence_map[s]}: rows recorded from position {first}, but the prefix "
            f"cache served {h} positions ({len(wrong)} sequences so)"
        )
    return hits, reasons


def _cell_word(report: Report, reasons: list[str]) -> str:
    if reasons:
        return status(False, reasons[0])
    if report.passed:
        return status(True)
    outcome = Outcome.of(report)
    fd = report.first_divergent
    if outcome is Outcome.TENSORS and fd is not None and fd.point in CACHE_POINTS:  # the cache point, by name
        return status(False, f"layer {fd.layer} {fd.point}" + (f", {fd.phase}" if fd.phase == CACHE_HIT else ""))
    return status(False, "hidden states" if outcome is Outcome.TENSORS else clause(report).strip("()"))


def _logprobs(cell: Cell, cfg: SweepConfig, report: Report) -> CellLogprobs | None:
    if cell.prefix_cache and cfg.template.logprobs is not None:
        return CellLogprobs(note=PREFIX_CACHE_NOTE)
    v = report.logprobs
    if v is None:
        return None
    return CellLogprobs(
        passed=v.passed,
        max_abs_err=v.max_abs_err.value,
        kl_mean=v.kl_mean,
        kl_max=v.kl_max.value,
        compared_positions=v.compared_positions,
    )


def _counterpart(cell: Cell, cfg: SweepConfig) -> str:
    """A ``new_tokens`` cell's reference: the transformers prefill of the tokens it fed, by the baseline's model."""
    m = load_manifest(cfg.baseline)
    out = Path(cfg.out) / cell.name / "prefill"
    ref = RunConfig(
        out=str(out),
        model=str(m.model.get("name")),
        dtype=str(m.extra.get("dtype") or cfg.template.dtype),
        attn=str(m.extra.get("attn") or "eager"),
        seed=int(m.extra.get("seed") or 0),
        layers=cfg.template.layers,
        points=cfg.template.points,
        logprobs=None if cell.config.logprobs is None else cfg.template.logprobs,
    )
    engine_runner("transformers")(tokens_from(ref, cell.config.out))
    return str(out)


def run_cell(cell: Cell, cfg: SweepConfig, runner: RunDump, *, progress: ProgressFn | None = None) -> CellResult:
    """Run one cell, compare its dump with the baseline, write its report; the cell's result."""
    before = held_engine(cell.config.engine)
    start = time.perf_counter()
    manifest = runner(cell.config, progress=progress)
    run_s = time.perf_counter() - start
    after = held_engine(cell.config.engine)
    reused = before is not None and after is not None and before() is not None and before() is after()
    hits, reasons = _cache_hits(cell, manifest)
    identity = tuple(range(len(cell.sequence_map)))
    decoded = bool(cell.config.new_tokens)  # its own tokens: judged against its prefill counterpart, ids as its own
    subset = cell.prefix_cache or any(hits or ()) or cell.length is not None and not decoded
    compare = replace(
        cfg.compare, subset=subset, sequence_map=() if cell.sequence_map == identity or decoded else cell.sequence_map
    )
    report = compare_dumps(_counterpart(cell, cfg) if decoded else cfg.baseline, cell.config.out, compare)
    path = Path(cfg.out) / cell.name / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(report, path)
    return CellResult(
        index=cell.index,
        settings=dict(cell.settings),
        passed=report.passed and not reasons,
        verdict=_cell_word(report, reasons),
        report=str(path),
        dump=str(cell.config.out),
        wall_s=time.perf_counter() - start,
        run_s=run_s,
        engine_reused=reused,
        reasons=tuple(reasons),
        first_divergent=report.first_divergent,
        logprobs=_logprobs(cell, cfg, report),
        cache_hits=None if hits is None else sum(hits),
        cache_hits_by_sequence=None if hits is None else tuple(hits),
    )
