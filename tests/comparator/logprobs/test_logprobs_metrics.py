"""Logprob-level metrics: the design note's worked examples, k3 properties, KL from logits, verdict and thresholds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.judging.logprob_metrics import metric_names
from comparator.judging.logprob_thresholds import LogprobThresholds, load_threshold_table, logprob_env_thresholds
from comparator.logprobs import (
    UNKNOWN_TOKEN,
    Located,
    LogprobVerdict,
    SequenceLogprobs,
    align_samples,
    compare_logprobs,
    k3,
    k3_stats,
    kl_percentiles,
    kl_rows,
    top1_agreement,
    topk_errors,
)
from dumper.errors import NotComparableError, UsageError

NO_CHECKS = LogprobThresholds()
VERDICT_KEYS = {
    "mse",
    "rmse",
    "max_abs_err",
    "k3_mean",
    "k3_max",
    "kl_mean",
    "kl_max",
    "kl_percentiles",
    "top1_agreement",
    "topk_max_err",
    "topk_mean_err",
    "compared_positions",
    "requests",
    "unmatched_baseline",
    "unmatched_target",
    "thresholds",
    "passed",
    # llama-perplexity's statistics (comparator/logprobs/llama_stats.py)
    "ppl_base",
    "ppl_base_se",
    "ppl_target",
    "ppl_target_se",
    "ln_ppl_ratio",
    "ln_ppl_ratio_se",
    "ppl_ratio",
    "ppl_ratio_se",
    "ppl_correlation",
    "delta_p",
    "kl_mean_se",
    "kl_quantiles",
    "same_top_rate",
    "same_top_se",
    # issue 11: mean |Δlogprob| and standard errors, noise multiples, which table rows applied
    "mean_abs_err",
    "mean_abs_err_se",
    "k3_mean_se",
    "noise",
    "threshold_source",
}


def seq(request: str, logprobs, ids=None, top=None, texts=None) -> SequenceLogprobs:
    ids = tuple(range(10, 10 + len(logprobs))) if ids is None else ids
    return SequenceLogprobs(request, ids, tuple(logprobs), top, texts)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------- the design note's examples


def test_note_kl_example():
    """D_KL((0.7, 0.2, 0.1) || (0.6, 0.3, 0.1)) ~= 0.0268, from logits rows log(p)."""
    p = np.log(np.array([[0.7, 0.2, 0.1]]))
    q = np.log(np.array([[0.6, 0.3, 0.1]]))
    kl = kl_rows(p, q)
    assert kl.shape == (1,)
    assert round(float(kl[0]), 4) == 0.0268
    assert kl[0] == pytest.approx(0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3), rel=1e-12)
    # the logits' scale and shift do not matter (softmax is shift-invariant), the dtype barely
    assert kl_rows((p + 5).astype(np.float32), (q - 3).astype(np.float32))[0] == pytest.approx(kl[0], rel=1e-5)


def test_note_mse_example():
    """Deltas 0.1, 0.1, 0.05, 0.2: MSE 0.015625 and max error 0.2 at the 4th compared position."""
    ref = [None, -1.0, -2.0, -0.5, -1.5]
    tgt = [None, -1.1, -1.9, -0.55, -1.7]
    v = compare_logprobs([seq("r", ref)], [seq("r", tgt)], NO_CHECKS)
    assert v.mse == pytest.approx(0.015625, abs=1e-12)
    assert v.rmse == pytest.approx(0.125, abs=1e-12)
    assert v.max_abs_err.value == pytest.approx(0.2, abs=1e-12)
    assert v.max_abs_err == Located(v.max_abs_err.value, "r", 4)  # position 0 has no logprob: 4th compared = position 4
    assert v.compared_positions == 4 and v.requests == 1
    assert v.passed  # nothing checked
    assert v.kl_mean is None and v.kl_percentiles is None and v.topk_max_err is None


# --------------------------------------------------------------------------- k3


@given(st.floats(min_value=-700, max_value=700, allow_nan=False))
def test_k3_nonnegative(d):
    assert k3(np.array([d]))[0] >= 0


@given(st.floats(min_value=1e-150, max_value=1e-3) | st.floats(min_value=-1e-3, max_value=-1e-150))
def test_k3_is_half_square_for_small_delta(d):
    """k3 = d^2/2 + d^3/6 + ...: relative gap to d^2/2 is about |d|/3, also where expm1(d) - d would cancel to 0."""
    v = float(k3(np.array([d]))[0])
    assert v > 0
    assert abs(v / (0.5 * d * d) - 1) <= abs(d)


def test_k3_values_and_edges():
    d = np.array([0.0, 1.0, -1.0, 0.5, np.inf, -np.inf, np.nan])
    out = k3(d)
    assert out[0] == 0.0
    assert out[1] == pytest.approx(math.e - 2, rel=1e-15)
    assert out[2] == pytest.approx(math.exp(-1), rel=1e-15)
    assert out[3] == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-14)
    assert out[4] == math.inf and out[5] == math.inf and math.isnan(out[6])
    assert k3(np.float64(1e-3)).shape == ()  # scalars stay scalars
    # continuity across the series / expm1 switch at |d| = 1e-2
    for x in (1e-2, -1e-2):
        lo, hi = k3(np.array([np.nextafter(x, 0), x]))
        assert lo == pytest.approx(hi, rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(min_value=2, max_value=12),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.floats(min_value=0.01, max_value=3.0),
)
def test_k3_expectation_is_exact_kl(vocab, seed, scale):
    """E_{x~P}[k3(log Q(x) - log P(x))] = sum Q - 1 + KL(P||Q) = KL(P||Q) over the whole vocabulary."""
    rng = np.random.default_rng(seed)
    zp = rng.normal(size=(1, vocab)) * 3
    zq = zp + rng.normal(size=(1, vocab)) * scale
    lp, lq = log_softmax(zp)[0], log_softmax(zq)[0]
    expected = float(np.sum(np.exp(lp) * k3(lq - lp)))
    assert expected == pytest.approx(float(kl_rows(zp, zq)[0]), rel=1e-9, abs=1e-14)


# --------------------------------------------------------------------------- KL from logits


def test_kl_rows_chunked_equals_unchunked_and_dtypes():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(37, 101)).astype(np.float32) * 4
    b = a + rng.normal(size=a.shape).astype(np.float32) * 0.05
    whole = kl_rows(a, b, chunk_rows=10_000)
    for chunk in (1, 3, 16, 37):
        np.testing.assert_array_equal(kl_rows(a, b, chunk_rows=chunk), whole)
    ref = np.array([np.sum(np.exp(p) * (p - q)) for p, q in zip(log_softmax(a), log_softmax(b), strict=True)])
    np.testing.assert_allclose(whole, ref, rtol=1e-10, atol=1e-16)
    assert whole.dtype == np.float64 and np.all(whole >= 0)
    np.testing.assert_allclose(kl_rows(a.astype(np.float16), b.astype(np.float16)), whole, rtol=0.2, atol=1e-5)
    assert np.all(kl_rows(a, a) == 0)


def test_kl_rows_no_underflow_in_tails():
    """A 1e-30 tail in float32 logits, and tails below float64's smallest probability, stay finite and exact."""
    p = np.array([[0.5, 0.5 - 1e-30, 1e-30]])
    q = np.array([[0.5, 0.5 - 2e-30, 2e-30]])
    kl = kl_rows(np.log(p).astype(np.float32), np.log(q).astype(np.float32))
    assert np.isfinite(kl).all() and kl[0] >= 0
    # tail logits 1000 below the head: exp underflows to 0 even in float64, log space does not
    a = np.array([[0.0, 0.0, -1000.0]], np.float32)
    b = np.array([[0.0, -0.1, -1100.0]], np.float32)
    kl = kl_rows(a, b)
    lp, lq = log_softmax(a[:, :2])[0], log_softmax(b[:, :2])[0]
    assert np.isfinite(kl[0]) and kl[0] == pytest.approx(np.sum(np.exp(lp) * (lp - lq)), rel=1e-12)
    # q assigns 0 where p does not: infinite, never NaN
    assert kl_rows(np.array([[0.0, 0.0]]), np.array([[0.0, -np.inf]]))[0] == math.inf


