"""Compare the MoE routing of two dumps: flips, their margins against noise, combine-weight errors.

Per MoE layer both dumps routed, over the tokens both hold (matched by sequence and position):

- a **flip** is a token whose top-k expert *set* differs; the same set in another slot order is
  an order difference, counted apart and never a failure;
- a token that flipped at an earlier layer went through other experts there, so a flip of it
  here follows from that one: benign, marked ``after`` that layer (the first flip decides);
- each other flip's baseline **margin** (lowest chosen score minus highest unchosen score; the
  selection scores where recorded, else the router logits) is divided by the layer's unit and
  judged by :mod:`comparator.judging.router_noise` (calibrated noise, else the margin rule);
- on tokens whose sets agree, the combine weights are matched by expert id and their largest
  ``|Δw|`` is judged against the weight limit, so a renormalisation bug with equal ids fails;
- with calibrated noise, a layer whose flips (benign ones included) are more frequent than
  ``factor`` x the calibrated flip rate fails too: many near-ties flipping at once is not noise;
- a NaN/Inf in either side's router values fails the layer (never a pass);
- under tensor parallelism every rank runs the replicated router: a rank whose rows differ from
  its side's lowest rank (which is what is compared) fails too, named (:class:`RankRouting`).

Example::

    from comparator.routing.compare import compare_routing
    from dumper.format import DumpReader
    result = compare_routing(DumpReader("dumps/a"), DumpReader("dumps/b"))
    result.first_flip      # Flip(layer=2, sequence=0, token=30, margin=0.9, noise_ratio=45.0, ...)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from comparator.judging.fields import EXCESSIVE
from comparator.judging.reldiff import rel_diff_of
from comparator.judging.router_noise import SCORE_FLOOR, WEIGHT_FLOOR, RouterNoise, margin_rule, weight_rule
from comparator.routing.types import CALIBRATED, MARGIN_RULE_BASIS, Flip, RankRouting, RouterComparison, RouterLayer
from dumper.errors import NotComparableError
from dumper.format import DumpReader
from dumper.format.dtypes import DTYPES
from dumper.format.routing import LayerRecords, LayerRows, key_parts, read_layer, router_records, row_key

__all__ = ["RUN_NOISE", "SHOWN_FLIPS", "compare_routing"]

RUN_NOISE = 4.0
"""Under the margin rule, a flip's margin may also be this many times the layer's median per-token score change."""
SHOWN_FLIPS = 20
"""How many flips a comparison lists (in layer, sequence, token order); the counts cover all."""


def _dtype_names(entry: LayerRecords, reader: DumpReader) -> tuple[str, ...]:
    """The router logits' dtype and the model's: a router that computes in float32 inside a bf16 model
    (DeepSeek-V3) still sees bf16 hidden states, so the less precise one decides the fixed rules."""
    model = reader.manifest.capture_signature.get("dtype")
    return (DTYPES[entry.dtype()].torch_name, *([model] if isinstance(model, str) else []))


def _margins(scores: np.ndarray, ids: np.ndarray, groups: tuple[int, int] | None = None) -> np.ndarray:
    """Per row: how far the choice is from changing, in score units (``inf``: nothing else could be chosen).

    A plain top-k: the lowest chosen score minus the highest unchosen one. A grouped top-k
    (DeepSeek-V3: the ``keep`` groups whose two best scores sum highest, then the top-k inside
    them): the smaller of that margin within the kept groups and the kept groups' lowest group
    score minus the dropped groups' highest. Negative: the choice is not the top-k of these scores.
    """
    chosen = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(chosen, ids, True, axis=1)
    eligible = np.ones(scores.shape, dtype=bool)
    group_margin = np.full(scores.shape[0], np.inf)
    if groups is not None:
        n, keep = groups
        by_group = scores.reshape(scores.shape[0], n, scores.shape[1] // n)
        group_score = np.sort(by_group, axis=2)[:, :, -2:].sum(axis=2)
        order = np.argsort(-group_score, axis=1, kind="stable")
        kept = np.zeros(group_score.shape, dtype=bool)
        np.put_along_axis(kept, order[:, :keep], True, axis=1)
        if keep < n:
            group_margin = np.where(kept, group_score, np.inf).min(axis=1) - np.where(kept, -np.inf, group_score).max(
                axis=1
            )
        eligible = np.repeat(kept, scores.shape[1] // n, axis=1)
    low = np.where(chosen, scores, np.inf).min(axis=1)
    high = np.where(chosen | ~eligible, -np.inf, scores).max(axis=1)
    return np.minimum(low - high, group_margin)


def _same_set(b: np.ndarray, t: np.ndarray) -> np.ndarray:
    return (np.sort(b, axis=1) == np.sort(t, axis=1)).all(axis=1)


def _weight_errors(b: LayerRows, t: LayerRows, rb: np.ndarray, rt: np.ndarray) -> np.ndarray:
    """|Δw| per slot of the rows whose sets agree, the target's slots matched to the baseline's by expert id."""
    bi, ti = b.ids[rb], t.ids[rt]
    slot = np.argmax(ti[:, None, :] == bi[:, :, None], axis=2)  # baseline slot j -> target slot with that id
    tw = np.take_along_axis(t.weights[rt], slot, axis=1)
    return np.abs(b.weights[rb] - tw)


class _Judge:
    """How one layer's flips and weights are judged: calibrated noise, else the fixed rules."""

    def __init__(self, noise: RouterNoise | None, factor: float, dtypes: tuple[str, ...]) -> None:
        self.noise = noise
        self.rule = margin_rule(*dtypes)  # the margin rule's unit (calibrated noise is weighed against it)
        self.weight_rule = weight_rule(*dtypes)  # and the fixed weight limit
        if noise is not None:
            self.basis, self.limit_ratio = CALIBRATED, factor
            self.unit = max(noise.score, SCORE_FLOOR)
            self.weight_limit = factor * max(noise.weight, WEIGHT_FLOOR)
            self.flip_rate_limit: float | None = factor * max(noise.flip_rate, 1.0 / max(noise.tokens, 1))
        else:
            self.basis, self.limit_ratio = MARGIN_RULE_BASIS, 1.0
            self.unit = self.rule
            self.weight_limit = self.weight_rule
            self.flip_rate_limit = None

    def ratios(self, margins: np.ndarray, scores: np.ndarray, run_noise: float) -> np.ndarray:
        """Each flip's margin in units: of score noise, or under the margin rule of the larger of the rule x
        RMS(the token's scores) and :data:`RUN_NOISE` x ``run_noise``, the layer's median per-token max
        |Δ score| (this run's own typical score change: a bug at a few tokens leaves the median alone).

        A negative margin (the baseline's choice is not the top-k of the scores recorded: a biased or
        grouped selection whose scores were not recorded) cannot be judged small: ``inf``, a failure.
        """
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.noise is not None:
                ratio = margins / self.unit
            else:
                unit = np.maximum(self.unit * np.sqrt(np.mean(scores * scores, axis=1)), RUN_NOISE * run_noise)
                ratio = np.where(margins > 0, margins / unit, 0.0)
        return np.where(margins < 0, np.inf, ratio)


