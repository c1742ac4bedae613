"""Calibrated verdicts on a real tiny Llama: the held-out cases fixed thresholds get wrong.

Each case builds a baseline and benign variants through the hook API, calibrates with
``python -m comparator calibrate`` and judges a target with ``--noise`` (subprocess CLIs), next
to the same target judged by the fixed thresholds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.judging.noise_thresholds import DEFAULT_FACTOR
from comparator.noise.file import load_noise
from comparator.reports.files import json_text
from tests.conftest import prompt_ids, run_cli, tiny_llama

N_TOKENS = 256
CHUNKS = {"base": None, "chunked": (100,), "chunked-sdpa": (64, 128, 192)}


def _dump(model, ids, out, *, chunks=None):
    """One prefill of ``ids`` (or chunked prefill over one KV cache, cut at ``chunks``) captured at every layer."""
    with torch.inference_mode(), dumper.capture(model, out, layers="all"):
        if not chunks:
            model(input_ids=ids, use_cache=False)
        else:
            cache = DynamicCache()
            cuts = [0, *chunks, ids.shape[1]]
            for a, b in zip(cuts, cuts[1:], strict=False):
                model(
                    input_ids=ids[:, a:b],
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.arange(a, b)[None],
                    cache_position=torch.arange(a, b),
                )
    return out


def _benign(root, dtype):
    """Baseline (eager, one pass) and three benign variants: SDPA, chunked eager, chunked SDPA."""
    eager, tok = tiny_llama("eager", dtype)
    sdpa, _ = tiny_llama("sdpa", dtype)
    ids = prompt_ids(tok, N_TOKENS)
    dumps = {
        "base": _dump(eager, ids, root / "base"),
        "sdpa": _dump(sdpa, ids, root / "sdpa"),
        "chunked": _dump(eager, ids, root / "chunked", chunks=CHUNKS["chunked"]),
        "chunked-sdpa": _dump(sdpa, ids, root / "chunked-sdpa", chunks=CHUNKS["chunked-sdpa"]),
    }
    noise = root / "noise.json"
    r = run_cli("comparator", "calibrate", dumps["base"], dumps["sdpa"], dumps["chunked"], "--out", noise, "--quiet")
    assert r.returncode == 0, r.stderr
    return dumps, noise, ids


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _benign(tmp_path_factory.mktemp("fp32"), "float32")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return _benign(tmp_path_factory.mktemp("bf16"), "bfloat16")


def _judge(base, target, *extra):
    r = run_cli("comparator", base, target, "--quiet", *extra, "--json", f"{target}.report.json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(open(f"{target}.report.json").read()), r.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_benign_layout_not_used_for_calibration_passes(fp32, bf16, dtype):
    dumps, noise, _ = fp32 if dtype == "float32" else bf16
    rc, report, out = _judge(dumps["base"], dumps["chunked-sdpa"], "--noise", noise)
    assert rc == 0, out
    assert report["noise"] == str(noise) and all(t["noise_ratio"] is not None for t in report["tensors"])
    model = load_noise(noise)
    assert len(model.variants) == 2 and len(model.tensors) == 8
    assert all(t.positions == 2 * N_TOKENS for t in model.tensors.values())
    if dtype == "bfloat16":  # real noise, well above the floor: the thresholds come from it
        deep = model.tensor("model.layers.7.self_attn.input")
        assert deep.token_max > 1e-6 and max(t["token_noise_ratio"] for t in report["tensors"]) > 0.01
    # layer 0 turns the exact embedding into noise (an infinite ratio in bf16): growth within the noise, not a bug
    assert not any(a["introduced"] for a in report["amplification"])


def test_fp32_weight_change_far_below_fixed_thresholds_fails_against_noise(fp32, tmp_path):
    dumps, noise, ids = fp32
    model, _ = tiny_llama()
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1 + 1e-3)
    bad = _dump(model, ids, tmp_path / "bad")
    rc, report, out = _judge(dumps["base"], bad)
    assert rc == 0, out  # the fixed 1e-3 thresholds pass it
    rc, report, out = _judge(dumps["base"], bad, "--noise", noise)
    assert rc == 1 and out.startswith("DIVERGED at layer 4"), out
    t4 = next(t for t in report["tensors"] if t["layer"] == 4)
    assert 1e-10 < t4["max_token_rel_diff"] < 1e-3 and t4["token_noise_ratio"] > 1e3
    assert (
        report["first_divergent"]["onset_layer"] == 4
        and report["first_divergent"]["onset_layer_method"] == "calibrated"
    )
    # each layer below the change is within its noise, and layer 3 is where error is introduced
    assert all(t["passed"] for t in report["tensors"] if t["layer"] < 4)
    assert [a["layer"] for a in report["amplification"] if a["introduced"]] == [3]


def _bump_after_layer(model, k, token, size, seed=1):
    """Add a random vector of relative size ``size`` to one token's hidden state after layer ``k``."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        row = hidden[0, token]
        noise = torch.randn(row.shape, generator=gen).to(row.dtype)
        row.add_(size * row.float().norm().to(row.dtype) / math.sqrt(row.numel()) * noise)
        return output

    return model.model.layers[k].register_forward_hook(hook)