def test_kl_rows_nonfinite_rows():
    a = np.array([[0.0, np.nan], [0.0, np.nan], [1.0, 2.0]])
    b = np.array([[0.0, np.nan], [0.0, 1.0], [1.0, 2.0]])
    np.testing.assert_array_equal(kl_rows(a, b), [0.0, math.inf, 0.0])


def test_kl_rows_rejects_bad_input():
    with pytest.raises(UsageError, match="float"):
        kl_rows(np.zeros((2, 3), np.uint16), np.zeros((2, 3), np.uint16))
    with pytest.raises(NotComparableError, match="shapes differ"):
        kl_rows(np.zeros((2, 3)), np.zeros((2, 4)))


def test_top1_agreement_and_percentiles():
    a = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0]], np.float16)
    b = np.array([[3.0, 1.5, 0.0], [0.0, 1.0, 2.0], [0.0, 0.0, 5.0]], np.float16)
    assert top1_agreement(a, b) == (2, 3)
    assert top1_agreement(a, b, chunk_rows=1) == (2, 3)
    v = np.arange(1001, dtype=np.float64) / 1000
    pct = kl_percentiles(v)
    assert set(pct) == {"mean", "max", "99.9", "99", "95", "90", "50"}
    assert pct["50"] == pytest.approx(0.5) and pct["max"] == 1.0 and pct["mean"] == pytest.approx(0.5)
    assert pct["99.9"] == pytest.approx(np.percentile(v, 99.9)) and pct["90"] == pytest.approx(0.9)
    assert kl_percentiles(np.array([0.1, np.inf, np.inf]))["max"] == math.inf
    assert kl_percentiles(np.array([0.1, np.inf, np.inf]))["99"] == math.inf  # inf - inf interpolation is not NaN


