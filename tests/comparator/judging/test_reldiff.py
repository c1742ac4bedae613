"""The one rel_diff ratio (:mod:`comparator.judging.reldiff`): its rules for one value and per row, and the
comparator's whole-tensor and per-token rel_diff taken through it."""

from __future__ import annotations

import math

import numpy as np

from comparator.hidden.metrics import pair_stats, rel_diff
from comparator.judging.reldiff import rel_diff_of


def test_one_value():
    assert rel_diff_of(1.0, 4.0) == 0.25
    assert rel_diff_of(0.0, 0.0) == 0.0  # two all-zero tensors
    assert rel_diff_of(1.0, math.nan) == 0.0  # a NaN sum is not above 0
    assert math.isnan(rel_diff_of(math.inf, math.inf))  # past float64's range, unscaled: as it was
    assert rel_diff_of(0.0, 4.0, mismatched=True) == math.inf


def test_per_row():
    dd, norms = np.array([0.0, 1.0, 1.0, 2.0]), np.array([0.0, 2.0, math.nan, 4.0])
    got = rel_diff_of(dd, norms, mismatched=np.array([False, False, False, True]))
    assert got.dtype == np.float64 and got.tolist() == [0.0, 0.5, 0.0, math.inf]
    assert rel_diff_of(dd[:2], norms[:2]).tolist() == [0.0, 0.5]


def test_whole_tensor_and_per_token_follow_the_rules():
    x = np.array([[0.0, 0.0], [1.0, 2.0], [1.0, np.nan]])
    y = np.array([[0.0, 0.0], [1.0, 3.0], [1.0, 2.0]])
    s = pair_stats(x, y, "F64")
    assert s.token_rel_diff.tolist() == [0.0, 1 / 15, math.inf]  # 0/0, the formula, a NaN/Inf mismatch
    assert s.rel_diff == math.inf == rel_diff(x, y)
    assert rel_diff(x[:2], y[:2]) == pair_stats(x[:2], y[:2], "F64").rel_diff == rel_diff_of(1.0, 15.0)
    assert rel_diff(np.zeros((2, 3)), np.zeros((2, 3))) == 0.0
