"""Routing comparison on real MoE dumps: benign layouts route alike, seeded router bugs are named where they are.

The models are tiny seeded transformers MoE models (:mod:`tests.moe_models`); the bugs live in the
model's own router at one layer, written without data-dependent Python branches (a constant row
index, tensor ops only), so torch.compile would trace them. Every seeded bug's truth is checked
first with plain forward hooks on the router, independently of driftscope.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dumper
from comparator import compare_dumps
from comparator.config import CompareConfig
from comparator.judging.noise import NoiseModel
from comparator.noise.calibrate import calibrate
from comparator.noise.file import save_noise
from comparator.routing.compare import _margins
from dumper.format import ROUTER_IDS, ROUTER_POINT, load_manifest
from tests.conftest import run_cli
from tests.moe_models import build_moe
from tests.routing_dumps import mixtral

SEQ = 48
"""Tokens of the one prompt every dump here runs (one sequence: a flat router row is its position)."""


def _ids() -> torch.Tensor:
    return torch.randint(3, 256, (1, SEQ), generator=torch.Generator().manual_seed(7))


def _router(model, layer: int):
    block = model.model.layers[layer].mlp
    return getattr(block, "gate", None) or block.router


def _routed(model) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each MoE layer's router output (logits, weights, ids) of one plain forward, by plain hooks."""
    out, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is not None and type(router).__name__.endswith(("TopKRouter", "TopkRouter")):
            handles.append(router.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, o)))
    try:
        with torch.inference_mode():
            model(input_ids=_ids())
    finally:
        for h in handles:
            h.remove()
    return out


def _dump(model, out, points=("input", "router")):
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points=points):
        model(input_ids=_ids())
    return out


def _seed_logit_bias(model, layer: int, token: int, expert: int, bias: float) -> None:
    """Add ``bias`` to expert ``expert``'s router logit of row ``token`` at ``layer`` (a pre-hook on the router).

    The router's input row moves by ``bias`` x the pseudo-inverse's column of that expert, so its
    logits move by ``bias`` at that expert only (the router is a linear map of full row rank).
    """
    router = _router(model, layer)
    w = router.weight.detach().double()
    delta = (torch.linalg.pinv(w)[:, expert] * bias).to(router.weight.dtype)

    def pre(module, args):
        x = args[0].reshape(-1, w.shape[1])
        bump = torch.zeros_like(x)
        bump[token] = delta
        return (x + bump,)

    router.register_forward_pre_hook(pre)