def test_compare_with_logits_kl_over_common_positions():
    rng = np.random.default_rng(1)
    base = [seq("a", [None, -1.0, -1.0, -1.0]), seq("b", [None, -2.0, -2.0])]
    tgt = [seq("a", [None, -1.0, -1.0, -1.0]), seq("b", [None, -2.0, -2.0])]
    la = rng.normal(size=(3, 8))
    lb = rng.normal(size=(2, 8))
    broken = la.copy()
    broken[1] += rng.normal(size=8) * 2  # position 2 of request a diverges
    ref = {"a": (np.array([1, 2, 3]), la), "b": (np.array([1, 2]), lb)}
    tgt_l = {"a": (np.array([3, 2, 1]), broken[::-1]), "b": (np.array([2]), lb[1:])}  # other order, b misses position 1
    v = compare_logprobs(base, tgt, LogprobThresholds(kl_max=0.01), ref_logits=ref, tgt_logits=tgt_l)
    kl = kl_rows(la, broken)
    assert v.kl_max == Located(float(kl[1]), "a", 2)
    assert v.kl_mean == pytest.approx(kl.sum() / 4)  # 3 rows of a, 1 of b (pooled)
    assert v.kl_percentiles is not None and v.kl_percentiles["max"] == v.kl_max.value
    assert v.top1_agreement == pytest.approx((3 + int(np.argmax(la[1]) == np.argmax(broken[1]))) / 4)
    assert not v.passed and v.failures() == ["kl_max"]
    with pytest.raises(UsageError, match="one side only"):
        compare_logprobs(base, tgt, NO_CHECKS, ref_logits=ref)
    with pytest.raises(NotComparableError, match="logits"):
        compare_logprobs(base, tgt, NO_CHECKS, ref_logits={"x": ref["a"]}, tgt_logits={"x": ref["a"]})