def _flips(
    layer: int,
    b: LayerRows,
    t: LayerRows,
    rb: np.ndarray,
    rt: np.ndarray,
    judge: _Judge,
    use_scores: bool,
    earlier: dict[int, int],
    run_noise: float,
) -> list[Flip]:
    """The flips of one layer; a token that already flipped at a layer before (``earlier``: key -> layer)
    was sent through other experts there, so its flip here follows from that one (benign, ``after`` it)."""
    keys = b.keys[rb]
    scores = (b.scores if use_scores else b.logits)[rb]  # type: ignore[index]
    margins = _margins(scores, b.ids[rb], b.groups if use_scores else None)
    ratios = judge.ratios(margins, scores, run_noise)
    return [
        Flip(
            layer=layer,
            sequence=key_parts(k)[0],
            token=key_parts(k)[1],
            baseline_ids=tuple(int(i) for i in bi),
            target_ids=tuple(int(i) for i in ti),
            margin=float(m),
            noise_ratio=float(r),
            benign=bool(r <= judge.limit_ratio) or int(k) in earlier,
            after=earlier.get(int(k)),
        )
        for k, bi, ti, m, r in zip(keys, b.ids[rb], t.ids[rt], margins, ratios, strict=True)
    ]


def _excessive(layer: int, judge: _Judge, b: LayerRows) -> list[str]:
    """The warnings for a layer whose calibrated noise excuses what the fixed rules fail by far: a margin of
    ``factor`` score units over :data:`EXCESSIVE` x the margin rule's unit at the layer's median token, a weight
    limit over :data:`EXCESSIVE` x the fixed one, or a flip rate limit that lets every token flip."""
    if judge.noise is None:
        return []
    scores = b.scores if b.scores is not None else b.logits
    rule = judge.rule * float(np.median(np.sqrt(np.mean(scores * scores, axis=1)))) if scores.size else 0.0
    out = []
    if judge.limit_ratio * judge.unit > EXCESSIVE * rule:
        out.append(
            f"layer {layer}: routing noise excuses flips with margins up to {judge.limit_ratio * judge.unit:.3g}, "
            f"over {EXCESSIVE:g}x the margin rule's {rule:.3g} at its median token: a real routing bug there "
            "would pass (recalibrate, or compare without --noise)"
        )
    if judge.weight_limit > EXCESSIVE * judge.weight_rule:
        out.append(
            f"layer {layer}: routing noise excuses combine-weight errors up to {judge.weight_limit:.3g}, "
            f"over {EXCESSIVE:g}x the fixed weight limit {judge.weight_rule:.3g}: a real weight bug there "
            "would pass"
        )
    if judge.flip_rate_limit is not None and judge.flip_rate_limit >= 1.0:
        out.append(
            f"layer {layer}: routing noise lets every token flip (flip rate limit "
            f"{judge.flip_rate_limit:.3g}): a real routing bug there would pass"
        )
    return out


