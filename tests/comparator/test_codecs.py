"""Round trips of the result types that travel inside others: noise files, logprob thresholds,
located maxima and llama.cpp statistics, each read back from its own JSON text.

The objects come from a real calibration and a real logprob comparison of two tiny-llama dumps
(eager and SDPA attention), so the values are what users' files hold.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from comparator.judging.logprob_noise import LogprobNoise, MeanNoise
from comparator.judging.logprob_thresholds import LogprobThresholds
from comparator.judging.noise import NoiseModel, TensorNoise
from comparator.logprobs import Located, LogprobVerdict
from comparator.logprobs.judge import compare_logprob_sources
from comparator.logprobs.llama_stats import LlamaStats, llama_stats
from comparator.noise.calibrate import calibrate
from tests.conftest import run_cli


def _text(obj: object) -> object:
    """What a file holds: the object's JSON, written and parsed."""
    return json.loads(json.dumps(obj.to_json()))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("codecs")
    out = []
    for attn in ("eager", "sdpa"):
        path = root / attn
        r = run_cli(
            "dumper", "run", "--model", "tiny-llama", "--attn", attn, "--layers", "all", "--logprobs", "--out", path
        )
        assert r.returncode == 0, r.stderr
        out.append(str(path))
    return out[0], out[1]


@pytest.fixture(scope="module")
def noise(dumps: tuple[str, str]) -> NoiseModel:
    model = calibrate(dumps[0], [dumps[1]])
    assert model.tensors and model.logprobs is not None, "the calibration measured nothing"
    return model


@pytest.fixture(scope="module")
def verdict(dumps: tuple[str, str]) -> LogprobVerdict:
    return compare_logprob_sources(*dumps)


@pytest.mark.slow
def test_a_noise_file_reads_back_as_written(noise: NoiseModel) -> None:
    back = NoiseModel.from_json(_text(noise), "noise.json")
    assert noise.rows is not None and back.rows is None  # row noise lives in the side file (test_row_noise.py)
    assert back == dataclasses.replace(noise, rows=None)
    assert back.to_json() == noise.to_json()


@pytest.mark.slow
def test_each_part_of_a_noise_file_reads_back(noise: NoiseModel) -> None:
    for t in noise.tensors.values():
        assert TensorNoise.from_json(_text(t), "noise.json") == t
    lp = noise.logprobs
    assert lp is not None and LogprobNoise.from_json(_text(lp), "noise.json") == lp
    means = list(lp.means.values())
    assert means, "the logprob noise holds no mean-type metric"
    for m in means:
        assert MeanNoise.from_json(_text(m)) == m


@pytest.mark.slow
def test_logprob_thresholds_and_located_maxima_read_back(verdict: LogprobVerdict) -> None:
    t = verdict.thresholds
    assert LogprobThresholds.from_json(_text(t)).to_json() == t.to_json()
    located = [v for v in vars(verdict).values() if isinstance(v, Located)]
    assert any(loc.value is not None for loc in located), "no maximum was located"
    for loc in located:  # ``computed``: as the verdict reads them (kl_max is not computed without logits)
        assert Located.from_json(_text(loc), computed=loc.value is not None) == loc


@pytest.mark.slow
def test_llama_statistics_read_back_with_non_finite_values(verdict: LogprobVerdict) -> None:
    rng = np.random.default_rng(0)
    ref = -rng.exponential(2.0, 64)
    stats = llama_stats(ref, ref + rng.normal(0, 1e-3, 64))
    assert LlamaStats.from_json(_text(stats)) == stats
    broken = llama_stats(ref, np.where(np.arange(64) == 5, -np.inf, ref))
    back = LlamaStats.from_json(_text(broken))
    assert back is not None and back.to_json() == broken.to_json()
