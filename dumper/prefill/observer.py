"""The observer check: does capturing a run change what the run computes?

``python -m dumper run ... --logprobs --observer-check`` writes the captured dump, then runs
the same job again with nothing of driftscope on the model (no capture hooks, no tap; a
compiled model is compiled again without the tap) and compares that run's logprobs, and its
logits rows with ``--save-logits``, bit for bit with the dump's. The reference run writes
nothing: :class:`ObserverCheck` is its recording sink, comparing each row with the dump's row
of the same (name, sequence, position) as it arrives, so memory stays one record's worth. The
result goes into the dump's manifest as ``extra["observer"]`` (:class:`ObserverResult`),
rewritten atomically; the captured dump is kept either way.

Example::

    from dumper.prefill.observer import ObserverCheck, mark_observer
    check = ObserverCheck("dumps/a", logits=False)   # a dump written with --logprobs
    ...                                              # the job again, recording into check
    manifest = mark_observer("dumps/a", check.result())
    print(ObserverResult.from_json(manifest.extra["observer"]).summary())
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dumper.errors import InternalError
from dumper.format import (
    LOGITS,
    LOGPROB_TOP_VALUE,
    LOGPROB_VALUE,
    DumpReader,
    Manifest,
    TensorRecord,
    load_manifest,
    to_float64,
    write_manifest,
)
from dumper.format.dtypes import torch_codes

__all__ = ["ObserverResult", "ObserverCheck", "LogprobSink", "mark_observer", "OBSERVER_KEY"]

OBSERVER_KEY = "observer"
"""The manifest ``extra`` key of the result (absent: never checked)."""

NON_FINITE_DIFF = sys.float_info.max
"""``max_abs_diff`` when the largest difference is a value that is non-finite in one run only (JSON has no inf)."""

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Item size -> the torch integer dtype a float tensor's bits are viewed as."""


class LogprobSink(Protocol):
    """Where a job's logprobs go: a :class:`~dumper.hooks.capture.Capture`, or an :class:`ObserverCheck`
    for the run without capture (:func:`dumper.prefill.logprob_records.record_logprobs` writes to either)."""

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None: ...

    def set_pass_meta(self, meta: dict[str, Any] | None) -> None: ...

    def record(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        point: str | None = None,
        positions: Any = None,
        sequence_ids: Any = None,
    ) -> None: ...


@dataclass(frozen=True)
class ObserverResult:
    """How the run without capture compared with the captured dump; ``bool()`` is "bit-exact".

    ``values``: floats compared; ``max_abs_diff``: the largest |difference| (0.0 when bit-exact,
    also when the only difference is the sign of a zero), at ``sequence``/``position``
    (``None`` when bit-exact). NaN equals NaN of the same bits.
    """

    bit_exact: bool
    compared: str
    values: int
    max_abs_diff: float = 0.0
    sequence: int | None = None
    position: int | None = None

    def __bool__(self) -> bool:
        return self.bit_exact

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": True,
            "bit_exact": self.bit_exact,
            "compared": self.compared,
            "values": self.values,
            "max_abs_diff": self.max_abs_diff,
            "sequence": self.sequence,
            "position": self.position,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ObserverResult:
        return cls(
            bit_exact=bool(d["bit_exact"]),
            compared=str(d["compared"]),
            values=int(d["values"]),
            max_abs_diff=float(d["max_abs_diff"]),
            sequence=d.get("sequence"),
            position=d.get("position"),
        )

    def summary(self) -> str:
        """One line for the CLI."""
        what = self.compared.replace("+", " and ")
        if self.bit_exact:
            return f"observer check: bit-exact ({self.values} values: {what})"
        size = "a non-finite value" if self.max_abs_diff == NON_FINITE_DIFF else f"{self.max_abs_diff:.3g}"
        return (
            f"observer check: capture changed the {what} (largest |Δ| {size} at sequence "
            f"{self.sequence}, position {self.position}, of {self.values} values)"
        )