# --------------------------------------------------------------------------- alignment


def test_token_mismatch_names_request_and_position():
    a = seq("req-7", [None, -1.0, -1.0, -1.0], ids=(1, 2, 3, 4))
    b = seq("req-7", [None, -1.0, -1.0, -1.0], ids=(1, 2, 9, 4))
    with pytest.raises(NotComparableError) as e:
        align_samples([a], [b])
    msg = str(e.value)
    assert "'req-7'" in msg and "position 2" in msg and "3" in msg and "9" in msg and "\n" not in msg


def test_unknown_tokens_and_lengths():
    """Unknown ids (before SGLang's logprob_start_len) are not compared; only common positions count."""
    a = seq("r", [None, -1.0, -2.0, -3.0, -4.0], ids=(1, 2, 3, 4, 5))
    b = seq("r", [None, None, None, -3.0, -4.5], ids=(UNKNOWN_TOKEN, UNKNOWN_TOKEN, 3, 4, 5))
    al = align_samples([a], [b])
    assert al.samples[0].positions.tolist() == [3, 4]
    c = seq("r", [None, -1.0, -2.0], ids=(1, 2, 3))  # shorter: the common prefix is compared
    assert align_samples([a], [c]).samples[0].positions.tolist() == [1, 2]


def test_unmatched_requests_listed():
    base = [seq("a", [None, -1.0]), seq("only-base", [None, -1.0])]
    tgt = [seq("a", [None, -1.5]), seq("only-tgt", [None, -1.0]), seq("also-tgt", [None, -1.0])]
    v = compare_logprobs(base, tgt, NO_CHECKS)
    assert v.unmatched_baseline == ("only-base",) and v.unmatched_target == ("only-tgt", "also-tgt")
    assert v.requests == 1 and v.compared_positions == 1
    assert v.to_json()["unmatched_target"] == ["only-tgt", "also-tgt"]


def test_nothing_to_compare_is_an_error():
    with pytest.raises(NotComparableError, match="no request id in common"):
        align_samples([seq("a", [None, -1.0])], [seq("b", [None, -1.0])])
    with pytest.raises(NotComparableError, match="no position"):
        align_samples([seq("a", [None, -1.0])], [seq("a", [None, None])])
    with pytest.raises(UsageError, match="duplicate"):
        align_samples([seq("a", [None]), seq("a", [None])], [seq("a", [None])])


def test_text_agreement():
    a = seq("r", [None, -1.0], ids=(), texts=("Hel", "lo"))
    b = seq("r", [None, -1.25], ids=(), texts=("Hel", "lo"))
    assert compare_logprobs([a], [b], NO_CHECKS).max_abs_err.value == pytest.approx(0.25)
    with pytest.raises(NotComparableError, match="'lo'.*'la'"):
        align_samples([a], [seq("r", [None, -1.0], ids=(), texts=("Hel", "la"))])
    with pytest.raises(NotComparableError, match="one side has ids, the other only text"):
        align_samples([a], [seq("r", [None, -1.0])])


def test_sequence_validation():
    with pytest.raises(ValueError, match="logprobs"):
        SequenceLogprobs("r", (1, 2), (None,))
    s = SequenceLogprobs(3, [1, 2], [None, -1], [None, [(2, -1)]])  # lists and ints are normalized
    assert s == SequenceLogprobs("3", (1, 2), (None, -1.0), (None, ((2, -1.0),)))


# --------------------------------------------------------------------------- k3 / top-k aggregation


def test_k3_mean_is_mean_of_sample_means():
    base = [seq("long", [None] + [-1.0] * 9), seq("short", [None, -1.0])]
    tgt = [seq("long", [None] + [-1.0] * 8 + [-1.5]), seq("short", [None, -2.0])]
    s = k3_stats(align_samples(base, tgt).samples)
    expected = (float(k3(np.array([-0.5]))[0]) / 9 + float(k3(np.array([-1.0]))[0])) / 2
    assert s.mean == pytest.approx(expected, rel=1e-14)
    assert s.max == Located(float(k3(np.array([-1.0]))[0]), "short", 1)


