"""Unit tests of the onset estimators and the amplification table (comparator.hidden.onset)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from comparator.hidden.onset import amplification, change_point, layer_onset, point_of, rounding_floor, token_onset


def test_change_point_finds_where_a_zero_run_gives_way():
    values = np.concatenate([np.zeros(128), np.geomspace(1e-8, 1e-2, 30)])
    assert change_point(values) == 128


def test_the_rounding_floor_is_the_coarser_dtype_epsilon_squared():
    assert rounding_floor(["F32"]) == np.finfo(np.float32).eps ** 2
    assert rounding_floor(["F32", "BF16"]) == rounding_floor(["BF16"]) == 2.0**-14  # bfloat16: 8 significand bits
    assert rounding_floor(["F64"]) < rounding_floor(["F32"]) < rounding_floor(["F16"]) < rounding_floor(["BF16"])
    assert rounding_floor(["I64"]) == rounding_floor([]) <= 1e-30  # no float dtype: no floor to speak of


def test_exact_zeros_then_rounding_are_one_run_under_the_floor():
    floor = rounding_floor(["F32"])
    rounding = np.concatenate([np.zeros(3), np.full(40, 2e-14), [6e-14]])  # bit-identical, then fp32 rounding
    assert change_point(rounding) == 3  # without a floor: 16 decades from exact to rounding
    assert change_point(rounding, floor=floor) is None
    bug = np.concatenate([rounding[:-1], [1e-9, 1e-8, 1e-6]])  # then a real step at index 43
    assert change_point(bug, floor=floor) == 43
    assert token_onset(bug, None, bug.size - 1, None, floor) == (43, "change-point")
    layers = [(0, 0.0, None), (1, 0.0, None), (2, 3e-14, None), (3, 5e-14, None), (4, 1e-6, None)]
    assert layer_onset(layers, 4) == (2, "change-point")  # the step from exact to rounding
    assert layer_onset(layers, 4, floor) == (4, "change-point")


def test_change_point_on_noise_then_a_decade_jump():
    rng = np.random.default_rng(0)
    noise = 10 ** rng.uniform(-15, -13, 100)
    values = np.concatenate([noise, 10 ** rng.uniform(-9, -8, 20)])
    assert change_point(values) == 100


def test_no_change_point_in_plain_noise():
    rng = np.random.default_rng(1)
    assert change_point(10 ** rng.uniform(-14, -13.5, 200)) is None  # half a decade apart at most
    assert change_point(np.array([1e-3])) is None


def test_a_single_spike_at_the_end_is_its_own_onset():
    values = np.full(50, 1e-14)
    values[-1] = 1e-3
    assert change_point(values) == 49


def test_nan_counts_as_a_large_value():
    values = np.concatenate([np.zeros(10), [np.nan, 1.0]])
    assert change_point(values) == 10


@given(st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), min_size=2, max_size=60))
def test_change_point_is_an_index_into_the_high_run(values):
    cp = change_point(np.array(values))
    if cp is not None:
        assert 1 <= cp < len(values)
        assert max(values[cp:]) > 0  # an onset is never inside an all-zero tail


def test_token_onset_orders_rows_by_position_and_stops_at_the_first_failing_row():
    positions = np.array([3, 0, 1, 2, 4, 5])
    token = np.array([1e-6, 0.0, 0.0, 0.0, 1e-4, 1e-2])  # starts at position 3 (row 0), fails at 5 (row 5)
    assert token_onset(token, positions, 5, None) == (0, "change-point")
    assert token_onset(token, positions, 5, 1e-9) == (0, "calibrated")
    assert token_onset(token, positions, 5, 1e-3) == (5, "calibrated")
    flat = np.full(6, 1e-4)
    assert token_onset(flat, None, 5, None) == (5, "threshold")


def test_layer_onset_calibrated_and_estimated():
    rows = [(0, 0.0, None), (1, 0.0, None), (2, 1e-7, None), (3, 1e-5, None), (4, 1e-3, None)]
    assert layer_onset(rows, 4) == (2, "change-point")
    calibrated = [(0, 0.0, False), (1, 1e-9, True), (2, 1e-7, True)]
    assert layer_onset(calibrated, 2) == (1, "calibrated")
    assert layer_onset([(5, 1e-3, None)], 5) == (5, "threshold")


def test_amplification_marks_the_layer_that_introduces_error():
    # error grows 2x per layer, but layer 3 multiplies it by 1000: that is where it is introduced
    rel = {0: 1e-10, 1: 2e-10, 2: 4e-10, 3: 8e-10, 4: 8e-7, 5: 1.6e-6, 6: 3.2e-6}
    amp = amplification([(k, "self_attn.input", v) for k, v in rel.items()])
    assert [a.layer for a in amp] == [0, 1, 2, 3, 4, 5]
    assert [a.layer for a in amp if a.introduced] == [3]
    assert amp[3].ratio == pytest.approx(1000.0) and amp[0].ratio == pytest.approx(2.0)


def test_amplification_of_exact_zeros_and_gaps():
    amp = amplification([(0, "p", 0.0), (1, "p", 0.0), (2, "p", 1e-6), (4, "p", 1e-5)])
    by = {a.layer: a for a in amp}
    assert by[0].ratio is None and not by[0].introduced  # nothing in, nothing out
    assert math.isinf(by[1].ratio) and by[1].introduced  # exact before, different after
    assert 2 not in by  # layer 3 was not captured: no ratio across the gap


def test_calibrated_noise_keeps_benign_growth_from_reading_as_introduced():
    values = [(0, "p", 0.0), (1, "p", 1e-5), (2, "p", 2e-5), (3, "p", 4e-5)]
    assert [a.layer for a in amplification(values) if a.introduced] == [0]  # 0 -> noise: inf
    within = {(k, "p"): False for k in range(4)}
    assert not any(a.introduced for a in amplification(values, departs=within))
    assert [a.layer for a in amplification(values, departs={**within, (1, "p"): True}) if a.introduced] == [0]


def test_amplification_round_trips_through_json():
    amp = amplification([(0, "p", 0.0), (1, "p", 0.0), (2, "p", 1e-6), (3, "p", 2e-6)])
    from comparator.hidden.onset import Amplification

    assert [Amplification.from_json(a.to_json()) for a in amp] == amp


def test_point_of_names():
    assert point_of("model.layers.3.self_attn.input") == "self_attn.input"
    assert point_of("model.layers.10.residual") == "residual"
    assert point_of("lm_head") == "lm_head"
