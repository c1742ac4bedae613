"""A driftscope dump as a logprob source: its logprob rows (``python -m dumper run --logprobs``) as sequences.

A dump's sequence ``s`` becomes request ``"s"`` (the dumper's runner numbers prompts from 0),
with its token ids taken from the run's recorded ``input_ids`` where the rows do not cover them.
Logits rows (``--save-logits``) come with their positions for full-distribution KL; a request
whose logits lie in one record is handed on as a memory-mapped view, several records (chunked
prefill) are joined. Every record is checked against the others before use: a disagreement is a
CorruptDumpError naming the file and tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from comparator.logprobs.sources.input_caps import MAX_POSITIONS, MAX_TOTAL_POSITIONS, TOKEN_ID_LIMIT
from comparator.logprobs.sources.source import LogprobSource
from comparator.logprobs.types import UNKNOWN_TOKEN, SequenceLogprobs, TopK
from dumper.errors import CorruptDumpError, NotComparableError, UsageError
from dumper.format import (
    LOGITS,
    LOGPROB_NAMES,
    LOGPROB_TOKEN_ID,
    LOGPROB_TOP_ID,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
    DumpReader,
    TensorRecord,
    to_float64,
)
from dumper.format.decode import scored_tokens
from dumper.format.dtypes import FLOAT_CODES, INT_CODES

__all__ = ["dump_logprobs"]

Row = tuple[int, float, TopK | None]
"""(token id, logprob, top-k) of one dumped position."""


def _rows(reader: DumpReader, names: frozenset[str]) -> dict[str, dict[tuple[int, int, int], TensorRecord]]:
    """name -> (pass, rank, call) -> record, for the logprob records of a dump."""
    out: dict[str, dict[tuple[int, int, int], TensorRecord]] = defaultdict(dict)
    for rec in reader.manifest.tensors:
        if rec.name in names:
            out[rec.name][(rec.forward_pass, rec.rank, rec.call)] = rec
    return out


def _where(reader: DumpReader, rec: TensorRecord) -> str:
    return f"{reader.directory / rec.file}: {rec.name} (pass {rec.forward_pass}, rank {rec.rank})"


def _checked(reader: DumpReader, rec: TensorRecord, n: int, width: int | None, *, ids: bool) -> np.ndarray:
    """``rec``'s rows as int64 (token ids, each in range) or float64, after checking dtype and shape."""
    if rec.dtype not in (INT_CODES if ids else FLOAT_CODES):
        kind = "an integer" if ids else "a float"
        raise CorruptDumpError(f"{_where(reader, rec)}: dtype {rec.dtype} is not {kind} type")
    rows = reader.rows(rec)
    if rows.shape[0] != n or (width is not None and rows.shape[1] != width):
        raise CorruptDumpError(
            f"{_where(reader, rec)}: shape {list(rec.shape)} does not hold {n} rows"
            + (f" of {width}" if width is not None else "")
        )
    if not ids:
        return to_float64(rows, rec.dtype)
    out = rows.astype(np.int64)
    bad = np.flatnonzero((out < 0) | (out >= TOKEN_ID_LIMIT))
    if bad.size:
        raise CorruptDumpError(
            f"{_where(reader, rec)}: row {bad[0] // max(1, out.shape[1])}: token id "
            f"{int(out.flat[bad[0]])} is out of range [0, 2^31)"
        )
    return out