def test_topk_max_and_mean_over_common_tokens():
    t1 = (None, ((5, -0.1), (6, -2.0), (7, -3.0)), ((5, -1.0), (6, -1.0)))
    t2 = (None, ((5, -0.1), (6, -2.5), (8, -3.0)), ((6, -1.0), (5, -1.2)))
    u1 = (None, ((1, -0.5),))
    u2 = (None, ((1, -0.6),))
    base = [seq("a", [None, -1.0, -1.0], top=t1), seq("b", [None, -1.0], top=u1), seq("c", [None, -1.0])]
    tgt = [seq("a", [None, -1.0, -1.0], top=t2), seq("b", [None, -1.0], top=u2), seq("c", [None, -1.0])]
    st_ = topk_errors(align_samples(base, tgt).samples)
    assert st_ is not None and st_.samples == 2  # c has no top-k
    # a: |d| over common tokens = 0, 0.5 (pos 1), 0.2, 0 (pos 2) -> max 0.5, mean 0.175; b: 0.1
    assert st_.max_err == pytest.approx(0.5)
    assert st_.mean_err == pytest.approx((0.175 + 0.1) / 2)
    v = compare_logprobs(base, tgt, LogprobThresholds(topk_max_err=1e-5))
    assert v.topk_max_err == pytest.approx(0.5) and not v.passed and v.failures() == ["topk_max_err"]
    assert topk_errors(align_samples(base[2:], tgt[2:]).samples) is None


# --------------------------------------------------------------------------- verdict and thresholds


def test_nan_never_passes_and_json_nulls():
    base = [seq("r", [None, -1.0, -2.0])]
    tgt = [seq("r", [None, float("nan"), -2.0])]
    generous = LogprobThresholds(mse=1e9, max_abs_err=1e9, k3_mean=1e9)
    v = compare_logprobs(base, tgt, generous)
    assert not v.passed and set(v.failures()) == {"mse", "max_abs_err", "k3_mean"}
    assert v.max_abs_err.position == 1
    d = v.to_json()
    assert d["mse"] is None and d["max_abs_err"] == {"value": None, "sample": "r", "position": 1}
    json.dumps(d, allow_nan=False)
    back = LogprobVerdict.from_json(json.loads(v.dumps()))
    assert back == v and back.mse == math.inf
    # a threshold check on a NaN value fails even with no limit in sight
    assert LogprobThresholds(mse=1e300).failures({"mse": math.nan}) == ["mse"]
    # the same NaN on both sides is no difference
    same = compare_logprobs([seq("r", [None, float("nan")])], [seq("r", [None, float("nan")])], generous)
    assert same.passed and same.mse == 0.0


def test_verdict_json_contract_and_round_trip():
    rng = np.random.default_rng(3)
    la = rng.normal(size=(2, 5))
    top = (None, ((10, -0.5),), ((11, -0.7),))
    base = [seq("a", [None, -0.5, -0.7], top=top)]
    tgt = [seq("a", [None, -0.51, -0.7], top=top), seq("z", [None, -1.0])]
    th = LogprobThresholds(mse=1e-3, kl_max=1.0)
    v = compare_logprobs(
        base,
        tgt,
        th,
        ref_logits={"a": (np.array([1, 2]), la)},
        tgt_logits={"a": (np.array([1, 2]), la + 0.01 * rng.normal(size=la.shape))},
    )
    d = v.to_json()
    assert set(d) == VERDICT_KEYS
    assert set(d["thresholds"]) == set(metric_names()) and d["thresholds"]["mse"] == 1e-3
    assert set(d["max_abs_err"]) == set(d["k3_max"]) == set(d["kl_max"]) == {"value", "sample", "position"}
    assert d["passed"] is True and isinstance(d["compared_positions"], int) and d["unmatched_target"] == ["z"]
    assert LogprobVerdict.from_json(json.loads(json.dumps(d))) == v
    # without logits or top-k the optional parts are null and still round-trip
    w = compare_logprobs([seq("a", [None, -1.0])], [seq("a", [None, -1.0])], th)
    dw = w.to_json()
    assert dw["kl_mean"] is None and dw["kl_percentiles"] is None and dw["top1_agreement"] is None
    assert dw["topk_max_err"] is None and dw["topk_mean_err"] is None
    assert dw["kl_max"] == {"value": None, "sample": None, "position": None}
    assert LogprobVerdict.from_json(dw) == w
    assert bool(w) is True