def test_bf16_one_token_change_just_above_noise_fails_only_against_noise(bf16, tmp_path):
    dumps, noise, ids = bf16
    model_noise = load_noise(noise)
    token_noise = model_noise.tensor("model.layers.3.self_attn.input").token_max
    model, _ = tiny_llama("eager", "bfloat16")
    # rel_diff of a row x + d, |d| = s|x|: about s^2 / 2; aim at 5x the largest per-token noise
    handle = _bump_after_layer(model, 2, 57, math.sqrt(2 * 5 * token_noise))
    bad = _dump(model, ids, tmp_path / "bad")
    handle.remove()
    rc, report, out = _judge(dumps["base"], bad)
    assert rc == 0, out  # under 1e-3: the fixed thresholds pass it
    rc, report, out = _judge(dumps["base"], bad, "--noise", noise)
    assert rc == 1, out
    fd = report["first_divergent"]
    assert fd["layer"] == 3 and fd["token"] == 57 and fd["onset"] == 57
    t3 = next(t for t in report["tensors"] if t["layer"] == 3)
    # just above the noise: more than the default factor (3), a few times the noise, far under 1e-3
    assert t3["max_token_rel_diff"] < 1e-3 and DEFAULT_FACTOR < t3["token_noise_ratio"] < 20


def _rotary_from(model, start, eps):
    """Scale the rotary cos/sin from position ``start`` on by 1 + eps * (p - start + 1): wrong from ``start``."""

    def hook(module, args, output):
        cos, sin = output
        n = cos.shape[1]
        pos = torch.arange(n, dtype=torch.float32)
        scale = torch.where(pos >= start, 1 + eps * (pos - start + 1), torch.ones(n)).to(cos.dtype)[None, :, None]
        return cos * scale, sin * scale

    return model.model.rotary_emb.register_forward_hook(hook)


@pytest.mark.parametrize("eps", [0.1, 1e-3])
def test_rotary_change_from_position_p_names_p_as_onset(fp32, tmp_path, eps):
    dumps, noise, ids = fp32
    model, _ = tiny_llama()
    handle = _rotary_from(model, 128, eps)
    bad = _dump(model, ids, tmp_path / "bad")
    handle.remove()
    plain = compare_dumps(dumps["base"], bad)
    first = next(t for t in plain.tensors if t.layer == 1)
    assert first.max_token_rel_diff > 0 and (first.first_failing_token is None or first.first_failing_token > 128)
    if eps > 1e-2:  # strong: crosses 1e-3 later than it starts; the onset names where it starts
        fd = plain.first_divergent
        assert fd is not None and fd.token > 128 and fd.onset == 128 and fd.onset_method == "change-point"
        rc, report, out = _judge(dumps["base"], bad)
        assert rc == 1 and "divergence starts at token 128" in out and f"first failing token {fd.token}" in out
    else:  # mild: the fixed thresholds pass it altogether
        assert plain.passed
    rc, report, out = _judge(dumps["base"], bad, "--noise", noise)
    fd = report["first_divergent"]
    assert rc == 1 and fd["onset"] == 128 and fd["token"] == 128 and fd["onset_method"] == "calibrated", out
    assert fd["layer"] == 1 and fd["onset_layer"] == 1


