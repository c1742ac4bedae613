"""The hidden-state result types: frozen dataclasses whose JSON keys are a public contract.

One JSON codec: every ``to_json`` has a ``from_json`` that reads it back equal (round trips in
``tests/comparator/test_results.py``); non-finite floats are ``null`` (:mod:`dumper.format.jsonfloat`);
``passed`` is always explicit. A leaf: the comparison modules build these, :mod:`comparator.results`
re-exports them, :mod:`comparator.reports.files` writes them (the types carry no renderer).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from comparator.hidden.onset import Amplification
from comparator.hidden.registry import BuiltinMetrics
from comparator.hidden.registry import lookup as lookup_metric
from dumper.format.jsonfloat import from_json_float, to_json_float

if TYPE_CHECKING:  # loaded by a report that holds them (Report.from_json), not by every comparison
    from comparator.logprobs.types import LogprobVerdict
    from comparator.routing.types import RouterComparison

__all__ = [
    "TensorComparison",
    "FirstDivergence",
    "DecodeFork",
    "DecodeComparison",
    "ReplicaMismatch",
    "LayerSummary",
    "Heatmap",
    "Report",
]


@dataclass(frozen=True)
class DecodeFork:
    """Where two decode runs first generated different tokens for a sequence (:mod:`comparator.hidden.decode`).

    ``gap``: the baseline's logprob of its token minus that of the target's token at that step
    (with ``gap_is_bound``, the target's token is outside the baseline's top-k and ``gap`` is the
    top-k spread, a lower bound); ``noise``: the logprob noise it is judged against; ``near_tie``:
    the gap is within ``factor`` times that noise (None: no top-k or no logprobs to judge by).
    """

    sequence: int
    step: int
    position: int
    baseline_token: int
    target_token: int
    gap: float | None = None
    gap_is_bound: bool = False
    noise: float | None = None
    near_tie: bool | None = None
    factor: float | None = None
    """The multiple of ``noise`` within which ``gap`` is a near-tie (:data:`comparator.hidden.decode.NEAR_TIE`)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gap"], d["noise"] = to_json_float(self.gap), to_json_float(self.noise)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeFork:
        return cls(**{**d, "gap": from_json_float(d["gap"]), "noise": from_json_float(d["noise"])})


