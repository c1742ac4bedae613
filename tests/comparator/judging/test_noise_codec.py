"""``MetricNoise`` and ``MeanTest`` read back what they wrote, from real calibrated logprob verdicts.

tiny-llama (float32) is calibrated from one benign layout (SDPA attention); a second benign layout
(chunked prefill) and a run whose final norm outputs NaN at one row are judged against that noise.
The NaN run makes the ratios infinite (``null`` in JSON), which read back infinite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from comparator.judging.logprob_noise import Z_SIGNIFICANT, MeanTest, MetricNoise, NoiseCheck
from comparator.logprobs.judge import compare_logprob_sources
from comparator.noise.calibrate import calibrate
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.presets import load_model
from dumper.prefill.run import RunConfig, dump_sequences, prompt_token_ids, run_dump

SPEC = LogprobSpec(top_k=3, save_logits=True)
ROW = 20
PROMPT = ("Inference engines change daily; each change can shift numerics without an error. " * 2,)


def _cfg(out: Path, **kw: Any) -> RunConfig:
    return RunConfig(out=str(out), layers="first", logprobs=SPEC, prompts=PROMPT, **kw)


def _nan_run(out: Path) -> None:
    """tiny-llama whose final norm outputs NaN at row ``ROW`` (a broken kernel on one position)."""
    model, tok = load_model("tiny-llama")

    def hook(_mod: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[:, ROW] = math.nan  # [batch, seq, hidden]
        return output

    handle = model.model.norm.register_forward_hook(hook)
    try:
        cfg = _cfg(out)
        dump_sequences(model, prompt_token_ids(cfg, tok, model.config.vocab_size), cfg)
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NoiseCheck]:
    root = tmp_path_factory.mktemp("noise_codec")
    run_dump(_cfg(root / "base"))
    run_dump(_cfg(root / "sdpa", attn="sdpa"))
    run_dump(_cfg(root / "chunk", chunk_size=7))
    _nan_run(root / "nan")
    noise = calibrate(root / "base", [root / "sdpa"], threads=1)
    out: dict[str, NoiseCheck] = {}
    for name in ("chunk", "nan"):
        verdict = compare_logprob_sources(root / "base", root / name, noise=noise)
        assert verdict.noise is not None, "a calibrated verdict carries its noise check"
        out[name] = verdict.noise
    return out


def _wire(d: dict[str, Any]) -> dict[str, Any]:
    """Through standard JSON text and back (NaN or Inf would be refused here)."""
    return json.loads(json.dumps(d, allow_nan=False))


@pytest.mark.parametrize("which", ["chunk", "nan"])
def test_metric_noise_round_trips(checks: dict[str, NoiseCheck], which: str) -> None:
    check = checks[which]
    assert {"max_abs_err", "kl_max"} <= check.metrics.keys()
    for name, m in check.metrics.items():
        back = MetricNoise.from_json(_wire(m.to_json()))
        assert back == m and back.to_json() == m.to_json(), name


@pytest.mark.parametrize("which", ["chunk", "nan"])
def test_mean_test_round_trips(checks: dict[str, NoiseCheck], which: str) -> None:
    check = checks[which]
    assert check.means, "the calibration holds mean-type noise"
    for name, t in check.means.items():
        back = MeanTest.from_json(_wire(t.to_json()))
        assert back.to_json() == t.to_json(), name
        # a NaN mean or z is written as null and reads back as infinity, the value that never passes
        want = {k: math.inf if math.isnan(v) else v for k, v in vars(t).items() if isinstance(v, float)}
        assert {k: v for k, v in vars(back).items() if isinstance(v, float)} == want, name
        assert back.significant == t.significant and back.significant == (not back.z <= Z_SIGNIFICANT), name


def test_the_nan_run_has_infinite_ratios_that_read_back(checks: dict[str, NoiseCheck]) -> None:
    """The non-finite case is really exercised: the NaN row's max error is infinitely far above the noise."""
    ratio = checks["nan"].metrics["max_abs_err"]
    assert math.isinf(ratio.ratio) and ratio.to_json()["ratio"] is None
    assert MetricNoise.from_json(_wire(ratio.to_json())).ratio == math.inf
    assert all(math.isfinite(m.ratio) for m in checks["chunk"].metrics.values())


@pytest.mark.parametrize("which", ["chunk", "nan"])
def test_the_verdict_reads_its_noise_check_back(checks: dict[str, NoiseCheck], which: str) -> None:
    """NoiseCheck (the ``noise`` object of a logprob verdict) decodes its entries with the same two codecs."""
    check = checks[which]
    back = NoiseCheck.from_json(_wire(check.to_json()))
    assert back.metrics == check.metrics and back.to_json() == check.to_json()
    assert {k: t.to_json() for k, t in back.means.items()} == {k: t.to_json() for k, t in check.means.items()}