def test_noise_file_errors_are_one_line(fp32, tmp_path):
    dumps, noise, _ = fp32
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    for path, word in ((bad, "not a driftscope noise file"), (tmp_path / "missing.json", "cannot open noise file")):
        r = run_cli("comparator", dumps["base"], dumps["sdpa"], "--noise", path)
        assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli("comparator", dumps["base"], dumps["sdpa"], "--noise-factor", "3")
    assert r.returncode == 2 and "need --noise" in r.stderr
    r = run_cli("comparator", dumps["base"], dumps["sdpa"], "--noise", noise, "--noise-factor", "0.5")
    assert r.returncode == 2 and "--noise-factor" in r.stderr


def test_noise_of_another_dtype_is_refused(fp32, bf16):
    r = run_cli("comparator", bf16[0]["base"], bf16[0]["sdpa"], "--noise", fp32[1])
    assert r.returncode == 2 and "float32" in r.stderr and "recalibrate" in r.stderr, r.stderr


def test_explicit_fixed_thresholds_still_apply_on_top(bf16):
    dumps, noise, _ = bf16
    rc, report, out = _judge(dumps["base"], dumps["chunked-sdpa"], "--noise", noise, "--token-threshold", "1e-9")
    assert rc == 1 and all(t["token_threshold"] <= 1e-9 for t in report["tensors"]), out
    lenient = compare_dumps(dumps["base"], dumps["chunked-sdpa"], CompareConfig(noise=load_noise(noise)))
    assert lenient.passed


def test_calibrate_from_engine_jsonl_judges_logprobs(tmp_path):
    """Engine JSONL sources give logprob noise only; a shift 1e4x that noise then fails."""
    import copy

    from tests.comparator.logprobs.test_engines import sglang_response, write_jsonl

    def shifted(eps):
        d = copy.deepcopy(sglang_response())
        for triple in d["meta_info"]["input_token_logprobs"]:
            if triple[0] is not None:
                triple[0] += eps
        return d

    base = write_jsonl(tmp_path / "base.jsonl", sglang_response())
    v1, v2 = write_jsonl(tmp_path / "v1.jsonl", shifted(1e-6)), write_jsonl(tmp_path / "v2.jsonl", shifted(-2e-6))
    r = run_cli("comparator", "calibrate", base, v1, v2, "--out", tmp_path / "n.json", "--quiet")
    assert r.returncode == 0 and "noise of logprobs" in r.stdout, r.stderr
    noise = load_noise(tmp_path / "n.json")
    assert (
        not noise.tensors
        and noise.logprobs.variants == 2
        and noise.logprobs.metrics["max_abs_err"] == pytest.approx(2e-6, rel=1e-3)
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", shifted(1e-2))
    r = run_cli("comparator", "logprobs", base, bad, "--noise", tmp_path / "n.json", "--quiet")
    assert r.returncode == 1 and "max_abs_err" in r.stdout, r.stdout
    assert run_cli("comparator", "logprobs", base, v1, "--noise", tmp_path / "n.json", "--quiet").returncode == 0
    missing = run_cli("comparator", "calibrate", base, tmp_path / "nope.jsonl", "--out", tmp_path / "m.json")
    assert missing.returncode == 2 and "nope.jsonl: no such dump or logprob file" in missing.stderr


def test_reports_with_and_without_noise_round_trip_through_json(fp32, tmp_path):
    """Ratios read back as written: None without a noise file, inf for a NaN mismatch judged against noise."""
    from comparator.hidden.types import Report

    dumps, noise, ids = fp32
    model, _ = tiny_llama()
    handle = model.model.layers[4].register_forward_hook(
        lambda mod, args, out: (
            out[0].__setitem__((0, 33, 7), float("nan"))
            if isinstance(out, tuple)
            else out.__setitem__((0, 33, 7), float("nan"))
        )
    )
    bad = _dump(model, ids, tmp_path / "nan")
    handle.remove()
    for config in (CompareConfig(), CompareConfig(noise=load_noise(noise))):
        report = compare_dumps(dumps["base"], bad, config)
        back = Report.from_json(json.loads(json_text(report)))
        assert back.tensors == report.tensors and back.first_divergent == report.first_divergent
        nan_layer = [t for t in back.tensors if t.layer == 5]
        if config.noise is None:
            assert all(t.noise_ratio is None and t.token_noise_ratio is None for t in back.tensors)
        else:
            assert all(math.isinf(t.token_noise_ratio) for t in nan_layer)
            assert all(t.noise_ratio == 0 for t in back.tensors if t.layer < 5)
