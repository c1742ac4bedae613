"""What a comparison says about how it was judged: the verdict's notes on noise, dtype and replay dumps.

Each helper returns the notes of one concern, for :func:`comparator.hidden.compare.compare_dumps`
to put in the report: tensors without noise and the rows each noise rule judged, the dtype-blind
fixed thresholds of a bfloat16 or float16 comparison judged without noise, and what a replay
dump's layers mean. :func:`with_row_cover` sets the rows a noise file's row noise covers.
"""

from __future__ import annotations

import math
from dataclasses import replace

from comparator.config import CompareConfig
from comparator.hidden.types import TensorComparison
from comparator.judging.noise import layout, layout_change
from comparator.judging.row_noise import covered_prefix
from dumper.format import Manifest

__all__ = ["DTYPE_NOTE", "with_row_cover", "noise_notes", "dtype_note", "replay_notes"]


def with_row_cover(config: CompareConfig, bm: Manifest, tm: Manifest) -> CompareConfig:
    """``config`` with the rows its row noise covers here: per sequence, the leading positions whose token ids the
    calibration, the baseline and the target share (:mod:`comparator.judging.row_noise`)."""
    if config.noise is None or config.noise.rows is None:
        return config
    ids = [m.extra.get("input_ids") or [] for m in (bm, tm)]
    return replace(config, row_cover=tuple(covered_prefix(config.noise.rows.prompts, *ids)))


def _rows(t: TensorComparison) -> int:
    """How many rows (per-token values) one comparison judged."""
    return math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1


def noise_notes(
    config: CompareConfig, results: list[TensorComparison], target: Manifest | None = None
) -> tuple[str, ...]:
    """Say which tensors a noise file did not cover (they were judged by the fixed thresholds), how many rows
    each rule judged where it has row noise, and when rows fail by it on a ``target`` whose layout the calibration
    did not run."""
    if config.noise is None:
        return ()
    results = [t for t in results if t.replica_side is None]  # a replica rank's comparison is not another tensor
    missing = [t.name for t in results if t.noise_ratio is None]
    out = []
    if missing:
        out.append(
            f"{len(missing)} of {len(results)} tensors have no calibrated noise (e.g. {missing[0]}): "
            f"fixed thresholds rel_diff <= {config.threshold:g}, per-token <= {config.token_threshold:g}"
        )
    if config.noise.rows is not None:
        calibrated = [t for t in results if t.noise_ratio is not None]
        own = sum(t.own_noise_rows or 0 for t in calibrated)
        total = sum(_rows(t) for t in calibrated)
        out.append(
            f"row noise: {own} of {total} rows judged against their own calibrated noise "
            f"(x{config.noise_factor:g}, at least the tensor's median row), {total - own} against the "
            "tensor's pooled noise (rows the calibration did not cover: other token ids, decode rows, "
            "tensors without row noise)"
        )
        held = config.noise.rows.holdout
        if (
            held is not None
            and held.ratio > config.noise_factor
            and any(
                not t.passed and t.own_noise_rows and (t.token_noise_ratio or 0.0) <= held.ratio for t in calibrated
            )
        ):
            out.append(
                f"rows fail by less than the {held.ratio:.3g}x their noise that the calibration's own held-out "
                "variant reached: that may be a layout the calibration did not run, not a bug "
                '(docs/calibration.md, "Row noise")'
            )
        theirs = layout(target) if target is not None else None
        if (
            theirs is not None
            and not config.noise.covers_layout(theirs)
            and any(not t.passed and t.own_noise_rows for t in calibrated)
        ):
            change = layout_change(config.noise.layouts[0], theirs)
            out.append(
                f"the target's layout is none the calibration ran ({change} against the baseline): "
                "its own rounding can take rows past their calibrated noise (up to 6x "
                'on a trained model, docs/calibration.md, "Row noise"); if that layout is the change under '
                "test, not a suspect, calibrate with a run of it as a variant"
            )
    return tuple(out)


DTYPE_NOTE = (
    "fixed thresholds are dtype-blind: {dtype} rounding alone can exceed them on a trained model, and a "
    "real bug can hide under them; judge by measured noise: python -m dumper run ... --calibrate (the "
    "baseline keeps its noise), or python -m comparator calibrate BASELINE VARIANT... --out NOISE.json "
    "and --noise NOISE.json"
)
"""Said by a comparison of bfloat16 or float16 dumps judged without noise (docs/calibration.md)."""


def dtype_note(config: CompareConfig, bm: Manifest, tm: Manifest) -> tuple[str, ...]:
    """:data:`DTYPE_NOTE` when either side holds bfloat16 or float16 rows and no noise judges them."""
    if config.noise is not None:
        return ()
    low = sorted({r.dtype for m in (bm, tm) for r in m.tensors} & {"BF16", "F16"})
    return (
        (DTYPE_NOTE.format(dtype=" and ".join({"BF16": "bfloat16", "F16": "float16"}[d] for d in low)),) if low else ()
    )


def replay_notes(manifest: Manifest) -> tuple[str, ...]:
    """A replay dump (``python -m dumper replay``) holds each layer's own error one layer up: say so (and if forced)."""
    replay = manifest.extra.get("replay")
    if not isinstance(replay, dict):
        return ()
    forced = {"ids": "ids; weights by the target's router", "all": "ids and weights"}.get(replay.get("force_routing"))
    what = (
        "split replay dump: layer k's attention and MLP outputs are each that half run on the baseline's own "
        "input of it, so their rel_diff is the error that half introduces by itself, nothing inherited (the "
        "inputs, only in the baseline, are expected)"
        if replay.get("split")
        else "replay dump: the residual of layer k+1 is layer k run on the baseline's own input, so its "
        "rel_diff is the error layer k introduces by itself, nothing inherited (tensors only in the "
        "baseline, such as layer 0's residual and the input point, are expected)"
    )
    return (
        what,
        *(
            [
                f"replay with the baseline's expert choices forced ({forced}): no routing flips by construction; what "
                "an MoE layer still adds is the same experts' math, not a different expert"
            ]
            if forced
            else []
        ),
    )