@dataclass(frozen=True)
class DecodeComparison:
    """What a comparison of a decode dump compared: decode steps (fed tokens) over its sequences, forks
    between two decode runs (nothing after one is compared; one the logprob noise does not explain
    fails the report), and coverage failures (a claimed step without rows), which fail it too."""

    sequences: int
    steps: int
    forks: tuple[DecodeFork, ...] = ()
    missing: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No claimed step lacks rows, and no fork is a real divergence (one not judged does not fail)."""
        return not self.missing and not any(f.near_tie is False for f in self.forks)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "sequences": self.sequences,
            "steps": self.steps,
            "forks": [f.to_json() for f in self.forks],
            "missing": list(self.missing),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeComparison:
        return cls(
            sequences=int(d["sequences"]),
            steps=int(d["steps"]),
            forks=tuple(DecodeFork.from_json(f) for f in d.get("forks", ())),
            missing=tuple(d.get("missing", ())),
        )


_OPTIONAL_FLOATS = ("threshold", "token_threshold", "decode_token_threshold", "noise_ratio", "token_noise_ratio")


@dataclass(frozen=True)
class TensorComparison(BuiltinMetrics):
    """Metrics of one aligned pair of tensors (float64 accumulation).

    ``first_failing_token`` / ``worst_token`` are absolute token positions (``None`` when the
    tensor carries no positions); ``*_row`` are the same as row indices. Aligned by rows, one
    comparison covers one ``sequence`` of one name, reassembled across passes and ranks;
    ``failing_ranges`` lists failing positions as inclusive ranges and ``note`` says where the
    first one sits in a chunked layout.

    ``metrics`` holds the metrics by name (:mod:`comparator.hidden.registry`, in its order): in
    JSON and CSV each is a key of its own where ``metrics`` sits; the built-in ones are also
    attributes (``t.rel_diff``).
    """

    name: str
    layer: int | None
    forward_pass: int
    rank: int
    shape: tuple[int, ...]
    metrics: Mapping[str, float]
    nan_baseline: int
    inf_baseline: int
    nan_target: int
    inf_target: int
    nonfinite_mismatches: int
    failing_tokens: int
    first_failing_token: int | None
    first_failing_row: int | None
    first_failing_sequence: int | None
    worst_token: int | None
    worst_row: int | None
    passed: bool
    sequence: int | None = None
    failing_ranges: list[list[int]] = field(default_factory=list)
    note: str | None = None
    threshold: float | None = None
    """The whole-tensor threshold this tensor was judged by (from its noise when calibrated)."""
    token_threshold: float | None = None
    noise_ratio: float | None = None
    """rel_diff as a multiple of its calibrated noise, ``max(noise, floor)`` (None: no noise file)."""
    token_noise_ratio: float | None = None
    """Largest per-token rel_diff as a multiple of its row's calibrated noise (row noise), else its phase's."""
    decode_token_threshold: float | None = None
    """The per-token threshold of the decode rows, where the noise measured them apart (``token_threshold``
    then judges the prompt rows); None: one per-token threshold for every row."""
    replica_side: str | None = None
    """``"baseline"`` or ``"target"``: these are the rows rank ``rank`` of that side holds as a
    tensor-parallel replica, where they differ from its representative (the lowest rank), judged
    against the other side; None: the ordinary comparison (``rank``: the target's rank)."""
    point: str | None = None
    """The capture point (:mod:`dumper.format.points`: ``input``, ``attn_output``, ``mlp_output``...)."""
    own_noise_rows: int | None = None
    """Rows judged against their own calibrated noise (the rest by the pooled noise); None: no row noise."""

    def __post_init__(self) -> None:
        clash = sorted(self.metrics.keys() & {f.name for f in fields(self)})
        if clash:  # they would overwrite each other in JSON and CSV
            raise ValueError(f"metric names {clash} are fields of TensorComparison; register them under other names")

    def __bool__(self) -> bool:
        return self.passed

    def to_row(self) -> dict[str, Any]:
        """The fields as one flat table row (the CSV's), each metric a column where ``metrics`` sits."""
        row: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "metrics":
                row.update(self.metrics)
            else:
                row[f.name] = copy.deepcopy(getattr(self, f.name))
        return row

    def to_json(self) -> dict[str, Any]:
        d = self.to_row()
        d["shape"] = list(self.shape)
        for k in (*self.metrics, *_OPTIONAL_FLOATS):
            d[k] = to_json_float(d[k])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], *, calibrated: bool = True) -> TensorComparison:
        """``calibrated``: the report was judged against a noise file (else no ratio exists).

        Every key that is not a field is a metric; a ``null`` one reads back as the registry says
        (inf for a difference, NaN for a similarity such as cosine).
        """
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names} | {
            "metrics": {k: lookup_metric(k).null if v is None else float(v) for k, v in d.items() if k not in names}
        }
        d["shape"] = tuple(d["shape"])
        for k in ("threshold", "token_threshold", "decode_token_threshold"):  # finite when set (absent: older ones)
            d[k] = None if d.get(k) is None else float(d[k])
        # a ratio is null without noise, and null for an infinite one: infinite only when its value is
        for k, of in (("noise_ratio", "rel_diff"), ("token_noise_ratio", "max_token_rel_diff")):
            d[k] = (
                float(d[k])
                if d.get(k) is not None
                else (math.inf if calibrated and k in d and math.isinf(d["metrics"][of]) else None)
            )
        return cls(**d)