def _pass_rows(
    reader: DumpReader, recs: Mapping[str, Mapping[tuple[int, int, int], TensorRecord]], key: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray, list[Row]]:
    """(positions, sequence ids, rows) of one pass's logprob records, all checked against each other."""
    rec = recs[LOGPROB_VALUE][key]
    ids_rec = recs[LOGPROB_TOKEN_ID].get(key)
    if ids_rec is None or rec.positions is None or rec.sequence_ids is None:
        raise NotComparableError(
            f"{reader.directory / rec.file}: logprobs of pass {key[0]} lack token ids or positions"
        )
    pos, seq = rec.row_positions(), rec.row_sequence_ids()
    n = int(pos.size)
    values = _checked(reader, rec, n, 1, ids=False)[:, 0]
    ids = _checked(reader, ids_rec, n, 1, ids=True)[:, 0]
    top_ids, top_vals = recs.get(LOGPROB_TOP_ID, {}).get(key), recs.get(LOGPROB_TOP_VALUE, {}).get(key)
    if (top_ids is None) != (top_vals is None):
        raise CorruptDumpError(f"{_where(reader, top_ids or top_vals)}: top-k ids and values are not both recorded")
    ti = tv = None
    if top_ids is not None and top_vals is not None:
        ti = _checked(reader, top_ids, n, None, ids=True)
        tv = _checked(reader, top_vals, n, ti.shape[1], ids=False)
    rows = [
        (
            int(ids[r]),
            float(values[r]),
            None if ti is None or tv is None else tuple(zip(ti[r].tolist(), tv[r].tolist(), strict=True)),
        )
        for r in range(n)
    ]
    return pos, seq, rows


def _check_extent(
    reader: DumpReader, recs: Mapping[tuple[int, int, int], TensorRecord], inputs: list[list[int]]
) -> None:
    """From the records' positions alone, before any row is read: each sequence's last position
    lies within its recorded prompt (``extra.input_ids``) and under MAX_POSITIONS, and the
    sequences built (every slot from 0 to the last position) hold MAX_TOTAL_POSITIONS at most."""
    ends: dict[int, int] = {}
    for rec in recs.values():
        pos, seq = rec.row_positions(), rec.row_sequence_ids()
        if pos is None or seq is None or not pos.size:
            continue  # _pass_rows names what is missing
        if int(pos.min()) < 0 or int(seq.min()) < 0:
            raise CorruptDumpError(f"{_where(reader, rec)}: negative position or sequence id in a logprob row")
        ids, inverse = np.unique(seq, return_inverse=True)
        last = np.full(ids.size, -1, dtype=np.int64)
        np.maximum.at(last, inverse, pos)
        for s, hi in zip(ids.tolist(), last.tolist(), strict=True):
            limit = len(inputs[s]) if s < len(inputs) else MAX_POSITIONS
            if hi >= limit:
                why = (
                    f"its {limit} tokens (extra.input_ids, and generated_ids or next_ids)"
                    if s < len(inputs)
                    else f"{MAX_POSITIONS}"
                )
                raise CorruptDumpError(f"{_where(reader, rec)}: sequence {s}: logprob position {hi} is beyond {why}")
            ends[s] = max(ends.get(s, 0), hi + 1)
    total = sum(ends.values())
    if total > MAX_TOTAL_POSITIONS:
        raise UsageError(
            f"{reader.directory}: the logprob rows of {len(ends)} sequences span {total} positions "
            f"(from 0), over the limit of {MAX_TOTAL_POSITIONS} one source may hold"
        )


def _sequence(reader: DumpReader, seq: int, rows: Mapping[int, Row], known: list[int]) -> SequenceLogprobs:
    """Sequence ``seq`` from its dumped positions: contiguous, ending at the prompt's last token
    when the run recorded the prompt (a gap would be a position silently left uncompared)."""
    lo, hi = min(rows), max(rows)
    end = len(known) - 1 if known else hi
    if len(rows) != hi - lo + 1 or hi != end:
        raise CorruptDumpError(
            f"{reader.directory}: sequence {seq}: logprob rows cover {len(rows)} positions in "
            f"{lo}..{hi}, expected every position from {lo} to {end}"
        )
    n = hi + 1
    token_ids = [known[p] if p < len(known) else UNKNOWN_TOKEN for p in range(n)]
    logprobs: list[float | None] = [None] * n
    top: list[TopK | None] = [None] * n
    for p, (tid, lp, tk) in rows.items():
        if token_ids[p] not in (UNKNOWN_TOKEN, tid):
            raise NotComparableError(
                f"{reader.directory}: sequence {seq} position {p}: logprob rows score "
                f"token {tid} but the run's input has {token_ids[p]}"
            )
        token_ids[p], logprobs[p], top[p] = tid, lp, tk
    has_top = any(t is not None for t in top)
    return SequenceLogprobs(str(seq), token_ids, logprobs, top if has_top else None)


