"""The grid of an invariance sweep: ``--grid KEY=V1,V2`` axes, their values checked, and the cells they make.

Grid keys are the engine's ``--engine-arg`` keys (its ``ENGINE_ARGS`` table), the run's own
``chunk_size`` (``none`` allowed), ``batch_size`` and ``new_tokens`` (the decode path), ``speculative``
(``off`` or a ``--speculative`` setting: verify passes, judged as decode cells are), and
``lengths``: prompt lengths, or ``block`` for ``block-1, block, block+1, 2*block-1, 2*block, 2*block+1``
(KV-cache bugs show by prompt length modulo the engine's KV block size). Every value goes through
the checks the ``run`` command applies (:func:`dumper.engines.base.check_engine_args`,
:class:`~dumper.prefill.run.RunConfig`), so a bad grid fails before any engine starts.

Cells are the cartesian product of the axes, ``lengths`` innermost: cells with the same engine
settings come one after another, so an engine that is kept between runs (vLLM's
:func:`~dumper.engines.vllm.load_llm`) serves all of them.

:func:`parse_grid` refuses a grid of more than ``max_cells`` cells (``--max-cells``, default
:data:`MAX_CELLS`) from the axes' value counts alone, before a value is parsed or a cell planned:
a typo'd grid of 10^6 cells would otherwise plan for minutes and take gigabytes.

Example::

    axes = parse_grid(["chunk_size=none,16", "lengths=block"])
    cells = plan_cells(template, axes, baseline_prompts, out="sweep", block_size=16)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dumper.engines import engine_adapter
from dumper.engines.base import EngineArg, check_engine_args
from dumper.errors import DriftscopeError, UsageError
from dumper.format.files import printable
from dumper.prefill.run import RunConfig, check_scored_positions
from dumper.prefill.speculative import parse_speculative

__all__ = [
    "Axis",
    "Cell",
    "RUN_KEYS",
    "SPECULATIVE",
    "LENGTHS",
    "BLOCK",
    "PREFIX_CACHING",
    "MAX_CELLS",
    "parse_grid",
    "plan_cells",
    "block_lengths",
    "describe",
    "axis_size",
    "check_cell_count",
]

RUN_KEYS = ("chunk_size", "batch_size", "new_tokens")
"""Grid keys that are :class:`RunConfig` fields."""
SPECULATIVE = "speculative"
"""The grid key of speculative decoding: ``off`` or a ``--speculative`` setting, its keys joined by ``;``
(``speculative=off,ngram:k=3;max=2``), since ``,`` separates the axis's values."""
OFF = "off"
LENGTHS = "lengths"
BLOCK = "block"
PREFIX_CACHING = "enable_prefix_caching"
"""The engine key whose ``true`` makes a cell warm the prefix cache and read it (vLLM)."""
MAX_CELLS = 4096
"""The default cap on a grid's cells (``--max-cells`` raises it): each cell is one engine run."""


@dataclass(frozen=True)
class Axis:
    """One ``--grid KEY=V1,V2,...``: a key and its values as given."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: its settings (parsed values by grid key) and the run that makes it.

    ``sequence_map[i]`` is the baseline sequence the cell's prompt ``i`` is (prompts shorter
    than ``length`` are left out); ``group`` numbers the cells' engine settings (all but ``lengths``).
    """

    index: int
    settings: dict[str, Any]
    config: RunConfig
    sequence_map: tuple[int, ...]
    length: int | None
    prefix_cache: bool
    group: int

    @property
    def name(self) -> str:
        return f"cell-{self.index:03d}"


def describe(settings: dict[str, Any]) -> str:
    """``chunk_size=none batch_size=2 lengths=17``: a cell's settings as the grid spells them."""

    def word(v: Any) -> str:
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={word(v)}" for k, v in settings.items())


