"""Metrics over the whole float64 range: huge, tiny, subnormal and mixed-scale inputs.

Every metric of :mod:`comparator.hidden.metrics` (through the C kernel, on each ISA it has, and
through the numpy fallback) is checked against an exact oracle in ``fractions.Fraction`` on
small arrays whose values span 2^-1074 .. 2^1023, mixed within a tensor and within a row.
Tolerance: 1e-12 relative, plus 1e-300 absolute for ratios (below that float64 cannot hold
what an underflowing square loses; :mod:`comparator.hidden.metrics` documents the same bound).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dumper
from comparator import compare_dumps
from comparator.config import CompareConfig
from comparator.hidden import kernels
from comparator.hidden.metrics import PairStats, StatsAccumulator, pair_stats, rel_diff

IMPLS = [*(kernels._kernels.ISAS if kernels.HAVE_EXTENSION else ()), "numpy"]
MAX = float(np.finfo(np.float64).max)
TINY = 5e-324  # smallest subnormal
RTOL, ATOL = 1e-12, 1e-300


@contextlib.contextmanager
def impl(name: str) -> Iterator[None]:
    """Run the metrics on one kernel ISA, or on the numpy fallback ("numpy")."""
    saved = kernels._kernels
    if name == "numpy":
        kernels._kernels = None
    else:
        kernels._kernels._set_isa(name)
    try:
        yield
    finally:
        kernels._kernels = saved
        if saved is not None:
            saved._set_isa(None)


def _float(q: Fraction) -> float:
    """Fraction -> float64, correctly rounded; inf past the range."""
    try:
        return float(q)
    except OverflowError:
        return math.inf if q > 0 else -math.inf


def _ratio(dd: Fraction, norm: Fraction) -> float:
    return _float(dd / norm) if norm else 0.0


def _cosine(xy: Fraction, xx: Fraction, yy: Fraction) -> float:
    if not (xx and yy):
        return 1.0 if xx == yy else 0.0
    return math.sqrt(_float(xy * xy / (xx * yy))) * (1.0 if xy >= 0 else -1.0)


def oracle(x: np.ndarray, y: np.ndarray) -> dict:
    """The metrics of two finite float arrays, computed exactly (each value is a binary fraction)."""
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    rows = [
        [(Fraction(float(a)), Fraction(float(b))) for a, b in zip(rx, ry, strict=True)]
        for rx, ry in zip(x2, y2, strict=True)
    ]
    sums = [
        [
            sum(((a - b) ** 2 for a, b in r), Fraction(0)),
            sum((a * a for a, _ in r), Fraction(0)),
            sum((b * b for _, b in r), Fraction(0)),
            sum((a * b for a, b in r), Fraction(0)),
        ]
        for r in rows
    ]
    dd, xx, yy, xy = (sum((s[i] for s in sums), Fraction(0)) for i in range(4))
    diffs = [abs(a - b) for r in rows for a, b in r]
    return {
        "rel_diff": _ratio(dd, xx + yy),
        "token_rel_diff": [_ratio(s[0], s[1] + s[2]) for s in sums],
        "max_abs_diff": _float(max(diffs, default=Fraction(0))),
        "mean_abs_diff": _float(sum(diffs, Fraction(0)) / max(1, len(diffs))),
        "cosine": _cosine(xy, xx, yy),
    }


def close(got: float, want: float, atol: float = ATOL) -> bool:
    if math.isinf(want):
        return got == want
    return math.isfinite(got) and abs(got - want) <= RTOL * abs(want) + atol


def assert_matches(s: PairStats, want: dict) -> None:
    assert close(s.rel_diff, want["rel_diff"]), (s.rel_diff, want["rel_diff"])
    assert len(s.token_rel_diff) == len(want["token_rel_diff"])
    for got, exp in zip(s.token_rel_diff.tolist(), want["token_rel_diff"], strict=True):
        assert close(got, exp), (s.token_rel_diff, want["token_rel_diff"])
    assert s.max_abs_diff == want["max_abs_diff"]
    assert close(s.mean_abs_diff, want["mean_abs_diff"], atol=1e-320), (s.mean_abs_diff, want["mean_abs_diff"])
    assert abs(s.cosine - want["cosine"]) <= 1e-12, (s.cosine, want["cosine"])
    assert s.nonfinite_mismatches == 0 and s.nan_x == s.inf_x == s.nan_y == s.inf_y == 0


# -- random inputs over the whole exponent range ---------------------------------------------


@st.composite
def wide_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Two finite float64 [rows, cols] arrays with scales from 2^-1074 to 2^1023.

    The scale is one per tensor, one per row or one per element; y is x perturbed relatively,
    an independent array at other scales, x times a power of two, x with one-ulp changes, or
    zeros; some elements and rows are zeroed.
    """
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    exps = st.integers(-1074, 1023)

    def scales() -> np.ndarray:
        layout = draw(st.sampled_from(["tensor", "row", "element"]))
        if layout == "tensor":
            return np.full((rows, cols), draw(exps))
        if layout == "row":
            return np.array(draw(st.lists(exps, min_size=rows, max_size=rows)))[:, None].repeat(cols, 1)
        return rng.integers(-1074, 1024, (rows, cols))

    x = np.ldexp(rng.uniform(-1, 1, (rows, cols)), scales())
    how = draw(st.sampled_from(["relative", "independent", "power", "ulp", "zero"]))
    if how == "relative":
        y = x * (1 + draw(st.sampled_from([2.0**-52, 1e-8, 1e-3, 0.5])) * rng.uniform(-1, 1, x.shape))
    elif how == "independent":
        y = np.ldexp(rng.uniform(-1, 1, (rows, cols)), scales())
    elif how == "power":
        with np.errstate(over="ignore"):
            y = np.ldexp(x, draw(st.integers(-60, 60)))
    elif how == "ulp":
        y = np.where(rng.random(x.shape) < 0.5, np.nextafter(x, np.inf), x)
    else:
        y = np.zeros_like(x)
    y = np.where(np.isfinite(y), y, x)
    x[rng.random(x.shape) < 0.15] = 0.0
    y[rng.random(y.shape) < 0.15] = 0.0
    if rows > 1 and draw(st.booleans()):
        x[0] = y[0] = 0.0
    return x, y


