"""``calibrate``: measure what benign variation looks like for one baseline.

Each variant is a benign re-run of the baseline's inputs (another attention backend, chunk size,
batch layout or thread count, or a plain re-run). Every variant is compared with the baseline
exactly as ``python -m comparator`` would; per captured tensor name the largest whole-tensor
rel_diff and the pooled per-token rel_diff (max, p99.9, p99) become its noise (and, where a comparison
had a decode part, the per-token rel_diff of prompt rows and decode rows apart: ``phases``), each row's
largest per-token rel_diff its row noise (:mod:`comparator.judging.row_noise`: the rows of the
baseline's prompts whose token ids the variant shares; none when the baseline records no token ids), and the logprob
verdicts become the logprob noise (:mod:`comparator.noise.logprob_calibration`); where both dumps
recorded MoE routing, each layer's largest router-score change, flip rate and combine-weight
change become its routing noise (:class:`~comparator.judging.router_noise.RouterNoise`). The sources are those of
``python -m comparator logprobs``: dumps (hidden states and, when recorded, logprobs), engine
JSONL files and llama.cpp KL-divergence base files (logprobs only).

Example::

    from comparator.noise.calibrate import calibrate
    from comparator.noise.file import save_noise
    noise = calibrate("dumps/base", ["dumps/sdpa", "dumps/chunk64"])
    save_noise(noise, "NOISE.json")
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from comparator.config import CompareConfig
from comparator.hidden.compare import compare_dumps
from comparator.hidden.onset import point_of
from comparator.hidden.types import TensorComparison
from comparator.judging.identity import IDENTITY_FIELDS, IdentityDifference, check_variant
from comparator.judging.noise import NoiseModel, PhaseNoise, TensorNoise, layout
from comparator.judging.router_noise import RouterNoise
from comparator.judging.row_noise import RowKeys, RowNoiseSet, covered, covered_prefix, holdout, packed
from comparator.logprobs.judge import compare_logprob_sources
from comparator.logprobs.types import LogprobVerdict
from comparator.noise.logprob_calibration import logprob_noise
from comparator.routing.types import RouterComparison
from dumper.errors import NotComparableError, UsageError
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.decode import DECODE, PREFILL
from dumper.format.sketch import SketchSpec

__all__ = ["calibrate"]

ProgressFn = Callable[[int, int], None]


class _Pool:
    """Per tensor name: per-token values of every variant (and of each phase's rows where a comparison had a
    decode part), largest rel_diff, largest per variant."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[np.ndarray]] = {}
        self.decode: dict[str, list[np.ndarray]] = {}  # name -> one bool mask per part of tokens[name]
        self.rel: dict[str, float] = {}
        self.meta: dict[str, tuple[int | None, str | None]] = {}
        self.by_variant: dict[str, dict[int, float]] = {}
        self.variant = 0
        self.rows: dict[str, list[tuple[np.ndarray, np.ndarray, int]]] = {}  # name -> (keys, values, variant) parts
        self.cover: list[int] = []  # per sequence: the positions the current variant shares with the baseline

    def add_rows(self, t: TensorComparison, token: np.ndarray, keys: RowKeys | None) -> None:
        """Keep the rows of ``t`` that the current variant's token ids cover (replica ranks' rows are no other row)."""
        if keys is None or t.replica_side is not None:
            return
        seq, pos = keys
        ok = covered(keys, self.cover)
        if ok.any():
            self.rows.setdefault(t.name, []).append(
                (packed(seq[ok], pos[ok]), token[ok].astype(np.float32), self.variant)
            )

    def row_noise(self, prompts: list[list[int]]) -> RowNoiseSet | None:
        if not self.rows:
            return None
        rows = {
            n: (np.concatenate([k for k, _, _ in parts]), np.concatenate([v for _, v, _ in parts]))
            for n, parts in self.rows.items()
        }
        return RowNoiseSet.build(prompts, rows, holdout(self.rows))

    def add(self, t: TensorComparison, token: np.ndarray, decode_rows: np.ndarray | None, point: str | None) -> None:
        if t.nonfinite_mismatches or not math.isfinite(t.rel_diff):
            raise NotComparableError(
                f"variant {self.variant + 1}: {t.name} has NaN/Inf where the baseline does "
                "not; that is not benign noise, so it cannot calibrate"
            )
        self.tokens.setdefault(t.name, []).append(token.astype(np.float32))
        self.decode.setdefault(t.name, []).append(
            np.zeros(token.shape, dtype=bool) if decode_rows is None else decode_rows
        )
        self.rel[t.name] = max(self.rel.get(t.name, 0.0), t.rel_diff)
        self.meta[t.name] = (t.layer, point)
        per = self.by_variant.setdefault(t.name, {})
        per[self.variant] = max(per.get(self.variant, 0.0), t.max_token_rel_diff)

    def tensors(self, variants: int) -> dict[str, TensorNoise]:
        out = {}
        for name, parts in self.tokens.items():
            v = np.concatenate(parts).astype(np.float64)
            decode = np.concatenate(self.decode[name])
            whole = _spread(v)
            phases = {PREFILL: _spread(v[~decode]), DECODE: _spread(v[decode])} if decode.any() else {}
            out[name] = TensorNoise(
                name=name,
                layer=self.meta[name][0],
                point=self.meta[name][1],
                rel_diff=self.rel[name],
                **asdict(whole),
                by_variant=tuple(self.by_variant[name].get(i, 0.0) for i in range(variants)),
                phases=phases,
            )
        return dict(sorted(out.items(), key=lambda kv: (kv[1].layer is None, kv[1].layer or 0, kv[0])))