def parse_grid(items: Sequence[str], *, max_cells: int = MAX_CELLS) -> tuple[Axis, ...]:
    """``["chunk_size=none,5", "lengths=block"]`` as axes; a malformed or repeated one, or a grid of more
    than ``max_cells`` cells (:func:`check_cell_count`), is a one-line UsageError. Linear in the values."""
    axes: list[Axis] = []
    keys: set[str] = set()
    for item in items:
        key, sep, rest = item.partition("=")
        key = key.strip()
        values = tuple(v.strip() for v in rest.split(","))
        if not sep or not key or not all(values):
            raise UsageError(f"--grid {printable(item)!r}: expected KEY=V1,V2,... with no empty value")
        if key in keys:
            raise UsageError(f"--grid {printable(key)}: given twice; list all its values in one --grid")
        if len(set(values)) != len(values):
            raise UsageError(f"--grid {printable(item)!r}: a value is repeated")
        keys.add(key)
        axes.append(Axis(key, values))
    if not axes:
        raise UsageError("--grid: give at least one axis, e.g. --grid chunk_size=none,16")
    check_cell_count(axes, max_cells)
    return tuple(axes)


def axis_size(axis: Axis) -> int:
    """The values ``axis`` multiplies the cells by, at most: ``lengths=block`` counts as its six lengths."""
    if axis.key != LENGTHS:
        return len(axis.values)
    return sum(len(block_lengths(1)) if v.lower() == BLOCK else 1 for v in axis.values)


def check_cell_count(axes: Sequence[Axis], max_cells: int) -> None:
    """Refuse a grid of more than ``max_cells`` cells in one line, from the axes' value counts alone.

    The count is the exact product of :func:`axis_size` (an upper bound where ``lengths=block``
    repeats a length the axis also lists): nothing is parsed or planned, so a grid of any size is
    refused in time and memory linear in its command line.
    """
    if type(max_cells) is not int or max_cells < 1:
        raise UsageError(f"--max-cells must be a positive integer, got {max_cells!r}")
    sizes = [axis_size(a) for a in axes]
    cells = math.prod(sizes)
    if cells > max_cells:
        counts = " x ".join(f"{printable(a.key)} {n}" for a, n in zip(axes, sizes, strict=True))
        # int -> str refuses past 4,300 digits (sys.set_int_max_str_digits): a number that long is shown as its size
        shown = str(cells) if cells.bit_length() < 14_000 else f"about 10^{int(math.log10(cells))}"
        raise UsageError(
            f"--grid: {shown} cells ({counts}), more than --max-cells {max_cells}; "
            "narrow an axis, or raise the cap with --max-cells N"
        )


def block_lengths(block: int) -> tuple[int, ...]:
    """The prompt lengths around one and two KV blocks, where a block-boundary bug shows."""
    return (block - 1, block, block + 1, 2 * block - 1, 2 * block, 2 * block + 1)


def _int(key: str, value: str, *, none: bool = False) -> int | None:
    if none and value.lower() == "none":
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 12):
        raise UsageError(f"--grid {key}={printable(value)}: expected a positive integer{' or none' if none else ''}")
    return int(value)


def _lengths(values: Sequence[str], block_size: int | None) -> list[int]:
    out: dict[int, None] = {}  # ordered, and a repeated length is found in O(1)
    for v in values:
        if v.lower() == BLOCK:
            if block_size is None:
                raise UsageError(
                    f"--grid {LENGTHS}={BLOCK}: the engine's KV block size is unknown; pass --block-size N"
                )
            out.update(dict.fromkeys(block_lengths(block_size)))
        else:
            n = _int(LENGTHS, v)
            assert n is not None
            if n < 1:
                raise UsageError(f"--grid {LENGTHS}={v}: a prompt length must be >= 1")
            out[n] = None
    return list(out)


def _axis_values(axis: Axis, table: dict[str, EngineArg], engine: str, block_size: int | None) -> list[Any]:
    """An axis's values parsed as its key takes them; an unknown key or a bad value is a UsageError."""
    if axis.key == LENGTHS:
        return list(_lengths(axis.values, block_size))
    if axis.key in RUN_KEYS:
        return [_int(axis.key, v, none=axis.key == "chunk_size") for v in axis.values]
    if axis.key == SPECULATIVE:
        for v in axis.values:
            if v.lower() != OFF:
                parse_speculative(v)  # a bad setting fails before any engine starts
        return [OFF if v.lower() == OFF else v for v in axis.values]
    arg = table.get(axis.key)
    if arg is None:
        keys = ", ".join([*RUN_KEYS, SPECULATIVE, LENGTHS, *table])
        raise UsageError(f"--grid {printable(axis.key)}: unknown key; --engine {engine} sweeps {keys}")
    out = []
    for v in axis.values:
        try:
            out.append(arg.parse(axis.key, v))
        except UsageError:
            raise UsageError(f"--grid {axis.key}={printable(v)}: expected {arg.allowed()} ({arg.help})") from None
    return out