def _flip_site(model, layer: int) -> tuple[int, int, float]:
    """(token, expert, bias): the token of median margin at ``layer``, its best unchosen eligible expert, and the
    logit bias that lifts that expert well above its chosen ones (a flip far from any tie)."""
    logits, _, ids = _routed(model)[layer]
    scores = logits.double()
    router = _router(model, layer)
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: chosen by sigmoid + bias in its best groups
        scores = scores.sigmoid() + router.e_score_correction_bias.double()
    groups = (router.num_group, router.topk_group) if hasattr(router, "num_group") else None
    margins = _margins(scores.numpy(), ids.numpy(), groups)
    token = int(np.argsort(margins)[len(margins) // 2])
    unchosen = [e for e in torch.argsort(logits[token], descending=True).tolist() if e not in ids[token].tolist()]
    expert = unchosen[0]
    return token, expert, float(logits[token].max() - logits[token, expert]) + 8.0


def _first_hidden_failure(report) -> tuple[int, int]:
    """(layer, first failing token) of the lowest failing tensor that is not a router tensor."""
    failed = [t for t in report.tensors if not t.passed and not t.name.endswith(".router.logits")]
    low = min(t.layer for t in failed)
    return low, min(t.first_failing_token for t in failed if t.layer == low)


@pytest.fixture(scope="module")
def mixtral_dumps(tmp_path_factory):
    """fp32 and bf16 dumps of the Mixtral of :mod:`tests.routing_dumps`: weights at a trained model's scale
    (std 0.02), where bf16 moves router logits by a small fraction of the typical margin. (The routers
    of :func:`build_moe` are drawn ten times wider: there bf16 flips cascade through the layers.)"""
    root = tmp_path_factory.mktemp("routing")
    return {
        "eager": _dump(mixtral(), root / "eager"),
        "sdpa": _dump(mixtral(attn="sdpa"), root / "sdpa"),
        "bf16": _dump(mixtral(dtype=torch.bfloat16), root / "bf16"),
        "bf16_sdpa": _dump(mixtral(dtype=torch.bfloat16, attn="sdpa"), root / "bf16_sdpa"),
        "root": root,
    }


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_eager_vs_sdpa_in_fp32_routes_every_token_alike(family, tmp_path):
    a = _dump(build_moe(family), tmp_path / "eager")
    b = _dump(build_moe(family, attn="sdpa"), tmp_path / "sdpa")
    report = compare_dumps(a, b)
    r = report.router
    assert r is not None and r.passed and report.passed
    assert r.flips == 0 and r.first_flip is None
    moe = sorted({rec.layer for rec in load_manifest(a).tensors if rec.point == ROUTER_POINT})
    assert [la.layer for la in r.layers] == moe
    assert all(la.tokens == SEQ and la.weight_max_err <= la.weight_limit for la in r.layers)


@pytest.mark.parametrize(("family", "layer"), [("mixtral", 1), ("deepseek_v3", 1)])
def test_a_seeded_router_bias_fails_with_the_first_flip_at_its_layer_and_token(family, layer, tmp_path):
    token, expert, bias = _flip_site(build_moe(family), layer)
    buggy = build_moe(family)
    _seed_logit_bias(buggy, layer, token, expert, bias)
    # the truth, by plain hooks: exactly that token's expert set changes at that layer, and nowhere before
    clean_routes, bug_routes = _routed(build_moe(family)), _routed(buggy)
    for i in clean_routes:
        same = (clean_routes[i][2].sort(-1).values == bug_routes[i][2].sort(-1).values).all(-1)
        if i < layer:
            assert same.all()
        elif i == layer:
            assert torch.nonzero(~same).flatten().tolist() == [token]
            assert expert in bug_routes[i][2][token].tolist()
    a = _dump(build_moe(family), tmp_path / "clean")
    b = _dump(buggy, tmp_path / "bug")
    report = compare_dumps(a, b)
    r = report.router
    assert not report.passed and not r.passed
    f = r.first_failing_flip
    assert (f.layer, f.sequence, f.token) == (layer, 0, token) and r.first_flip == f
    assert expert in f.target_ids and expert not in f.baseline_ids and not f.benign and f.noise_ratio > 1
    assert f.margin > 0  # measured on the scores the router chose by (DeepSeek-V3: sigmoid + bias, grouped)
    at = next(la for la in r.layers if la.layer == layer)
    assert at.flips == 1 and not at.passed and r.first_failing_layer.layer == layer
    assert all(la.passed for la in r.layers if la.layer < layer)
    # the hidden states first diverge after that layer, at that token
    assert _first_hidden_failure(report) == (layer + 1, token)


def _seed_topk_before_softmax(model, layer: int) -> None:
    """Replace one Qwen2-MoE router's forward with top-k of the logits, then a softmax over those k.

    The reference (``norm_topk_prob=False``) takes the softmax over all experts first and keeps the
    top-k probabilities as they are: the same experts, weights that no longer sum below 1.
    """
    router = _router(model, layer)

    def forward(hidden_states):
        logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        top, idx = torch.topk(logits, router.top_k, dim=-1)
        return logits, torch.softmax(top.float(), dim=-1).to(logits.dtype), idx

    router.forward = forward


def test_topk_before_softmax_keeps_the_experts_and_fails_on_the_weights(tmp_path):
    clean = build_moe("qwen2_moe")
    assert clean.config.norm_topk_prob is False
    buggy = build_moe("qwen2_moe")
    _seed_topk_before_softmax(buggy, 0)
    c, b = _routed(clean)[0], _routed(buggy)[0]
    assert torch.equal(c[2], b[2]) and not torch.allclose(c[1], b[1])  # the truth: ids equal, weights not
    report = compare_dumps(_dump(clean, tmp_path / "a"), _dump(buggy, tmp_path / "b"))
    r = report.router
    first = r.layers[0]
    assert first.layer == 0 and first.flips == 0 and first.order_differences == 0
    assert first.weight_max_err > 100 * first.weight_limit and not first.weights_passed and not first.passed
    assert r.first_failing_layer.layer == 0 and not report.passed
    assert first.logits_rel_diff == 0  # the router's logits are the same: only its math after them differs


def test_fp32_vs_bf16_flips_are_near_ties_and_pass_once_calibrated(mixtral_dumps, tmp_path):
    d = mixtral_dumps
    noise = calibrate(d["eager"], [d["bf16"]])
    assert sorted(noise.router) == [0, 1, 2]
    assert all(n.score > 0 and n.tokens == SEQ for n in noise.router.values())
    save_noise(noise, tmp_path / "NOISE.json")
    again = NoiseModel.from_json(json.loads((tmp_path / "NOISE.json").read_text()), "NOISE.json")
    assert again.router == noise.router
    report = compare_dumps(d["eager"], d["bf16_sdpa"], CompareConfig(noise=again))
    r = report.router
    assert r.passed and r.basis == "calibrated"
    for f in (f for f in r.flips_shown):
        la = next(la for la in r.layers if la.layer == f.layer)
        assert f.benign and (f.after is not None or f.margin <= la.limit_ratio * la.unit)  # a near tie, or downstream
    # a real flip stays a failure under the same noise
    token, expert, bias = _flip_site(mixtral(), 1)
    buggy = mixtral()
    _seed_logit_bias(buggy, 1, token, expert, bias)
    bad = compare_dumps(d["eager"], _dump(buggy, tmp_path / "bug"), CompareConfig(noise=again)).router
    assert not bad.passed and (bad.first_failing_flip.layer, bad.first_failing_flip.token) == (1, token)
    assert bad.first_failing_flip.noise_ratio > bad.layers[1].limit_ratio


def _trained_scale(model):
    """``model`` with its router weights at a trained model's scale (std 0.02 instead of the test models' 0.2)."""
    with torch.no_grad():
        for i in range(len(model.model.layers)):
            block = model.model.layers[i].mlp
            router = getattr(block, "gate", None) or getattr(block, "router", None)
            if type(router).__name__.endswith(("TopKRouter", "TopkRouter")):
                router.weight.mul_(0.1)
    return model


def test_deepseek_fp32_vs_bf16_passes_calibrated_and_a_seeded_flip_still_fails(tmp_path):
    base = _dump(_trained_scale(build_moe("deepseek_v3")), tmp_path / "fp32")
    variant = _dump(_trained_scale(build_moe("deepseek_v3", dtype=torch.bfloat16)), tmp_path / "bf16")
    target = _dump(_trained_scale(build_moe("deepseek_v3", dtype=torch.bfloat16, attn="sdpa")), tmp_path / "sdpa")
    noise = calibrate(base, [variant])
    assert sorted(noise.router) == [1, 2]  # layer 0 is dense
    r = compare_dumps(base, target, CompareConfig(noise=noise)).router
    assert r.passed and r.basis == "calibrated", r.to_json()
    token, expert, bias = _flip_site(_trained_scale(build_moe("deepseek_v3")), 1)
    buggy = _trained_scale(build_moe("deepseek_v3"))
    _seed_logit_bias(buggy, 1, token, expert, bias)
    bad = compare_dumps(base, _dump(buggy, tmp_path / "bug"), CompareConfig(noise=noise)).router
    f = bad.first_failing_flip
    assert not bad.passed and (f.layer, f.token) == (1, token) and f.noise_ratio > bad.layers[0].limit_ratio


def test_nan_in_router_values_never_passes(tmp_path):
    clean = build_moe("mixtral")
    buggy = build_moe("mixtral")
    router = _router(buggy, 1)
    original = router.forward

    def forward(hidden_states):
        logits, weights, ids = original(hidden_states)
        poison = torch.zeros_like(logits)
        poison[5, 3] = float("nan")
        return logits + poison, weights, ids

    router.forward = forward
    report = compare_dumps(_dump(clean, tmp_path / "a"), _dump(buggy, tmp_path / "b", points=("router",)))
    r = report.router
    assert not r.passed and not report.passed
    assert r.layers[1].nonfinite == 1 and not r.layers[1].passed and r.layers[0].passed


def test_the_report_json_carries_the_router_contract(mixtral_dumps, tmp_path):
    token, expert, bias = _flip_site(mixtral(), 1)
    buggy = mixtral()
    _seed_logit_bias(buggy, 1, token, expert, bias)
    bug = _dump(buggy, tmp_path / "bug")
    proc = run_cli("comparator", mixtral_dumps["eager"], bug, "--json", tmp_path / "r.json")
    assert proc.returncode == 1, proc.stderr
    router = json.loads((tmp_path / "r.json").read_text())["router"]
    assert router["passed"] is False and router["flips"] >= 1
    ff = router["first_flip"]
    assert (ff["layer"], ff["token"], ff["sequence"]) == (1, token, 0)
    assert ff["margin"] > 0 and ff["noise_ratio"] > 1
    assert [row["layer"] for row in router["layers"]] == [0, 1, 2]
    assert {"flips", "flip_rate", "weight_max_err", "weight_mean_err", "logits_rel_diff", "passed"} <= set(
        router["layers"][1]
    )
    ok = run_cli("comparator", mixtral_dumps["eager"], mixtral_dumps["sdpa"], "--json", tmp_path / "ok.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((tmp_path / "ok.json").read_text())["router"]["flips"] == 0


def test_routing_recorded_without_its_ids_is_unusable(mixtral_dumps, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(mixtral_dumps["sdpa"], broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["tensors"] = [t for t in manifest["tensors"] if not t["name"].endswith("1." + ROUTER_IDS)]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    proc = run_cli("comparator", mixtral_dumps["eager"], broken)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "layer 1 records routing without router.ids" in lines[0] and str(broken) in lines[0]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"layer": 0, "score": 1e-3, "flip_rate": 1.5, "weight": 0.0, "tokens": 10}, "flip_rate"),
        ({"layer": 0, "score": float("nan"), "flip_rate": 0.0, "weight": 0.0, "tokens": 10}, "score"),
        ({"layer": "0", "score": 1e-3, "flip_rate": 0.0, "weight": 0.0, "tokens": 10}, "layer"),
        ({"layer": 0, "score": 1e-3, "flip_rate": 0.0, "weight": 0.0}, "tokens"),
    ],
)
def test_a_hostile_router_noise_entry_is_refused_in_one_line(mixtral_dumps, tmp_path, entry, says):
    noise = calibrate(mixtral_dumps["eager"], [mixtral_dumps["sdpa"]])
    d = noise.to_json()
    d["router"] = [entry]
    path = tmp_path / "NOISE.json"
    path.write_text(json.dumps(d, allow_nan=True))
    proc = run_cli("comparator", mixtral_dumps["eager"], mixtral_dumps["sdpa"], "--noise", path)
    assert proc.returncode == 2, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and says in lines[0] and "Traceback" not in proc.stderr


def test_margins_of_a_grouped_topk_take_the_group_choice_into_account():
    # two groups of two experts, one kept: group 0 (0.9 + 0.1 = 1.0) beats group 1 (0.8 + 0.15 = 0.95)
    scores = np.array([[0.9, 0.1, 0.8, 0.15]])
    chosen = np.array([[0, 1]])
    assert _margins(scores, chosen, None)[0] < 0  # as a plain top-k, expert 2 would have been chosen
    assert math.isclose(_margins(scores, chosen, (2, 1))[0], 1.0 - 0.95)  # the group margin is what decides


def test_cli_calibrate_records_routing_noise_and_the_verdict_uses_it(mixtral_dumps, tmp_path):
    d, noise = mixtral_dumps, tmp_path / "NOISE.json"
    cal = run_cli("comparator", "calibrate", d["eager"], d["bf16"], "--out", noise, "--quiet")
    assert cal.returncode == 0, cal.stderr
    assert "the routing of 3 MoE layers" in cal.stdout
    assert [e["layer"] for e in json.loads(noise.read_text())["router"]] == [0, 1, 2]
    judged = run_cli("comparator", d["eager"], d["bf16_sdpa"], "--noise", noise, "--json", tmp_path / "r.json")
    assert judged.returncode == 0, judged.stdout + judged.stderr
    assert json.loads((tmp_path / "r.json").read_text())["router"]["basis"] == "calibrated"


def test_routing_noise_that_excuses_a_real_flip_is_warned_about_and_said(tmp_path):
    """A seeded flip fails against honest routing noise; a NOISE.json whose score noise is 1e9 lets it pass, but
    never silently: a warning names the layer and the verdict says routing noise decided."""
    token, expert, bias = _flip_site(build_moe("mixtral"), 1)
    buggy = build_moe("mixtral")
    _seed_logit_bias(buggy, 1, token, expert, bias)
    clean, bug = _dump(build_moe("mixtral"), tmp_path / "clean"), _dump(buggy, tmp_path / "bug")
    d = calibrate(clean, [_dump(build_moe("mixtral", attn="sdpa"), tmp_path / "sdpa")]).to_json()
    honest, loose = tmp_path / "honest.json", tmp_path / "loose.json"
    honest.write_text(json.dumps(d))
    d["router"] = [{**e, "score": 1e9} for e in d["router"]]
    loose.write_text(json.dumps(d))
    judged = {}
    for name, path in (("honest", honest), ("loose", loose)):
        r = run_cli("comparator", clean, bug, "--noise", path, "--json", tmp_path / f"{name}.json", "--quiet")
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
        judged[name] = (json.loads((tmp_path / f"{name}.json").read_text())["router"], r.stderr)
    router, stderr = judged["honest"]
    assert not router["passed"] and router["first_failing_flip"]["token"] == token and not router["warnings"]
    assert "warning:" not in stderr
    router, stderr = judged["loose"]
    layer1 = next(la for la in router["layers"] if la["layer"] == 1)
    assert layer1["passed"] and layer1["flips"] == 1 and not layer1["failing_flips"]  # the flip is excused ...
    assert any(w.startswith("layer 1: routing noise excuses flips") for w in router["warnings"])  # ... not silently
    assert "warning:" in stderr and "layer 1: routing noise excuses flips" in stderr
    assert any(n.startswith("routing noise decided:") and "layers 1" in n for n in router["notes"]), router["notes"]
