"""The metrics from their streamed sums: known sums give the values float64 numpy computes.

:func:`comparator.hidden.metrics._finish` turns the per-row sums (sum d^2, x^2, y^2, x*y,
mismatches) into the registered metrics; here the sums are built by the test from arrays, and
every expected value is computed from the same arrays with plain float64 numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.hidden.metrics import _finish, pair_stats, rel_diff
from dumper.errors import NotComparableError


def _sums(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The [rows, 5] row sums of two finite float64 arrays, as the kernels define them."""
    d = x - y
    return np.stack([(d * d).sum(1), (x * x).sum(1), (y * y).sum(1), (x * y).sum(1), np.zeros(len(x))], axis=1)


def _finish_of(x: np.ndarray, y: np.ndarray, bad: np.ndarray | None = None):
    sums = _sums(x, y)
    if bad is not None:
        sums[:, 4] = bad
    d = np.abs(x - y)
    return _finish(sums, None, float(d.max()), (float(d.sum()), 0), (0, 0, 0, 0), x.size)


def test_known_sums_give_the_numpy_metrics():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 9))
    y = x + 1e-3 * rng.standard_normal((6, 9))
    s = _finish_of(x, y)
    d = x - y
    assert s.rel_diff == pytest.approx((d**2).sum() / ((x**2).sum() + (y**2).sum()), rel=1e-12)
    assert s.cosine == pytest.approx((x * y).sum() / np.sqrt((x**2).sum() * (y**2).sum()), rel=1e-12)
    assert s.max_abs_diff == np.abs(d).max()
    assert s.mean_abs_diff == pytest.approx(np.abs(d).mean(), rel=1e-12)
    token = (d**2).sum(1) / ((x**2).sum(1) + (y**2).sum(1))
    np.testing.assert_allclose(s.token_rel_diff, token, rtol=1e-12)
    assert s.max_token_rel_diff == pytest.approx(token.max(), rel=1e-12)
    assert list(s.metrics) == ["rel_diff", "max_token_rel_diff", "max_abs_diff", "mean_abs_diff", "cosine"]


def test_zero_tensors_and_one_sided_zeros():
    z = np.zeros((2, 3))
    both = _finish_of(z, z)
    assert (both.rel_diff, both.cosine, both.max_token_rel_diff, both.max_abs_diff) == (0.0, 1.0, 0.0, 0.0)
    one = _finish_of(np.ones((2, 3)), z)
    assert (one.rel_diff, one.cosine) == (1.0, 0.0)  # ||x||^2 / ||x||^2; nothing to align with
    np.testing.assert_array_equal(one.token_rel_diff, [1.0, 1.0])


def test_a_row_with_a_mismatch_is_infinite_and_the_rest_is_averaged_without_it():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    y = x + 0.5
    s = _finish_of(x, y, bad=np.array([0, 2, 0]))  # row 1 had two NaN/Inf mismatches
    assert s.nonfinite_mismatches == 2
    assert math.isinf(s.rel_diff) and math.isinf(s.max_abs_diff) and math.isinf(s.max_token_rel_diff)
    assert np.isinf(s.token_rel_diff[1]) and np.isfinite(s.token_rel_diff[[0, 2]]).all()
    assert s.mean_abs_diff == pytest.approx(np.abs(x - y).sum() / (x.size - 2), rel=1e-12)


def test_nan_never_passes_a_threshold(tmp_path):
    base = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    target = base.clone()
    target[3, 2] = math.nan
    for side, t in (("base", base), ("target", target)):
        with dumper.capture(None, tmp_path / side):
            dumper.dump("t", t)
    report = compare_dumps(tmp_path / "base", tmp_path / "target", CompareConfig(threshold=1e30, token_threshold=1e30))
    (t,) = report.tensors
    assert not report.passed and not t.passed
    assert (t.nan_baseline, t.nan_target, t.nonfinite_mismatches) == (0, 1, 1)
    assert math.isinf(t.rel_diff) and t.first_failing_row == 3 and t.failing_tokens == 1


def test_nan_against_nan_agrees_but_is_counted():
    x = np.array([[1.0, math.nan, 3.0]], np.float32)
    s = pair_stats(x, x.copy(), "F32")
    assert (s.rel_diff, s.nonfinite_mismatches, s.nan_x, s.nan_y) == (0.0, 0, 1, 1)


def test_empty_tensors_have_nothing_to_fail_but_are_not_comparable(tmp_path):
    s = pair_stats(np.zeros((3, 0), np.float32), np.zeros((3, 0), np.float32), "F32")
    assert s.token_rel_diff.shape == (3,) and (s.rel_diff, s.cosine, s.max_abs_diff) == (0.0, 1.0, 0.0)
    for side in ("a", "b"):
        with dumper.capture(None, tmp_path / side):
            dumper.dump("empty", torch.zeros(0, 4))
    with pytest.raises(NotComparableError, match=r"zero tensors match .*1 empty"):
        compare_dumps(tmp_path / "a", tmp_path / "b")


def test_float32_against_bfloat16_is_compared_in_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    y_bf16 = torch.from_numpy(x * 1.01).to(torch.bfloat16)
    y = y_bf16.float().double().numpy()  # the target's values, widened by torch
    s = pair_stats(x, y_bf16.view(torch.int16).numpy().view(np.uint16), "F32", "BF16")
    x64 = x.astype(np.float64)
    assert s.rel_diff == pytest.approx(((x64 - y) ** 2).sum() / ((x64**2).sum() + (y**2).sum()), rel=1e-12)
    assert s.max_abs_diff == np.abs(x64 - y).max()


def test_rel_diff_of_numpy_arrays():
    assert rel_diff(np.array([1, 2], np.float16), np.array([1, 3], np.float16)) == pytest.approx(1 / 15, rel=1e-12)
    # uint16 values are integers here, not bfloat16 bit patterns
    assert rel_diff(np.array([1, 2], np.uint16), np.array([1, 3], np.uint16)) == pytest.approx(1 / 15, rel=1e-12)
    assert rel_diff(np.array([1.0, 2.0]), np.array([1.0, 2.0], np.float32)) == 0.0