def test_threshold_boundary_and_skipped_metrics():
    base, tgt = [seq("r", [None, -1.0])], [seq("r", [None, -1.5])]
    assert compare_logprobs(base, tgt, LogprobThresholds(max_abs_err=0.5)).passed  # value <= threshold
    assert not compare_logprobs(base, tgt, LogprobThresholds(max_abs_err=0.4999)).passed
    # KL / top-k thresholds do not apply without logits / top-k
    assert compare_logprobs(base, tgt, LogprobThresholds(kl_mean=0.0, kl_max=0.0, topk_max_err=0.0)).passed
    with pytest.raises(UsageError):
        LogprobThresholds(mse=-1.0)
    with pytest.raises(UsageError):
        LogprobThresholds(k3_mean=math.nan)


def test_threshold_resolution_order(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(
        json.dumps(
            {
                "_comment": "x",
                "default": {
                    "mse": 1e-3,
                    "max_abs_err": 0.5,
                    "k3_mean": 1e-3,
                    "kl_mean": 1e-3,
                    "kl_max": 0.1,
                    "topk_max_err": 0.5,
                },
                "my-model": {"k3_mean": 1e-4, "kl_max": None},
            }
        )
    )
    t = LogprobThresholds.resolve("my-model", env={}, table=table)
    assert t.k3_mean == 1e-4 and t.kl_max is None and t.mse == 1e-3  # model entry over default; null = off
    assert LogprobThresholds.resolve("/ckpt/my-model/", env={}, table=table).k3_mean == 1e-4  # last path part
    assert LogprobThresholds.resolve("unknown", env={}, table=table).k3_mean == 1e-3  # fallback to default
    env = {"DRIFTSCOPE_LOGPROB_K3_MEAN": "2e-2", "DRIFTSCOPE_LOGPROB_MSE": "off", "DRIFTSCOPE_LOGPROB_KL_MAX": " "}
    t = LogprobThresholds.resolve("my-model", env=env, table=table)
    assert t.k3_mean == 2e-2 and t.mse is None and t.kl_max is None  # env beats the table; blank is unset
    t = LogprobThresholds.resolve("my-model", explicit={"k3_mean": 5.0, "max_abs_err": None}, env=env, table=table)
    assert t.k3_mean == 5.0 and t.max_abs_err is None  # explicit beats env
    with pytest.raises(UsageError, match="DRIFTSCOPE_LOGPROB_KL_MEAN"):
        logprob_env_thresholds({"DRIFTSCOPE_LOGPROB_KL_MEAN": "abc"})
    with pytest.raises(UsageError, match="unknown logprob threshold"):
        LogprobThresholds.resolve(explicit={"kl": 1.0}, env={}, table=table)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"default": {"k3": 1.0}}))
    with pytest.raises(UsageError, match="unknown keys"):
        load_threshold_table(bad)


def test_shipped_threshold_table():
    tab = load_threshold_table()
    assert {"default", "tiny-llama", "tiny-qwen2"} <= set(tab)
    d = LogprobThresholds.resolve(env={})
    assert d.k3_mean == 1e-3 and d.kl_mean == 1e-3
    assert all(getattr(d, n) is not None for n in metric_names())
    tiny = LogprobThresholds.resolve("tiny-llama", env={})
    assert tiny.k3_mean is not None and tiny.k3_mean < d.k3_mean