@dataclass(frozen=True)
class FirstDivergence:
    """The lowest layer with a failing tensor, its first failing token and its worst token.

    ``onset`` is where the divergence starts within that tensor (``token`` is where it first
    crosses the threshold), ``onset_layer`` the first layer whose value departs from its noise;
    ``*_method`` says how each was found: ``calibrated`` (noise file), ``change-point`` (estimated
    from the run, see :mod:`comparator.hidden.onset`) or ``threshold`` (no earlier onset stood out).
    Layers are searched over every rank: ``replica_side`` names the side when the first divergence
    is in the replica rows of ``rank``, not of its representative (see ``TensorComparison``).
    """

    name: str
    layer: int | None
    rel_diff: float
    token: int | None
    worst_token: int | None
    sequence: int | None
    forward_pass: int
    rank: int
    failing_sequences: list[int] = field(default_factory=list)
    failing_ranges: list[list[int]] = field(default_factory=list)
    note: str | None = None
    onset: int | None = None
    onset_method: str | None = None
    onset_layer: int | None = None
    onset_layer_method: str | None = None
    replica_side: str | None = None
    phase: str | None = None
    """``prefill`` or ``decode``: the phase of the first failing row (decode: at or past its prompt's
    length, :mod:`comparator.hidden.decode`); None when neither side holds decode steps."""
    decode_step: int | None = None
    """The decode step that wrote it (:mod:`dumper.format.decode`), when ``phase`` is ``decode``."""
    point: str | None = None  # of ``name`` (:mod:`dumper.format.points`): the layer's first failing one in order
    agreeing: list[str] = field(default_factory=list)  # the layer's points before it where every tensor passes
    finding: str | None = None
    """Where the KV cache puts the fault, by data flow: ``cache`` (the layer's input agrees, its cache row differs:
    the cache write or read is wrong), ``upstream`` (the layer's input already differs, the cache follows it),
    ``unknown`` (a cache point fails and the layer's input was not captured); None: no cache point captured."""
    verify_step: int | None = None
    """In a decode row of a speculative dump: the index of the verify step that kept it in its sequence's
    ``extra.speculative.steps`` (the target's when it is speculative, else the baseline's;
    :mod:`comparator.hidden.speculative`)."""
    draft_index: int | None = None
    """... and its draft index in that step (0: the step's last accepted token, 1..k: the drafts it kept)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rel_diff"] = to_json_float(self.rel_diff)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FirstDivergence:
        return cls(**{**d, "rel_diff": from_json_float(d["rel_diff"])})


@dataclass(frozen=True)
class ReplicaMismatch:
    """Rows that two ranks of one side should hold identically (replicated under TP) but do not."""

    side: str
    name: str
    layer: int | None
    sequence: int
    rank: int
    reference_rank: int
    first_token: int
    max_token_rel_diff: float

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "max_token_rel_diff": to_json_float(self.max_token_rel_diff)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReplicaMismatch:
        return cls(**{**d, "max_token_rel_diff": from_json_float(d["max_token_rel_diff"])})


@dataclass(frozen=True)
class LayerSummary:
    """All tensors of one layer (or of no layer) folded into one table row."""

    layer: int | None
    tensors: int
    failed: int
    max_rel_diff: float
    max_token_rel_diff: float
    max_abs_diff: float | None
    """None where not available (a sketch comparison)."""
    min_cosine: float | None
    first_failing_token: int | None
    worst_token: int | None
    noise_ratio: float | None = None
    """Largest rel_diff of the layer as a multiple of its noise (None: no noise file)."""
    amplification: float | None = None
    """rel_diff(input of the next layer) / rel_diff(input of this one), at the layer's first capture point."""
    introduced: bool = False
    """Its amplification stands far above the others: this layer introduces error."""

    @property
    def passed(self) -> bool:
        return self.failed == 0


@dataclass(frozen=True)
class Heatmap:
    """Per-token rel_diff of one sequence, tensors x token positions, around the first divergence.

    ``values[i][j]`` is the rel_diff of tensor ``names[i]`` (layer ``layers[i]``) at position
    ``positions[j]``; inf where a NaN/Inf mismatch makes it infinite (``null`` in JSON, read
    back as inf). Rows are the tensors of that sequence that hold every one of the positions,
    in layer order, so a bug that starts at a token and spreads through the layers shows as a
    vertical edge.
    """

    sequence: int
    positions: tuple[int, ...]
    layers: tuple[int | None, ...]
    names: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "sequence": self.sequence,
            "positions": list(self.positions),
            "layers": list(self.layers),
            "names": list(self.names),
            "values": [[to_json_float(v) for v in row] for row in self.values],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Heatmap:
        return cls(
            sequence=int(d["sequence"]),
            positions=tuple(int(p) for p in d["positions"]),
            layers=tuple(None if v is None else int(v) for v in d["layers"]),
            names=tuple(d["names"]),
            values=tuple(tuple(from_json_float(v) for v in row) for row in d["values"]),
        )


