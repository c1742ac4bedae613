"""Noise measured per phase: calibrating on decode dumps keeps prompt rows and decode rows apart.

Real runs on the tiny HF Llama (fp32, eager): a decode dump (``--new-tokens``), its ``--tokens-from``
prefill counterpart, and the decode-only bug of :mod:`tests.dumper.jobs.test_decode` (layer 1's
output at position 45 in one-token passes). The per-row rule itself is checked on chosen noise values.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from comparator import CompareConfig, compare_dumps
from comparator.judging.noise import PhaseNoise, TensorNoise
from comparator.judging.noise_thresholds import DEFAULT_FACTOR, noise_limits
from comparator.noise.file import load_noise, save_noise
from dumper.format.decode import DECODE, PREFILL
from dumper.prefill.run import dump_sequences, run_dump
from tests.conftest import run_cli, tiny_llama
from tests.dumper.jobs.test_decode import BUG_AT, BUG_LAYER, PROMPTS, _counterpart, _decode, _decode_bug

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """decode, its prefill counterpart, a second prefill (batches of 2), the decode with the bug, and the noise of
    the counterpart against the decode (per phase)."""
    root = tmp_path_factory.mktemp("decode-noise")
    run_dump(_decode(root / "decode"))
    run_dump(_counterpart(root / "decode", root / "prefill"))
    run_dump(_counterpart(root / "decode", root / "prefill-b2", batch_size=2))
    model, _ = tiny_llama()
    handle = model.model.layers[BUG_LAYER].register_forward_hook(_decode_bug, with_kwargs=True)
    try:
        dump_sequences(model, [list(p) for p in PROMPTS], _decode(root / "buggy"))
    finally:
        handle.remove()
    r = run_cli("comparator", "calibrate", root / "prefill", root / "decode", "--out", root / "noise.json", "--quiet")
    assert r.returncode == 0, r.stderr
    return root


def test_calibrating_on_decode_dumps_measures_prompt_and_decode_rows_apart(dumps):
    noise = load_noise(dumps / "noise.json")
    assert len(noise.tensors) == 8
    prompt_rows = sum(len(p) for p in PROMPTS)
    decode_rows = len(PROMPTS) * (12 - 1)
    for t in noise.tensors.values():
        assert set(t.phases) == {PREFILL, DECODE}, t.name
        p, d = t.phases[PREFILL], t.phases[DECODE]
        assert (p.positions, d.positions) == (prompt_rows, decode_rows)
        assert t.positions == p.positions + d.positions
        assert t.token_max == max(p.token_max, d.token_max)
        assert p.token_p99 <= p.token_p999 <= p.token_max and d.token_p99 <= d.token_p999 <= d.token_max
    assert any(t.phases[DECODE].token_max > 0 for t in noise.tensors.values())  # decode rows carry rounding
    assert load_noise(dumps / "noise.json") == noise  # round trip
    r = run_cli(
        "comparator",
        "calibrate",
        dumps / "prefill",
        dumps / "decode",
        "--out",
        dumps / "again.json",
        env={"COLUMNS": "250"},
    )
    assert r.returncode == 0 and "prompt token max" in r.stdout and "decode token max" in r.stdout, r.stdout


def test_each_row_is_judged_by_its_phase_noise(dumps):
    r = run_cli(
        "comparator",
        dumps / "prefill",
        dumps / "decode",
        "--noise",
        dumps / "noise.json",
        "--noise-floor",
        "0",
        "--json",
        dumps / "v.json",
        "--quiet",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    noise = load_noise(dumps / "noise.json")
    tensors = json.loads((dumps / "v.json").read_text())["tensors"]
    assert tensors
    for t in tensors:
        phases = noise.tensor(t["name"]).phases
        assert t["token_threshold"] == DEFAULT_FACTOR * phases[PREFILL].token_max
        assert t["decode_token_threshold"] == DEFAULT_FACTOR * phases[DECODE].token_max
    assert "calibrated without decode rows" not in r.stdout + r.stderr


def test_a_decode_only_bug_fails_its_phase_noise_at_its_layer_token_and_step(dumps):
    config = CompareConfig(noise=load_noise(dumps / "noise.json"))
    report = compare_dumps(dumps / "prefill", dumps / "buggy", config)
    fd = report.first_divergent
    assert not report.passed and fd is not None
    assert (fd.layer, fd.token, fd.phase, fd.decode_step) == (BUG_LAYER + 1, BUG_AT, DECODE, BUG_AT - len(PROMPTS[0]))
    assert compare_dumps(dumps / "prefill", dumps / "decode", config).passed


def test_noise_without_decode_rows_judges_decode_rows_with_a_warning(dumps, tmp_path):
    r = run_cli(
        "comparator", "calibrate", dumps / "prefill", dumps / "prefill-b2", "--out", tmp_path / "n.json", "--quiet"
    )
    assert r.returncode == 0, r.stderr
    assert all(not t.phases for t in load_noise(tmp_path / "n.json").tensors.values())
    report = compare_dumps(dumps / "prefill", dumps / "decode", CompareConfig(noise=load_noise(tmp_path / "n.json")))
    assert any("calibrated without decode rows" in w and "--new-tokens" in w for w in report.warnings)
    assert all(t.decode_token_threshold is None for t in report.tensors)


def test_the_per_row_threshold_follows_the_row_phase():
    noise = TensorNoise(
        name="t",
        layer=1,
        point="input",
        rel_diff=1e-6,
        token_max=1e-4,
        token_p999=1e-4,
        token_p99=1e-5,
        positions=8,
        phases={PREFILL: PhaseNoise(1e-8, 1e-8, 1e-9, 4), DECODE: PhaseNoise(1e-4, 1e-4, 1e-5, 4)},
    )
    lim = noise_limits(noise, 3.0, 1e-12, None)
    token = np.array([0.0, 2e-8, 5e-8, 0.0, 2e-4, 3e-5, 5e-4, 0.0])
    decode = np.arange(8) >= 4
    failing = np.flatnonzero(~(token <= lim.token_thresholds(decode)))
    assert failing.tolist() == [2, 6]  # 5e-8 > 3e-8 in the prompt; 5e-4 > 3e-4 in decode; 2e-4 passes there only
    assert lim.ratios(0.0, token, decode)[1] == pytest.approx(5.0)  # the prompt row, 5e-8 / 1e-8
    assert lim.ratios(0.0, np.where(np.arange(8) == 5, np.nan, token), decode)[1] == np.inf  # a NaN row: never noise
    assert lim.token_thresholds(None) == lim.token_threshold  # no decode rows known: the prompt rows' threshold
    fixed = noise_limits(noise, 3.0, 1e-12, (1e-3, 1e-4))  # explicit thresholds on top: the smaller wins
    assert (fixed.token_threshold, fixed.decode_token_threshold) == (3.0 * 1e-8, 1e-4)
    blind = noise_limits(TensorNoise(**{**noise.__dict__, "phases": {}}), 3.0, 1e-12, None)
    assert blind.decode_token_threshold is None and blind.token_threshold == pytest.approx(3e-4)


@pytest.mark.parametrize(
    "phases,words",
    [
        ({"verify": {}}, 'unknown keys "verify"'),
        ({"decode": {"token_max": 1e-9, "token_p999": 1e-9, "token_p99": 1e-9}}, "missing keys ['positions']"),
        ({"decode": {"token_max": 3.0, "token_p999": 1e-9, "token_p99": 1e-9, "positions": 2}}, "token_max"),
        ({"decode": {"token_max": 1e-9, "token_p999": 1e-9, "token_p99": 1e-9, "positions": -1}}, "positions"),
        ([], "phases: expected an object"),
    ],
)
def test_a_hostile_phases_entry_is_refused_in_one_line(dumps, tmp_path, phases, words):
    d = json.loads((dumps / "noise.json").read_text())
    d["tensors"][0]["phases"] = phases
    (tmp_path / "bad.json").write_text(json.dumps(d))
    r = run_cli("comparator", dumps / "prefill", dumps / "decode", "--noise", tmp_path / "bad.json")
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_noise_file_without_phases_still_reads(dumps, tmp_path):
    noise = load_noise(dumps / "noise.json")
    old = json.loads((dumps / "noise.json").read_text())
    del old["rows"]  # nor row noise, which came later still
    for t in old["tensors"]:
        del t["phases"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert all(not t.phases for t in load_noise(tmp_path / "old.json").tensors.values())
    save_noise(noise, tmp_path / "again.json")
    assert load_noise(tmp_path / "again.json") == noise