class ObserverCheck:
    """The recording sink of the reference run: compares every row with the captured dump's, as it comes.

    ``out_dir`` is the captured dump; the compared records are the logprobs (and top-k logprobs)
    and, with ``logits``, the logits rows. A row the reference records that the dump lacks, or
    one of another dtype or width, is an :class:`InternalError`: the same job recorded
    different rows, a driftscope bug, not an observer effect.
    """

    def __init__(self, out_dir: str | Path, *, logits: bool) -> None:
        self._reader = DumpReader(out_dir)
        self._names = (LOGPROB_VALUE, LOGPROB_TOP_VALUE) + ((LOGITS,) if logits else ())
        self.compared = "logprobs+logits" if logits else "logprobs"
        self._rows: dict[tuple[str, int, int], tuple[TensorRecord, int]] = {}
        for rec in self._reader.manifest.tensors:
            if rec.name in self._names:
                seqs, pos = rec.row_sequence_ids(), rec.row_positions()
                if seqs is None or pos is None:
                    raise InternalError(f"{out_dir}: {rec.name} of pass {rec.forward_pass} has no row metadata")
                self._rows.update(((rec.name, int(s), int(p)), (rec, i)) for i, (s, p) in enumerate(zip(seqs, pos)))
        self._codes = torch_codes()
        self.values = 0
        self._worst: tuple[float, int, int] | None = None  # (|diff|, sequence, position) of the worst row

    def set_sequence_ids(self, ids: Sequence[int] | None) -> None:
        """Nothing to do: each row the reference records names its sequence."""

    def set_pass_meta(self, meta: dict[str, Any] | None) -> None:
        """Nothing to do: rows are matched by sequence and position, whatever pass wrote them."""

    def record(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        point: str | None = None,
        positions: Any = None,
        sequence_ids: Any = None,
    ) -> None:
        """Compare the rows of ``tensor`` ([rows, k]) with the captured dump's rows of ``name``."""
        if name not in self._names:
            return
        ref = tensor.detach().to("cpu").contiguous()
        ref = ref.reshape(ref.shape[0], -1)  # [rows, k]
        seqs = torch.as_tensor(sequence_ids).reshape(-1).tolist()
        pos = torch.as_tensor(positions).reshape(-1).tolist()
        got_rows = []
        for s, p in zip(seqs, pos, strict=True):
            hit = self._rows.pop((name, s, p), None)
            if hit is None:
                raise InternalError(
                    f"observer check: the run without capture recorded {name} at sequence {s}, "
                    f"position {p}, which the captured dump does not hold (or holds twice)"
                )
            rec, row = hit
            if rec.dtype != self._codes.get(ref.dtype) or rec.shape[-1] != ref.shape[1]:
                raise InternalError(
                    f"observer check: {name} is {rec.dtype} x {rec.shape[-1]} in the dump, "
                    f"{ref.dtype} x {ref.shape[1]} in the run without capture"
                )
            got_rows.append(self._reader.rows(rec)[row])
        if got_rows:
            self._compare(ref, np.stack(got_rows), rec.dtype, seqs, pos)

    def _compare(self, ref: torch.Tensor, got: np.ndarray, code: str, seqs: list[int], pos: list[int]) -> None:
        """Fold ``ref`` vs ``got`` (raw storage, same shape) into the running result."""
        size = got.dtype.itemsize
        same = ref.view(_BITS[size]).numpy().view(f"u{size}") == got.view(f"u{size}")  # [rows, k]
        self.values += int(same.size)
        if same.all():
            return
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(ref.double().numpy() - to_float64(got, code))
        diff = np.where(same, -1.0, np.where(np.isfinite(diff), diff, math.inf))  # -1: equal bits, never the worst
        row, col = np.unravel_index(int(np.argmax(diff)), diff.shape)
        worst = (float(diff[row, col]), seqs[row], pos[row])
        if self._worst is None or worst[0] > self._worst[0]:
            self._worst = worst

    def result(self) -> ObserverResult:
        """The verdict once the reference run has recorded everything (every dump row must have been met)."""
        if self._rows:
            name, s, p = next(iter(self._rows))
            raise InternalError(
                f"observer check: the run without capture recorded no {name} at sequence {s}, "
                f"position {p} ({len(self._rows)} rows of the dump unmatched)"
            )
        if self._worst is None:
            return ObserverResult(True, self.compared, self.values)
        diff, s, p = self._worst
        return ObserverResult(False, self.compared, self.values, NON_FINITE_DIFF if math.isinf(diff) else diff, s, p)


def mark_observer(out_dir: str | Path, result: ObserverResult) -> Manifest:
    """Rewrite the dump's manifest with ``extra["observer"]`` = ``result`` (atomically; the manifest only)."""
    manifest = load_manifest(out_dir)
    marked = replace(manifest, extra={**manifest.extra, OBSERVER_KEY: result.to_json()})
    write_manifest(out_dir, marked)
    return marked