@pytest.mark.parametrize("name", IMPLS)
@settings(max_examples=150, deadline=None, derandomize=True)
@given(pair=wide_pairs())
def test_metrics_match_exact_oracle(name: str, pair: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = pair
    with impl(name):
        assert_matches(pair_stats(x, y, "F64", threads=1), oracle(x, y))


@pytest.mark.parametrize("name", IMPLS)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(pair=wide_pairs(), cut=st.integers(0, 9), data=st.data())
def test_pieces_at_different_scales_combine_exactly(
    name: str, pair: tuple[np.ndarray, np.ndarray], cut: int, data: st.DataObject
) -> None:
    """Column pieces (shards), row pieces (exclusive) and split kernel units all add up right."""
    x, y = pair
    want = oracle(x, y)
    cut = min(cut, x.shape[1])
    with impl(name):
        acc = StatsAccumulator(x.shape[0], threads=2)
        acc.add(0, x[:, :cut], y[:, :cut], "F64")
        acc.add(0, x[:, cut:], y[:, cut:], "F64")
        assert_matches(acc.finish(), want)
        r = data.draw(st.integers(0, x.shape[0]))
        acc = StatsAccumulator(x.shape[0], threads=2)
        acc.add_many([(0, x[:r], y[:r], "F64", "F64"), (r, x[r:], y[r:], "F64", "F64")], exclusive=True)
        assert_matches(acc.finish(), want)
        assert_matches(pair_stats(x, y, "F64", threads=2, block_bytes=8 * x.shape[1]), want)  # a block per row
        pieces = [(x[:, :cut], y[:, :cut]), (x[:, cut:], y[:, cut:])]
        got = StatsAccumulator(x.shape[0]).add_many([(0, a, b, "F64", "F64") for a, b in pieces], piece_sums=True)
    for (dd, norm), (a, b) in zip(got, pieces, strict=True):  # piece ratios (which shard differs most)
        assert math.isfinite(dd) and math.isfinite(norm)
        if min(dd, norm) > 2.0**-900:  # one common scale: what falls below 2^-1022 of the largest reads 0
            assert close(dd / norm, oracle(a, b)["rel_diff"]), (dd, norm)


@pytest.mark.parametrize("name", IMPLS)
def test_kernel_units_at_different_scales_merge(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One block cut into many thread units whose rows have wildly different scales."""
    rng = np.random.default_rng(7)
    x = np.ldexp(rng.uniform(-1, 1, (24, 5)), rng.integers(-1074, 1024, (24, 1)))
    y = x * (1 + 1e-3 * rng.uniform(-1, 1, x.shape))
    monkeypatch.setattr(kernels, "UNIT_BYTES", 40)  # one row per unit
    with impl(name):
        assert_matches(pair_stats(x, y, "F64", threads=2), oracle(x, y))


@pytest.mark.parametrize("name", IMPLS)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(pair=wide_pairs(), e32=st.integers(-149, 127), seed=st.integers(0, 2**32 - 1))
def test_mixed_f64_baseline_f32_target(name: str, pair: tuple[np.ndarray, np.ndarray], e32: int, seed: int) -> None:
    x, _ = pair
    rng = np.random.default_rng(seed)
    y = np.ldexp(rng.uniform(-1, 1, x.shape), e32).astype(np.float32)
    with np.errstate(over="ignore"):
        y = np.where(rng.random(x.shape) < 0.3, x.astype(np.float32), y)  # near x where float32 can hold it
    y = np.where(np.isfinite(y), y, np.float32(0))
    with impl(name):
        assert_matches(pair_stats(x, y, "F64", "F32", threads=1), oracle(x, y.astype(np.float64)))


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_float32_and_bfloat16_at_their_limits(name: str, dtype: str) -> None:
    """F32/BF16 values from their largest to their subnormals need no scaling, and get none wrong."""
    rng = np.random.default_rng(3)
    x32 = np.ldexp(rng.uniform(-1, 1, (6, 33)), rng.integers(-149, 129, (6, 1))).astype(np.float32)
    y32 = (x32 * np.float32(1.01)).astype(np.float32)
    y32 = np.where(np.isfinite(y32), y32, x32)
    if dtype == "BF16":
        xs, ys = (x32.view(np.uint32) >> 16).astype(np.uint16), (y32.view(np.uint32) >> 16).astype(np.uint16)
        x64, y64 = (xs.astype(np.uint32) << 16).view(np.float32), (ys.astype(np.uint32) << 16).view(np.float32)
    else:
        xs, ys, x64, y64 = x32, y32, x32, y32
    with impl(name):
        s = pair_stats(xs, ys, dtype, threads=1)
    assert_matches(s, oracle(x64.astype(np.float64), y64.astype(np.float64)))
    assert (s.token_rel_diff > 0).all()


# -- named regressions ------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("scale", [1e300, 1e-300, 1e-310])
def test_relative_difference_at_extreme_scales(name: str, scale: float) -> None:
    """1e300 vs 1e300*(1+1e-3) gave NaN, 1e-300 gave 0: both are (1e-3)^2 / (2 + 2e-3 + 1e-6)."""
    x = np.full((3, 16), scale)
    y = x * (1 + 1e-3)
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
        assert rel_diff(x, y) == s.rel_diff
    assert_matches(s, oracle(x, y))
    approx = (1e-3) ** 2 / (2 + 2e-3 + 1e-6)
    assert s.rel_diff == pytest.approx(approx, rel=1e-9 if scale > 1e-308 else 1e-2)  # 1e-310: 14-bit subnormals


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("exp", [-540, -520, -508, -500, -470, 470, 478, 482, 490])
def test_near_the_unscaled_range_limits(name: str, exp: int) -> None:
    """Around where the kernel's unscaled F64 path hands rows to the scaled one: one-ulp,
    tiny and large differences, in rows of 3 to 64 elements, all as exact as the oracle."""
    rng = np.random.default_rng(exp & 0xFFFF)
    x = np.ldexp(rng.uniform(0.5, 1, (6, 64)), exp)
    y = x.copy()
    y[0, 7] = np.nextafter(x[0, 7], np.inf)  # one ulp in one element
    y[1] = np.nextafter(x[1], -np.inf)  # one ulp everywhere
    y[2] *= 1 + 1e-9
    y[3] = -x[3]
    y[4, :3] = 0.0
    x[5, 3:], y[5, 3:] = 0.0, 0.0  # a 3-element row
    with impl(name):
        assert_matches(pair_stats(x, y, "F64", threads=1), oracle(x, y))


@pytest.mark.parametrize("name", IMPLS)
def test_largest_finite_values(name: str) -> None:
    x = np.array([[MAX, MAX, -MAX, MAX], [MAX, MAX, MAX, MAX]])
    y = np.array([[-MAX, MAX, MAX, np.nextafter(MAX, 0)], [MAX, MAX, MAX, np.nextafter(MAX, 0)]])
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
    assert_matches(s, oracle(x, y))
    assert s.max_abs_diff == math.inf  # 2 * MAX itself is past float64's range
    assert 0 < s.token_rel_diff[1] < 1e-32 and math.isfinite(s.rel_diff)


@pytest.mark.parametrize("name", IMPLS)
def test_subnormals(name: str) -> None:
    x = np.array([[TINY, 3 * TINY, 0.0, 2.0**-1070], [TINY, 0.0, 0.0, 0.0], [2.0**-1022, TINY, 0, 0]])
    y = np.array([[2 * TINY, 3 * TINY, TINY, 2.0**-1070], [0.0, 0.0, 0.0, 0.0], [2.0**-1022, TINY, 0, 0]])
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
    assert_matches(s, oracle(x, y))
    assert s.token_rel_diff.tolist()[1:] == [1.0, 0.0]
    assert s.max_abs_diff == TINY


@pytest.mark.parametrize("name", IMPLS)
def test_scales_within_one_row(name: str) -> None:
    """2^997 and 2^-997 in one row; a 2^-997 difference between huge values stays visible."""
    big, small = 2.0**997, 2.0**-997
    x = np.array([[big, small, -(2.0**664), 0.0], [big, big, small, small]])
    y = np.array([[big, 2 * small, -(2.0**664), 0.0], [big, big, small, 3 * small]])
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
    assert_matches(s, oracle(x, y))
    assert s.max_abs_diff == 2 * small and s.mean_abs_diff == 3 * small / 8
    assert s.token_rel_diff.tolist() == [0.0, 0.0]  # 2^-1994 of the norm: below float64


@pytest.mark.parametrize("name", IMPLS)
def test_zero_rows_and_one_sided_zeros_keep_their_convention(name: str) -> None:
    """x == y == 0 is rel_diff 0 and cosine 1; zero against anything nonzero is rel_diff 1."""
    x = np.array([[0.0, 0.0], [0.0, 0.0], [1e-300, -1e-300], [1e300, 0.0]])
    y = np.array([[0.0, 0.0], [TINY, 0.0], [0.0, 0.0], [0.0, 0.0]])
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
        z = pair_stats(x[:1], y[:1], "F64", threads=1)
    assert_matches(s, oracle(x, y))
    assert s.token_rel_diff.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert (z.rel_diff, z.cosine, z.max_abs_diff) == (0.0, 1.0, 0.0)


@pytest.mark.parametrize("name", IMPLS)
def test_nonfinite_never_passes_at_extreme_scales(name: str) -> None:
    x = np.array([[1e300, np.nan, 1e300], [1e-300, 1e-300, 2e-300], [np.inf, 1e300, 1e-300]])
    y = np.array([[1e300, 1e300, 1e300], [1e-300, 1e-300, 2e-300], [np.inf, 1e300, 1e-300]])
    with impl(name):
        s = pair_stats(x, y, "F64", threads=1)
    assert s.token_rel_diff.tolist() == [math.inf, 0.0, 0.0]
    assert s.rel_diff == math.inf and s.nonfinite_mismatches == 1
    assert (s.nan_x, s.inf_x, s.nan_y, s.inf_y) == (1, 1, 0, 1)


def test_kernel_raw_sums_are_the_rounded_true_sums() -> None:
    """Without exps, the kernel writes true sums rounded to float64: inf past its range, exact in it."""
    if not kernels.HAVE_EXTENSION:
        pytest.skip("comparator._kernels not built")
    x = np.array([[1e300, 1e300], [1e-300, 3e-300], [3.0, 4.0]])
    y = np.array([[1e300, -1e300], [1e-300, 1e-300], [3.0, 0.0]])
    out, exps = np.empty((3, 5)), np.empty((3, 2), np.int32)
    plain = kernels._kernels.row_stats(x, y, "F64", 3, 2, out)
    scaled = kernels._kernels.row_stats(x, y, "F64", 3, 2, out.copy(), exps)
    assert out[0, :3].tolist() == [math.inf, math.inf, math.inf] and out[1, :3].tolist() == [0.0, 0.0, 0.0]
    assert out[2].tolist() == [16.0, 25.0, 9.0, 9.0, 0.0] and exps[2].tolist() == [0, 0]
    assert exps[0].tolist() == [997, 997] and exps[1].tolist() == [-994, -996]  # 3e-300 < 2^-994
    assert plain[0] == scaled[0] == 2e300 and plain[1] == 2e300 + 2e-300 + 4.0
    assert math.ldexp(scaled[1], scaled[6]) == plain[1]


# -- through the whole comparator -------------------------------------------------------------


def _write(out: Path, t: torch.Tensor) -> Path:
    with dumper.capture(None, out, model_name="range"):
        dumper.dump(
            "model.layers.0.self_attn.input",
            t,
            layer=0,
            point="input",
            positions=list(range(t.shape[0])),
            sequence_ids=[0] * t.shape[0],
        )
    return out


@pytest.mark.parametrize("scale", [1e300, 1e-300])
def test_compare_dumps_of_extreme_float64_tensors(tmp_path: Path, scale: float) -> None:
    """Real F64 dumps: a 1e-3 relative difference passes, a 10% one diverges, at 1e300 and 1e-300."""
    x = torch.full((4, 16), scale, dtype=torch.float64) * (1 + torch.arange(16, dtype=torch.float64) / 16)
    base = _write(tmp_path / "base", x)
    close_dump = _write(tmp_path / "close", x * (1 + 1e-3))
    far_dump = _write(tmp_path / "far", x * (1 + torch.linspace(0, 0.2, 16, dtype=torch.float64)))
    close_rep = compare_dumps(base, close_dump, CompareConfig())
    far_rep = compare_dumps(base, far_dump, CompareConfig())
    (ct,), (ft,) = close_rep.tensors, far_rep.tensors
    assert ct.passed and close_rep.passed
    assert ct.rel_diff == pytest.approx((1e-3) ** 2 / (2 + 2e-3 + 1e-6), rel=1e-9)
    assert not ft.passed and not far_rep.passed and ft.first_failing_token == 0
    want = oracle(x.numpy(), (x * (1 + torch.linspace(0, 0.2, 16, dtype=torch.float64))).numpy())
    assert close(ft.rel_diff, want["rel_diff"]) and close(ft.max_token_rel_diff, max(want["token_rel_diff"]))
    assert all(math.isfinite(v) for v in (ft.rel_diff, ft.max_abs_diff, ft.mean_abs_diff, ft.cosine))