def _noise_notes(flips: list[Flip], noise: Mapping[int, RouterNoise] | None, factor: float) -> list[str]:
    """Say when calibrated routing noise decided: flips it judged benign (not those following an earlier flip)."""
    excused = [f for f in flips if f.benign and f.after is None and f.layer in (noise or {})]
    if not excused:
        return []
    layers = ", ".join(map(str, sorted({f.layer for f in excused})))
    return [
        f"routing noise decided: {len(excused)} flips at layers {layers} passed as within {factor:g}x "
        "the calibrated score noise of their layer"
    ]


def _compare_layer(
    entry_b: LayerRecords, b: LayerRows, t: LayerRows, judge: _Judge, benign_rate: float | None, earlier: dict[int, int]
) -> tuple[RouterLayer, list[Flip]]:
    _, ib, it = np.intersect1d(b.keys, t.keys, assume_unique=True, return_indices=True)
    use_scores = b.scores is not None and t.scores is not None
    sb = (b.scores if use_scores else b.logits)[ib]  # type: ignore[index]
    st = (t.scores if use_scores else t.logits)[it]  # type: ignore[index]
    finite = (
        np.isfinite(sb).all(1)
        & np.isfinite(st).all(1)
        & np.isfinite(b.weights[ib]).all(1)
        & np.isfinite(t.weights[it]).all(1)
    )
    ib_f, it_f = ib[finite], it[finite]
    same = _same_set(b.ids[ib_f], t.ids[it_f])
    delta = np.abs(sb[finite] - st[finite]).max(axis=1) if finite.any() else np.zeros(0)
    flips = _flips(
        entry_b.layer,
        b,
        t,
        ib_f[~same],
        it_f[~same],
        judge,
        use_scores,
        earlier,
        float(np.median(delta)) if delta.size else 0.0,
    )
    dw = _weight_errors(b, t, ib_f[same], it_f[same])
    order = int(np.count_nonzero(same & (b.ids[ib_f] != t.ids[it_f]).any(axis=1)))
    failing = [f for f in flips if not f.benign]
    worst = max(flips, key=lambda f: f.noise_ratio, default=None)
    lb, lt = b.logits[ib_f], t.logits[it_f]  # float64 (dumper.format.routing), plain numpy sums
    return RouterLayer(
        layer=entry_b.layer,
        name=entry_b.prefix,
        tokens=int(ib.size),
        experts=int(b.logits.shape[1]),
        top_k=int(b.ids.shape[1]),
        flips=len(flips),
        failing_flips=len(failing),
        order_differences=order,
        score_delta_max=float(delta.max()) if delta.size else 0.0,
        logits_rel_diff=rel_diff_of(float(np.sum((lb - lt) ** 2)), float(np.sum(lb * lb) + np.sum(lt * lt))),
        weight_max_err=float(dw.max()) if dw.size else 0.0,
        weight_mean_err=float(dw.mean()) if dw.size else 0.0,
        weight_limit=judge.weight_limit,
        unit=judge.unit,
        limit_ratio=judge.limit_ratio,
        basis=judge.basis,
        benign_flip_rate=benign_rate,
        nonfinite=int(np.count_nonzero(~finite)),
        worst_flip=worst,
        flip_rate_limit=judge.flip_rate_limit,
    ), flips