def dump_logprobs(reader: DumpReader) -> LogprobSource | None:
    """The logprobs a dump recorded (``python -m dumper run --logprobs``), or None if it has none.

    Records that disagree with each other (row counts, dtypes, token ids out of range, gaps in a
    sequence's positions) raise CorruptDumpError naming the file and tensor.
    """
    recs = _rows(reader, LOGPROB_NAMES)
    if not recs.get(LOGPROB_VALUE):
        return None
    inputs = scored_tokens(reader.manifest.extra)  # the prompts, and what a decode generated after them
    _check_extent(reader, recs[LOGPROB_VALUE], inputs)
    per_seq: dict[int, dict[int, Row]] = defaultdict(dict)
    for key in recs[LOGPROB_VALUE]:
        positions, seq_ids, rows = _pass_rows(reader, recs, key)
        for pos, seq, row in zip(positions.tolist(), seq_ids.tolist(), rows, strict=True):
            if pos in per_seq[seq]:
                raise NotComparableError(f"{reader.directory}: sequence {seq} has two logprobs for position {pos}")
            per_seq[seq][pos] = row
    sequences = [
        _sequence(reader, seq, rows, list(inputs[seq]) if seq < len(inputs) else [])
        for seq, rows in sorted(per_seq.items())
    ]
    logit_recs = recs.get(LOGITS, {})
    for key, rec in logit_recs.items():
        _check_logits(reader, rec, recs[LOGPROB_VALUE].get(key))
    return LogprobSource(
        str(reader.directory),
        reader.manifest.model.get("name"),
        tuple(sequences),
        _dump_logits(reader, logit_recs),
        _vocab_size(reader, logit_recs),
        reader.manifest,
        dtype=reader.manifest.capture_signature.get("dtype"),
    )


def _check_logits(reader: DumpReader, rec: TensorRecord, lp: TensorRecord | None) -> None:
    """A logits record is float ``[rows, V > 0]`` with the positions and sequence ids of the
    logprob rows of its pass (the dumper records both from the same rows)."""
    where = _where(reader, rec)
    if rec.dtype not in FLOAT_CODES:
        raise CorruptDumpError(f"{where}: dtype {rec.dtype} is not a float type")
    if len(rec.shape) != 2 or rec.shape[1] < 1:
        raise CorruptDumpError(f"{where}: shape {list(rec.shape)} is not [rows, vocab] with vocab >= 1")
    if rec.positions is None or rec.sequence_ids is None:
        raise CorruptDumpError(f"{where}: logits rows lack positions or sequence ids")
    if lp is None:
        raise CorruptDumpError(f"{where}: logits rows without logprob rows in the same pass")
    if not (
        np.array_equal(rec.row_positions(), lp.row_positions())
        and np.array_equal(rec.row_sequence_ids(), lp.row_sequence_ids())
    ):
        raise CorruptDumpError(f"{where}: positions or sequence ids differ from those of {lp.name}")


def _vocab_size(reader: DumpReader, logit_recs: Mapping[tuple[int, int, int], TensorRecord]) -> int | None:
    """The model's vocabulary size, from its identity (``vocab_size``) or else the logits rows' width."""
    widths = {rec.shape[-1] for rec in logit_recs.values()}
    if len(widths) > 1:
        raise CorruptDumpError(f"{reader.directory}: logits rows of different widths {sorted(widths)}")
    v = reader.manifest.model.get("vocab_size")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return widths.pop() if widths else None


def _dump_logits(
    reader: DumpReader,
    recs: Mapping[tuple[int, int, int], TensorRecord],
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
            pieces[int(s)].append((pos[sel], rows[sel[0] : sel[-1] + 1] if contiguous else rows[sel]))
    out = {}
    for s, ps in pieces.items():
        ps.sort(key=lambda p: int(p[0][0]))
        out[str(s)] = (
            ps[0] if len(ps) == 1 else (np.concatenate([p for p, _ in ps]), np.concatenate([r for _, r in ps]))
        )
    return out
