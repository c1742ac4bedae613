"""Where logprobs come from: a driftscope dump, or an engine's JSONL output (SGLang, vLLM, OpenAI).

A dump's sequence ``s`` becomes request ``"s"`` (the dumper's runner numbers prompts from 0),
with its token ids taken from the run's recorded ``input_ids`` where the rows do not cover them.
Logits rows (``--save-logits``) come with their positions for full-distribution KL; a request
whose logits lie in one record is handed on as a memory-mapped view, several records (chunked
prefill) are joined.

Example::

    from comparator.sources import compare_logprob_sources
    verdict = compare_logprob_sources("dumps/a", "sglang_responses.jsonl")
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dumper.errors import NotComparableError, UsageError
from dumper.format import (
    LOGITS,
    LOGPROB_TOKEN_ID,
    LOGPROB_TOP_ID,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
    DumpReader,
    TensorRecord,
    to_float64,
)

from .engines import read_logprobs_jsonl
from .logprobs import UNKNOWN_TOKEN, LogprobThresholds, LogprobVerdict, SequenceLogprobs, compare_logprobs

__all__ = ["LogprobSource", "dump_logprobs", "read_logprob_source", "compare_logprob_sources"]


@dataclass(frozen=True)
class LogprobSource:
    """Logprobs of one side: per-request sequences and, when recorded, logits rows per request."""

    path: str
    model: str | None
    sequences: tuple[SequenceLogprobs, ...]
    logits: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None


def _rows(reader: DumpReader, names: set[str]) -> dict[str, dict[tuple[int, int, int], TensorRecord]]:
    """name -> (pass, rank, call) -> record, for the logprob records of a dump."""
    out: dict[str, dict[tuple[int, int, int], TensorRecord]] = defaultdict(dict)
    for rec in reader.manifest.tensors:
        if rec.name in names:
            out[rec.name][(rec.forward_pass, rec.rank, rec.call)] = rec
    return out


def dump_logprobs(reader: DumpReader) -> LogprobSource | None:
    """The logprobs a dump recorded (``python -m dumper run --logprobs``), or None if it has none."""
    recs = _rows(reader, {LOGPROB_TOKEN_ID, LOGPROB_VALUE, LOGPROB_TOP_ID, LOGPROB_TOP_VALUE, LOGITS})
    if not recs.get(LOGPROB_VALUE):
        return None
    per_seq: dict[int, dict[int, tuple[int, float, tuple | None]]] = defaultdict(dict)
    for key, rec in recs[LOGPROB_VALUE].items():
        ids_rec = recs[LOGPROB_TOKEN_ID].get(key)
        if ids_rec is None or rec.positions is None or rec.sequence_ids is None:
            raise NotComparableError(f"{reader.directory / rec.file}: logprobs of pass {key[0]} lack token ids or positions")
        values = reader.rows(rec)[:, 0]
        ids = reader.rows(ids_rec)[:, 0]
        top_ids = recs.get(LOGPROB_TOP_ID, {}).get(key)
        top_vals = recs.get(LOGPROB_TOP_VALUE, {}).get(key)
        ti = reader.rows(top_ids) if top_ids is not None else None
        tv = reader.rows(top_vals) if top_vals is not None else None
        for r, (pos, seq) in enumerate(zip(rec.row_positions(), rec.row_sequence_ids(), strict=True)):
            top = tuple(zip(ti[r].tolist(), tv[r].tolist(), strict=True)) if ti is not None and tv is not None else None
            if int(pos) in per_seq[int(seq)]:
                raise NotComparableError(f"{reader.directory}: sequence {seq} has two logprobs for position {pos}")
            per_seq[int(seq)][int(pos)] = (int(ids[r]), float(values[r]), top)
    inputs = reader.manifest.extra.get("input_ids") or []
    sequences = []
    for seq, rows in sorted(per_seq.items()):
        known = list(inputs[seq]) if 0 <= seq < len(inputs) else []
        n = max(len(known), max(rows) + 1)
        token_ids = [known[p] if p < len(known) else UNKNOWN_TOKEN for p in range(n)]
        logprobs: list[float | None] = [None] * n
        top: list[tuple | None] = [None] * n
        for p, (tid, lp, tk) in rows.items():
            if token_ids[p] not in (UNKNOWN_TOKEN, tid):
                raise NotComparableError(f"{reader.directory}: sequence {seq} position {p}: logprob rows score "
                                         f"token {tid} but the run's input has {token_ids[p]}")
            token_ids[p], logprobs[p], top[p] = tid, lp, tk
        has_top = any(t is not None for t in top)
        sequences.append(SequenceLogprobs(str(seq), token_ids, logprobs, top if has_top else None))
    return LogprobSource(str(reader.directory), reader.manifest.model.get("name"), tuple(sequences),
                         _dump_logits(reader, recs.get(LOGITS, {})))


def _dump_logits(reader: DumpReader, recs: Mapping[tuple[int, int, int], TensorRecord],
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    if not recs:
        return None
    pieces: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    for rec in recs.values():
        rows = reader.rows(rec)
        if rec.dtype == "BF16":
            rows = to_float64(rows, "BF16")
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        for s in np.unique(seq):
            sel = np.flatnonzero(seq == s)
            contiguous = sel.size and sel[-1] - sel[0] + 1 == sel.size
            pieces[int(s)].append((pos[sel], rows[sel[0]:sel[-1] + 1] if contiguous else rows[sel]))
    out = {}
    for s, ps in pieces.items():
        ps.sort(key=lambda p: int(p[0][0]))
        out[str(s)] = ps[0] if len(ps) == 1 else (np.concatenate([p for p, _ in ps]),
                                                 np.concatenate([r for _, r in ps]))
    return out


def read_logprob_source(path: str | os.PathLike[str]) -> LogprobSource:
    """A dump directory (with logprobs) or an engine JSONL file."""
    p = Path(path)
    if p.is_dir():
        src = dump_logprobs(DumpReader(p))
        if src is None:
            raise UsageError(f"{p}: the dump holds no logprobs (record them with `python -m dumper run --logprobs`)")
        return src
    if not p.is_file():
        raise UsageError(f"{p}: no such dump directory or JSONL file")
    return LogprobSource(str(p), None, tuple(read_logprobs_jsonl(p)))


def compare_logprob_sources(baseline: str | os.PathLike[str], target: str | os.PathLike[str], *,
                            model: str | None = None, explicit: Mapping[str, float | None] | None = None,
                            ) -> LogprobVerdict:
    """Compare the logprobs of two sources; thresholds resolve for ``model`` (default: the baseline's)."""
    base, targ = read_logprob_source(baseline), read_logprob_source(target)
    thresholds = LogprobThresholds.resolve(model or base.model, explicit=explicit)
    both = base.logits is not None and targ.logits is not None
    return compare_logprobs(base.sequences, targ.sequences, thresholds,
                            ref_logits=base.logits if both else None, tgt_logits=targ.logits if both else None)