def _spread(v: np.ndarray) -> PhaseNoise:
    """The per-token distribution of ``v`` (max, p99.9, p99; zeros for no values)."""
    q999, q99 = np.quantile(v, [0.999, 0.99]) if v.size else (0.0, 0.0)
    return PhaseNoise(
        token_max=float(v.max()) if v.size else 0.0, token_p999=float(q999), token_p99=float(q99), positions=int(v.size)
    )


def _router_noise(found: list[RouterComparison]) -> dict[int, RouterNoise]:
    """Per MoE layer, the largest score change, flip rate and weight change over the variants' routing comparisons."""
    out: dict[int, RouterNoise] = {}
    for comparison in found:
        for la in comparison.layers:
            if la.nonfinite:
                raise NotComparableError(
                    f"{la.name}: router values are NaN/Inf where the baseline's are not; "
                    "that is not benign noise, so it cannot calibrate"
                )
            old = out.get(la.layer)
            out[la.layer] = RouterNoise(
                layer=la.layer,
                score=max(la.score_delta_max, old.score if old else 0.0),
                flip_rate=max(la.flip_rate, old.flip_rate if old else 0.0),
                weight=max(la.weight_max_err, old.weight if old else 0.0),
                tokens=la.tokens + (old.tokens if old else 0),
            )
    return dict(sorted(out.items()))


def _is_dump(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST_NAME).is_file()


def calibrate(
    baseline: str | os.PathLike[str],
    variants: Sequence[str | os.PathLike[str]],
    *,
    threads: int = 2,
    allow_model_mismatch: bool = False,
    progress: ProgressFn | None = None,
) -> NoiseModel:
    """The noise of ``baseline`` measured against each benign ``variant``.

    Dumps contribute hidden-state noise (every tensor both sides hold) and, when both recorded
    logprobs, logprob noise; other sources logprob noise only. A variant that does not match
    the baseline (no common tensor, other positions) raises the comparison's error; one with a
    NaN/Inf mismatch is refused, since it is not benign, and so is a dump of another model or
    other weights (:func:`~comparator.judging.identity.check_variant`) unless ``allow_model_mismatch``,
    which records the differences in the noise (``model_mismatch``).
    """
    if not variants:
        raise UsageError("calibrate needs at least one benign variant of the baseline")
    for path in (baseline, *variants):
        if not os.path.exists(path):
            raise UsageError(f"{path}: no such dump or logprob file")
    config = CompareConfig(threads=threads, allow_model_mismatch=allow_model_mismatch)
    pool = _Pool()
    verdicts: list[LogprobVerdict] = []
    routing: list[RouterComparison] = []
    sketch: SketchSpec | None = None  # the projection of the sketched comparisons, if any
    manifest = load_manifest(baseline) if _is_dump(baseline) else None
    mismatch: list[tuple[str, IdentityDifference]] = []
    prompts = [list(p) for p in manifest.extra.get("input_ids") or []] if manifest is not None else []
    layouts = [layout(manifest)] if manifest is not None else []
    for i, variant in enumerate(variants):
        pool.variant = i
        if manifest is not None and _is_dump(variant):
            other = load_manifest(variant)
            mismatch += [
                (str(variant), d)
                for d in check_variant(manifest, other, allow_mismatch=allow_model_mismatch, where=f"variant {variant}")
            ]
            pool.cover = covered_prefix(prompts, other.extra.get("input_ids") or [])
            layouts.append(layout(other))
            report = compare_dumps(
                baseline,
                variant,
                config,
                token_sink=lambda t, tok, dec: pool.add(t, tok, dec, point_of(t.name)),
                row_sink=pool.add_rows,
            )
            if report.logprobs is not None:
                verdicts.append(report.logprobs)
            if report.router is not None:
                routing.append(report.router)
            if report.sketch is not None:
                sketch = SketchSpec.from_json(report.sketch)
        else:
            verdicts.append(compare_logprob_sources(baseline, variant, allow_model_mismatch=allow_model_mismatch))
        if progress is not None:
            progress(i + 1, len(variants))
    model, dtype = {}, None
    if manifest is not None:
        model = {k: manifest.model[k] for k in (*IDENTITY_FIELDS, "weights_hash", "name") if k in manifest.model}
        dtype = manifest.capture_signature.get("dtype")
    if len(verdicts) not in (0, len(variants)):
        raise UsageError(
            f"{baseline}: only {len(verdicts)} of {len(variants)} variants recorded logprobs; "
            "calibrate logprobs from variants that all record them"
        )
    return NoiseModel(
        baseline=str(baseline),
        variants=tuple(str(v) for v in variants),
        tensors=pool.tensors(len(variants)),
        logprobs=logprob_noise(verdicts) if verdicts else None,
        model=model,
        dtype=dtype,
        model_mismatch=tuple(mismatch),
        router=_router_noise(routing),
        sketch=sketch,
        rows=pool.row_noise(prompts),
        layouts=tuple(layouts) if len(layouts) == len(variants) + 1 else (),
    )