def _ranks(side: str, entry: LayerRecords, rows: LayerRows) -> list[RankRouting]:
    """The ranks of one side whose replicated routing of ``entry``'s layer differs from the lowest rank's."""
    return [
        RankRouting(
            side=side,
            layer=entry.layer,
            name=entry.prefix,
            rank=d.rank,
            reference_rank=d.reference_rank,
            sequence=key_parts(d.key)[0],
            token=key_parts(d.key)[1],
            ids=d.ids,
            reference_ids=d.reference_ids,
            rows=d.rows,
            parts=d.parts,
            weight_max_diff=d.weight_max_diff,
        )
        for d in rows.rank_differences
    ]


def compare_routing(
    baseline: DumpReader, target: DumpReader, *, noise: Mapping[int, RouterNoise] | None = None, factor: float = 3.0
) -> RouterComparison | None:
    """The routing comparison of two dumps; None when either recorded no routing.

    ``noise``: calibrated routing noise by layer (a noise file's ``router``); a layer without an
    entry is judged by the fixed margin and weight rules, and the result says which basis each
    layer had. ``factor``: the noise factor (a flip is benign within ``factor`` noise units).
    """
    rb, rt = router_records(baseline), router_records(target)
    if not rb or not rt:
        return None
    layers = []
    flips = []
    excessive = []
    ranks = []
    earlier: dict[int, int] = {}  # row_key -> the first layer its experts flipped at
    for layer in sorted(rb.keys() & rt.keys()):
        if (rb[layer].experts, rb[layer].top_k) != (rt[layer].experts, rt[layer].top_k):
            raise NotComparableError(
                f"{target.directory}: layer {layer} routes over {rt[layer].experts} experts (top-{rt[layer].top_k}), "
                f"the baseline {baseline.directory} over {rb[layer].experts} (top-{rb[layer].top_k}); routing is "
                "compared between runs of the same experts"
            )
        n = (noise or {}).get(layer)
        judge = _Judge(n, factor, (*_dtype_names(rb[layer], baseline), *_dtype_names(rt[layer], target)))
        rows_b, rows_t = read_layer(baseline, rb[layer]), read_layer(target, rt[layer])
        excessive += _excessive(layer, judge, rows_b)
        ranks += _ranks("baseline", rb[layer], rows_b) + _ranks("target", rt[layer], rows_t)
        result, found = _compare_layer(
            rb[layer], rows_b, rows_t, judge, n.flip_rate if n is not None else None, earlier
        )
        layers.append(result)
        flips += found
        for f in found:
            earlier.setdefault(int(row_key(f.sequence, f.token)), layer)
    flips.sort(key=lambda f: (f.layer, f.sequence, f.token))
    notes = _noise_notes(flips, noise, factor)
    if any(la.basis == MARGIN_RULE_BASIS for la in layers):
        notes.append(
            "routing judged by the margin rule (no calibrated routing noise): a flip is benign when the "
            "baseline's margin is within the rule's unit x RMS of the token's router scores"
        )
    unexplained = sum(f.margin < 0 for f in flips)
    if unexplained:
        notes.append(
            f"{unexplained} flips at tokens whose baseline choice is not the top-k of its recorded router "
            "scores (a biased or grouped selection recorded without its selection scores): their margin "
            "cannot be measured, so they fail"
        )
    return RouterComparison(
        layers=tuple(layers),
        first_flip=flips[0] if flips else None,
        first_failing_flip=next((f for f in flips if not f.benign), None),
        flips_shown=tuple(flips[:SHOWN_FLIPS]),
        only_baseline=tuple(sorted(rb.keys() - rt.keys())),
        only_target=tuple(sorted(rt.keys() - rb.keys())),
        notes=tuple(notes),
        warnings=tuple(excessive),
        ranks=tuple(ranks),
    )
