"""``dumper replay --force-routing``: MoE layers replayed with the baseline's expert choice tell apart "a
different expert" from "the same expert, different math".

The numbers these tests rest on, measured once with plain hooks and then through the CLI (tiny Mixtral
fp32, 2 prompts x 40 tokens, expert 6's gate row of layer 1 moved by half its norm): plain replay, 11
tokens flip at layer 1 and layer 1's output (the residual at layer 2) has rel_diff up to 2.7e-2; with
the baseline's ids forced, 0 flips, combine weights off by up to 0.49 (the target's own router weights
them) and rel_diff up to 1.3e-2; with ids and weights forced, rel_diff exactly 0, while the router's
logits still differ (1.2e-2 and 1.5e-2): the gate computes differently, the experts do not.
"""

from __future__ import annotations

import json

import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.errors import UsageError
from dumper.hooks.routing import find_routers
from dumper.jobs.replay import ReplayConfig, replay, replay_model
from tests.conftest import run_cli
from tests.moe_models import FAMILIES, build_moe, moved_gate_checkpoints

PROMPTS = [torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
RESIDUAL_2 = "model.layers.2.residual"


def _ids_args() -> list[str]:
    return [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]


def _compare(root, name: str) -> tuple[int, dict]:
    r = run_cli("comparator", root / "base", root / name, "--json", root / f"{name}.json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads((root / f"{name}.json").read_text())


def _residual(report: dict, name: str = RESIDUAL_2) -> float:
    """The largest rel_diff over the sequences of one residual tensor."""
    return max(t["rel_diff"] for t in report["tensors"] if t["name"] == name)


def _flips(report: dict) -> dict[int, int]:
    return {la["layer"]: la["flips"] for la in report["router"]["layers"]}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral and its baseline dump; a checkpoint whose layer-1 gate row of expert 6 is moved; three replays."""
    root = tmp_path_factory.mktemp("force")
    moved_gate_checkpoints(root)
    r = run_cli(
        "dumper",
        "run",
        "--model",
        root / "ref",
        "--out",
        root / "base",
        "--points",
        "residual,router",
        "--layers",
        "all",
        "--quiet",
        *_ids_args(),
    )
    assert r.returncode == 0, r.stderr
    for mode in ("plain", "ids", "all"):
        force = [] if mode == "plain" else ["--force-routing", mode]
        r = run_cli(
            "dumper", "replay", "--model", root / "bug", "--baseline", root / "base", "--out", root / mode, *force
        )
        assert r.returncode == 0, r.stderr
        assert ("expert choice forced" in r.stdout) == (mode != "plain"), r.stdout
    return root


@pytest.mark.slow
def test_plain_replay_shows_the_flips_and_the_layers_output_error(mixtral):
    rc, report = _compare(mixtral, "plain")
    assert rc == 1 and report["router"]["first_flip"]["layer"] == 1
    assert _flips(report) == {0: 0, 1: 11, 2: 0}
    assert _residual(report) > 1e-2  # layer 1's own output error (2.7e-2)
    assert _residual(report, "model.layers.1.residual") == _residual(report, "model.norm.residual") == 0.0
    assert not any("forced" in n for n in report["notes"])


@pytest.mark.slow
def test_forcing_ids_leaves_only_the_targets_own_combine_weights(mixtral):
    _, plain = _compare(mixtral, "plain")
    rc, report = _compare(mixtral, "ids")
    layer1 = report["router"]["layers"][1]
    assert rc == 1 and _flips(report) == {0: 0, 1: 0, 2: 0}
    # the same experts, weighted by the moved gate row: up to 0.49 apart on layer 1, exact elsewhere
    assert layer1["weight_max_err"] > 0.3 and not layer1["passed"]
    assert [la["weight_max_err"] for la in report["router"]["layers"] if la["layer"] != 1] == [0.0, 0.0]
    assert 1e-3 < _residual(report) < _residual(plain)  # 1.3e-2 against 2.7e-2
    assert any("expert choices forced (ids; weights by the target's router)" in n for n in report["notes"])


@pytest.mark.slow
def test_forcing_ids_and_weights_makes_the_layers_output_exact(mixtral):
    rc, report = _compare(mixtral, "all")
    assert report["router"]["passed"] and _flips(report) == {0: 0, 1: 0, 2: 0}
    assert all(la["weight_max_err"] == 0.0 for la in report["router"]["layers"])
    assert _residual(report) == 0.0  # same experts, same weights: the experts' math is the baseline's
    # what still differs is the gate's own output, which the dump records as the target computed it
    failing = {t["name"] for t in report["tensors"] if not t["passed"]}
    assert rc == 1 and failing == {"model.layers.1.router.logits"}
    assert any("expert choices forced (ids and weights)" in n for n in report["notes"])


def test_a_selection_bug_passes_once_the_baselines_ids_are_forced(tmp_path):
    """DeepSeek-V3 without layer 1's score correction bias: other experts, the same logits and the same weight math."""
    model = build_moe("deepseek_v3")
    with torch.no_grad(), dumper.capture(model, tmp_path / "base", layers="all", points=("residual", "router")):
        for p in PROMPTS:
            model(torch.tensor([p]))
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    replay_model(model, tmp_path / "base", tmp_path / "plain")
    plain = compare_dumps(tmp_path / "base", tmp_path / "plain")
    layer1 = next(la for la in plain.router.layers if la.layer == 1)
    assert not plain.passed and layer1.flips == 20 and layer1.logits_rel_diff == 0.0  # of 80 tokens; same logits
    assert plain.first_divergent is not None and plain.first_divergent.layer == 2
    replay_model(model, tmp_path / "base", tmp_path / "ids", force_routing="ids")
    forced = compare_dumps(tmp_path / "base", tmp_path / "ids")
    assert forced.passed and forced.router.flips == 0  # the whole difference was the choice of experts
    assert max(t.metrics["rel_diff"] for t in forced.tensors) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forcing_the_baselines_own_choice_reproduces_its_forward(tmp_path, family, dtype):
    """Every family, both modes: forcing the choice the model made anyway changes no bit (weights included)."""
    model = build_moe(family, dtype=dtype)
    with torch.no_grad(), dumper.capture(model, tmp_path / "base", layers="all", points=("residual", "router")):
        model(torch.tensor([PROMPTS[0][:24]]))
    for mode in ("ids", "all"):
        m = replay_model(model, tmp_path / "base", tmp_path / mode, force_routing=mode)
        assert m.extra["replay"]["force_routing"] == mode and "router" in m.capture_signature["points"]
        report = compare_dumps(tmp_path / "base", tmp_path / mode)
        assert report.passed and report.router is not None and report.router.flips == 0, (family, mode)
        assert len(report.router.layers) == sum(bool(find_routers(layer)) for layer in model.model.layers)
        assert max(t.metrics["rel_diff"] for t in report.tensors) == 0.0, (family, mode)


@pytest.mark.slow
def test_forcing_needs_the_router_point_in_the_baseline(mixtral, tmp_path):
    r = run_cli(
        "dumper",
        "run",
        "--model",
        mixtral / "ref",
        "--out",
        tmp_path / "base",
        "--points",
        "residual",
        "--layers",
        "all",
        "--quiet",
        *_ids_args(),
    )
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "dumper",
        "replay",
        "--model",
        mixtral / "bug",
        "--baseline",
        tmp_path / "base",
        "--out",
        tmp_path / "o",
        "--force-routing",
        "ids",
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(tmp_path / "base") in r.stderr and "--points residual,router" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_forcing_refuses_a_dense_model(mixtral, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    mixtral_config = build_moe("mixtral").config  # the same shapes without experts: layers and hidden size match
    dense = MistralConfig(
        **{
            k: getattr(mixtral_config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            )
        }
    )
    MistralForCausalLM(dense).save_pretrained(tmp_path / "dense")
    r = run_cli(
        "dumper",
        "replay",
        "--model",
        tmp_path / "dense",
        "--baseline",
        mixtral / "base",
        "--out",
        tmp_path / "o",
        "--force-routing",
        "all",
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "MistralForCausalLM has no MoE router" in r.stderr and "--force-routing all" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_an_unknown_force_mode_is_refused_before_the_model_loads(mixtral, tmp_path):
    with pytest.raises(UsageError, match="force_routing 'weights': expected one of ids, all"):
        replay(
            ReplayConfig(
                model="no/such/model", baseline=str(mixtral / "base"), out=str(tmp_path / "o"), force_routing="weights"
            )
        )