@dataclass(frozen=True)
class Report:
    """The verdict of comparing two dumps; ``bool(report)`` is "passed".

    Its files are written by :mod:`comparator.reports.files` (``write_json``, ``write_csv``, ...)
    and a JSON one read back by :func:`comparator.results.load_report`.
    """

    baseline: str
    target: str
    threshold: float
    token_threshold: float
    tensors: tuple[TensorComparison, ...]
    unmatched_baseline: tuple[str, ...] = ()
    unmatched_target: tuple[str, ...] = ()
    first_divergent: FirstDivergence | None = None
    replica_mismatches: tuple[ReplicaMismatch, ...] = ()
    logprobs: LogprobVerdict | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    heatmap: Heatmap | None = None
    """Per-token rel_diff around the first divergence (None when nothing diverged)."""
    notes: tuple[str, ...] = ()
    """What the verdict must say besides the numbers: different weights, an allowed model mismatch."""
    empty_tensors: tuple[str, ...] = ()
    """Tensors with no elements (on either side): nothing to compare, so never counted as matched."""
    noise: str | None = None
    """The noise file the thresholds were derived from (None: fixed thresholds)."""
    noise_factor: float | None = None
    noise_floor: float | None = None
    amplification: tuple[Amplification, ...] = ()
    """Per layer and capture point, the growth of the error across the layer (:mod:`comparator.hidden.onset`)."""
    router: RouterComparison | None = None
    """The MoE routing comparison (:mod:`comparator.routing`); None when either dump recorded no routing."""
    sketch: dict[str, Any] | None = None
    """Set when either side is a sketch dump (:mod:`comparator.hidden.sketch`): the projection (kind, k, seed),
    which sides were sketched and the estimates' expected relative spread."""
    warnings: tuple[str, ...] = ()
    """What the verdict warns about: noise that lets pass what the fixed thresholds fail, a
    calibration across models (:func:`comparator.judging.noise_thresholds.noise_warnings`, the logprob noise's)."""
    decode: DecodeComparison | None = None
    """Set when either side holds decode steps (:mod:`comparator.hidden.decode`): steps compared, forks, coverage."""
    kv_cache: Any = None
    """Set when either side recorded the cache points (:class:`comparator.hidden.kv_cache.KvCacheVerdict`): each
    side's read-back check and, fp8 against auto, the per-layer table."""
    speculative: Any = None
    """Set when either side is a speculative decode
    (:class:`comparator.hidden.speculative_types.SpeculativeComparison`): each speculative side's acceptance,
    the per-draft-index table and, both sides speculative, the acceptance check."""

    @property
    def matched(self) -> int:
        """Tensors matched across the two dumps; a replica rank's comparison of one of them is not another."""
        return sum(t.replica_side is None for t in self.tensors)

    @property
    def passed(self) -> bool:
        """Something was compared, every tensor passed, replicas agree, and logprobs and routing (if any) pass."""
        return (
            (self.matched > 0 or self.logprobs is not None)
            and all(t.passed for t in self.tensors)
            and not self.replica_mismatches
            and (self.logprobs is None or self.logprobs.passed)
            and (self.router is None or self.router.passed)
            and (self.decode is None or self.decode.passed)
            and (self.kv_cache is None or self.kv_cache.passed)
            and (self.speculative is None or self.speculative.passed)
        )

    def __bool__(self) -> bool:
        return self.passed

    def unmatched_note(self) -> str | None:
        """``"3 tensors only in the baseline, 1 only in the target, 2 empty tensors: not compared"``, or None."""
        nb = len(self.unmatched_baseline)
        nt = len(self.unmatched_target)
        ne = len(self.empty_tensors)
        parts = [f"{nb} tensors only in the baseline, {nt} only in the target"] if nb or nt else []
        parts += [f"{ne} empty tensors"] if ne else []
        return f"{', '.join(parts)}: not compared" if parts else None

    def layers(self) -> list[LayerSummary]:
        """Per-layer summaries in layer order (tensors without a layer last)."""
        groups: dict[int | None, list[TensorComparison]] = {}
        for t in self.tensors:
            groups.setdefault(t.layer, []).append(t)
        amp: dict[int, Amplification] = {}
        for a in self.amplification:  # the layer's first capture point (in data-flow order)
            amp.setdefault(a.layer, a)
        out = []
        for layer in sorted(groups, key=lambda x: (x is None, x if x is not None else 0)):
            ts = groups[layer]
            failing = [t for t in ts if t.first_failing_token is not None]
            worst = max(ts, key=lambda t: t.max_token_rel_diff)
            out.append(
                LayerSummary(
                    layer=layer,
                    tensors=len(ts),
                    failed=sum(not t.passed for t in ts),
                    max_rel_diff=max(t.rel_diff for t in ts),
                    max_token_rel_diff=worst.max_token_rel_diff,
                    max_abs_diff=max(
                        (t.metrics["max_abs_diff"] for t in ts if "max_abs_diff" in t.metrics), default=None
                    ),
                    min_cosine=min((t.metrics["cosine"] for t in ts if "cosine" in t.metrics), default=None),
                    first_failing_token=min((t.first_failing_token for t in failing), default=None),
                    worst_token=worst.worst_token if worst.max_token_rel_diff > 0 else None,
                    noise_ratio=max((t.noise_ratio for t in ts if t.noise_ratio is not None), default=None),
                    amplification=amp[layer].ratio if layer in amp else None,
                    introduced=layer in amp and amp[layer].introduced,
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "threshold": self.threshold,
            "token_threshold": self.token_threshold,
            "matched": self.matched,
            "unmatched_baseline": list(self.unmatched_baseline),
            "unmatched_target": list(self.unmatched_target),
            "first_divergent": self.first_divergent.to_json() if self.first_divergent else None,
            "tensors": [t.to_json() for t in self.tensors],
            "replica_mismatches": [m.to_json() for m in self.replica_mismatches],
            "logprobs": self.logprobs.to_json() if self.logprobs is not None else None,
            "baseline": self.baseline,
            "target": self.target,
            "environment": self.environment,
            "heatmap": self.heatmap.to_json() if self.heatmap is not None else None,
            "notes": list(self.notes),
            "empty_tensors": list(self.empty_tensors),
            "noise": self.noise,
            "noise_factor": self.noise_factor,
            "noise_floor": self.noise_floor,
            "amplification": [a.to_json() for a in self.amplification],
            "warnings": list(self.warnings),
            "router": self.router.to_json() if self.router is not None else None,
            "sketch": self.sketch,
            "decode": self.decode.to_json() if self.decode is not None else None,
            "kv_cache": self.kv_cache.to_json() if self.kv_cache is not None else None,
            "speculative": self.speculative.to_json() if self.speculative is not None else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Report:
        from comparator.hidden.kv_cache import KvCacheVerdict
        from comparator.hidden.speculative_types import SpeculativeComparison
        from comparator.logprobs.types import LogprobVerdict
        from comparator.routing.types import RouterComparison

        fd = d.get("first_divergent")
        # judged against noise: a noise file, or an in-memory noise model (no file name, but its factor)
        calibrated = d.get("noise") is not None or d.get("noise_factor") is not None
        return cls(
            baseline=d["baseline"],
            target=d["target"],
            threshold=float(d["threshold"]),
            token_threshold=float(d["token_threshold"]),
            tensors=tuple(TensorComparison.from_json(t, calibrated=calibrated) for t in d["tensors"]),
            unmatched_baseline=tuple(d["unmatched_baseline"]),
            unmatched_target=tuple(d["unmatched_target"]),
            first_divergent=FirstDivergence.from_json(fd) if fd else None,
            replica_mismatches=tuple(ReplicaMismatch.from_json(m) for m in d.get("replica_mismatches", [])),
            logprobs=LogprobVerdict.from_json(d["logprobs"]) if d.get("logprobs") else None,
            environment=dict(d.get("environment", {})),
            heatmap=Heatmap.from_json(d["heatmap"]) if d.get("heatmap") else None,
            notes=tuple(d.get("notes", ())),
            empty_tensors=tuple(d.get("empty_tensors", ())),
            noise=d.get("noise"),
            noise_factor=d.get("noise_factor"),
            noise_floor=d.get("noise_floor"),
            amplification=tuple(Amplification.from_json(a) for a in d.get("amplification", ())),
            warnings=tuple(d.get("warnings", ())),
            router=RouterComparison.from_json(d["router"]) if d.get("router") else None,
            sketch=d.get("sketch"),
            decode=DecodeComparison.from_json(d["decode"]) if d.get("decode") else None,
            kv_cache=KvCacheVerdict.from_json(d["kv_cache"]) if d.get("kv_cache") else None,
            speculative=SpeculativeComparison.from_json(d["speculative"]) if d.get("speculative") else None,
        )