def _prefix_cache(settings: dict[str, Any], fixed: dict[str, Any]) -> bool:
    return bool(settings.get(PREFIX_CACHING, fixed.get(PREFIX_CACHING, False)))


def _cell_config(
    template: RunConfig, settings: dict[str, Any], seqs: list[list[int]], out: Path, prefix: bool
) -> RunConfig:
    """The run of one cell: the template with the cell's settings, prompts and directory."""
    engine_args = tuple(
        (k, str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in settings.items()
        if k not in (*RUN_KEYS, SPECULATIVE, LENGTHS)
    )
    run: dict[str, Any] = {k: settings[k] for k in RUN_KEYS if k in settings}
    if SPECULATIVE in settings:
        run[SPECULATIVE] = None if settings[SPECULATIVE] == OFF else parse_speculative(settings[SPECULATIVE])
    cfg = replace(
        template,
        out=str(out),
        prompts=(),
        input_ids=tuple(tuple(s) for s in seqs),
        engine_args=template.engine_args + engine_args,
        warm_prefix_cache=prefix,
        logprobs=None if prefix else template.logprobs,
        **run,
    )  # vLLM: no cache read with prompt_logprobs
    check_engine_args(cfg, engine_adapter(cfg.engine).ENGINE_ARGS)
    check_scored_positions(cfg, seqs)
    return cfg


def _truncated(
    prompts: Sequence[Sequence[int]], length: int | None, baseline: str
) -> tuple[list[list[int]], tuple[int, ...]]:
    """The prompts cut to ``length`` tokens (shorter ones left out) and the baseline index of each."""
    if length is None:
        return [list(p) for p in prompts], tuple(range(len(prompts)))
    kept = tuple(i for i, p in enumerate(prompts) if len(p) >= length)
    if not kept:
        raise UsageError(
            f"--grid {LENGTHS}={length}: no prompt of the baseline {baseline} has {length} tokens "
            f"(the longest has {max(map(len, prompts))})"
        )
    return [list(prompts[i][:length]) for i in kept], kept


def plan_cells(
    template: RunConfig,
    axes: Sequence[Axis],
    prompts: Sequence[Sequence[int]],
    *,
    out: str,
    baseline: str,
    block_size: int | None,
) -> list[Cell]:
    """Every cell of the grid, each one's run checked as ``run`` checks it, ``lengths`` the innermost axis.

    ``template`` holds what is fixed across cells; ``prompts`` are the baseline's token ids.
    """
    table = engine_adapter(template.engine).ENGINE_ARGS
    fixed = check_engine_args(template, table)
    clash = [a.key for a in axes if a.key in fixed]
    if clash:
        raise UsageError(f"--grid {clash[0]}: also given as --engine-arg; sweep it or fix it, not both")
    ordered = [a for a in axes if a.key != LENGTHS] + [a for a in axes if a.key == LENGTHS]
    values = [_axis_values(a, table, template.engine, block_size) for a in ordered]
    cells, groups = [], {}
    for combo in itertools.product(*values):
        settings = dict(zip((a.key for a in ordered), combo, strict=True))
        length = settings.get(LENGTHS)
        seqs, seq_map = _truncated(prompts, length, baseline)
        prefix = _prefix_cache(settings, fixed)
        index = len(cells)
        try:
            cfg = _cell_config(template, settings, seqs, Path(out) / f"cell-{index:03d}" / "dump", prefix)
        except DriftscopeError as e:
            raise type(e)(f"--grid {describe(settings)}: {e}") from None
        group = groups.setdefault(tuple((k, v) for k, v in settings.items() if k != LENGTHS), len(groups))
        cells.append(Cell(index, settings, cfg, seq_map, length, prefix, group))
    return cells
