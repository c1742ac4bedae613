"""The ``router`` capture point on transformers MoE models: gate logits, chosen experts and combine weights.

Every family of :mod:`tests.moe_models` runs once plainly (its router and MoE block outputs taken by
hand with plain forward hooks) and once under capture; the records must equal what the model
computed, the weights must rebuild the MoE block's real output from its experts, and the capture
must leave the model's logits bit for bit as they were.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dumper
from dumper.errors import UsageError
from dumper.format import (
    ROUTER_CHOICE_POINT,
    ROUTER_IDS,
    ROUTER_LOGITS,
    ROUTER_POINT,
    ROUTER_SCORES,
    ROUTER_WEIGHTS,
    DumpReader,
    load_manifest,
    router_name,
)
from dumper.prefill.forward import pad_batch
from tests.conftest import run_cli, tiny_llama
from tests.moe_models import FAMILIES, build_moe

TEXT = "Mixture-of-experts layers route every token to a few experts; engines may route differently. "


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _moe_layers(model) -> list[int]:
    """The decoder layers with a router, from the config (dense: Qwen's mlp_only_layers, DeepSeek's first k)."""
    cfg = model.config
    dense = set(getattr(cfg, "mlp_only_layers", None) or ()) | set(range(getattr(cfg, "first_k_dense_replace", 0)))
    return [i for i in range(cfg.num_hidden_layers) if i not in dense]


def _router_and_block(model, i: int):
    block = model.model.layers[i].mlp
    return getattr(block, "gate", None) or block.router, block


def _plain_run(model, **inputs):
    """(logits, {layer: router output}, {layer: (block input, block output)}) of one forward with plain hooks."""
    routed, blocks, handles = {}, {}, []
    for i in _moe_layers(model):
        router, block = _router_and_block(model, i)
        handles.append(router.register_forward_hook(lambda m, a, out, i=i: routed.__setitem__(i, out)))
        handles.append(block.register_forward_hook(lambda m, a, out, i=i: blocks.__setitem__(i, (a[0], out))))
    try:
        with torch.inference_mode():
            logits = model(**inputs).logits
    finally:
        for h in handles:
            h.remove()
    return logits, routed, blocks


def _records(out) -> tuple[DumpReader, dict]:
    reader = DumpReader(out)
    return reader, {(r.name, r.forward_pass): r for r in reader.manifest.tensors}


def _tensor(reader, rec) -> torch.Tensor:
    return torch.from_numpy(np.array(reader.array(rec)))


def _grouped_topk(scores: torch.Tensor, n_group: int, topk_group: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's selection: the k best scores within the topk_group groups whose two best scores sum highest."""
    groups = scores.view(scores.shape[0], n_group, -1)
    best = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros(scores.shape[0], n_group, dtype=torch.bool).scatter(1, best, True)
    return groups.masked_fill(~keep[..., None], float("-inf")).view(scores.shape[0], -1).topk(k, dim=-1).indices


def _expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on rows ``x``, from its stored weights."""
    if hasattr(experts, "gate_up_proj_bias"):  # GPT-OSS: [E, H, 2I] gate/up with biases, its own clamped SwiGLU
        h = experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
        return h @ experts.down_proj[e] + experts.down_proj_bias[e]
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def _rebuilt_block(block, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The MoE block's output rebuilt from the recorded choice: sum of weight x expert, plus any shared expert."""
    x = x.reshape(-1, x.shape[-1])
    ids, weights = ids.reshape(x.shape[0], -1), weights.reshape(x.shape[0], -1)
    y = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slots = torch.where(ids == e)
        y.index_add_(0, rows, weights[rows, slots, None].to(x.dtype) * _expert(block.experts, e, x[rows]))
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: not routed, gated by its own sigmoid
        y = y + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if hasattr(block, "shared_experts"):  # DeepSeek-V3
        y = y + block.shared_experts(x)
    return y


@pytest.mark.parametrize("family", FAMILIES)
def test_router_records_are_what_the_model_routed(family, tmp_path):
    model = build_moe(family)
    ids = _ids(13)
    plain, routed, blocks = _plain_run(model, input_ids=ids)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "d", layers="all", points=("input", "router")):
        captured = model(input_ids=ids).logits
    assert torch.equal(plain, captured)  # the capture changes nothing
    reader, recs = _records(tmp_path / "d")
    assert reader.manifest.capture_signature["points"] == ["input", ROUTER_POINT]
    k, cfg = model.config.num_experts_per_tok, model.config
    moe = _moe_layers(model)
    assert sorted({r.layer for r in reader.manifest.tensors if r.point == ROUTER_POINT}) == moe
    for i in range(cfg.num_hidden_layers):
        attn_in = recs[(f"model.layers.{i}.self_attn.input", 0)]
        parts = {
            p: recs.get((router_name(f"model.layers.{i}", p), 0))
            for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS, ROUTER_SCORES)
        }
        if i not in moe:
            assert set(parts.values()) == {None}, f"dense layer {i} got router records"
            continue
        got = {p: r for p, r in parts.items() if r is not None}
        assert set(got) == {ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS} | (
            {ROUTER_SCORES} if family == "deepseek_v3" else set()
        )
        logits, weights, chosen = (t.reshape(1, 13, -1) for t in routed[i])
        experts = logits.shape[-1]
        for p, r in got.items():
            assert r.layer == i and r.forward_pass == 0
            assert r.point == (ROUTER_POINT if p == ROUTER_LOGITS else ROUTER_CHOICE_POINT)
            assert r.positions == attn_in.positions and r.sequence_ids == attn_in.sequence_ids
            assert r.shape == (1, 13, experts if p in (ROUTER_LOGITS, ROUTER_SCORES) else k)
        assert got[ROUTER_LOGITS].dtype == "F32" and got[ROUTER_IDS].dtype == "I64"
        assert got[ROUTER_WEIGHTS].dtype == "F32"
        rec_logits, rec_ids, rec_w = (_tensor(reader, got[p]) for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS))
        assert torch.equal(rec_logits, logits) and torch.equal(rec_ids, chosen)
        assert torch.equal(rec_w, weights.float())
        flat_ids = rec_ids.reshape(13, k)
        if family == "deepseek_v3":
            scores = _tensor(reader, got[ROUTER_SCORES]).reshape(13, experts)
            picked = _grouped_topk(scores, cfg.n_group, cfg.topk_group, k)
            assert torch.equal(flat_ids.sort(-1).values, picked.sort(-1).values)
            # the biased, group-masked choice is not the logits' own top-k somewhere
            assert not torch.equal(flat_ids.sort(-1).values, rec_logits.reshape(13, -1).topk(k).indices.sort(-1).values)
        else:  # softmax (or GPT-OSS's plain) top-k: the logits' own top-k, in order
            assert torch.equal(flat_ids, rec_logits.reshape(13, -1).topk(k).indices)
        x, real = blocks[i]
        real = real[0] if isinstance(real, tuple) else real
        with torch.inference_mode():
            rebuilt = _rebuilt_block(_router_and_block(model, i)[1], x, rec_ids, rec_w)
        torch.testing.assert_close(rebuilt, real.reshape(13, -1))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_logits_keep_their_dtype_and_choices_are_stored_wide(family, tmp_path):
    model = build_moe(family, dtype=torch.bfloat16)
    ids = _ids(7)
    plain, routed, _ = _plain_run(model, input_ids=ids)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "d", layers="0", points="router"):
        captured = model(input_ids=ids).logits
    assert torch.equal(plain, captured)
    reader, recs = _records(tmp_path / "d")
    got = {p: recs[(router_name("model.layers.0", p), 0)] for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS)}
    assert {p: r.dtype for p, r in got.items()} == {ROUTER_LOGITS: "BF16", ROUTER_IDS: "I64", ROUTER_WEIGHTS: "F32"}
    logits, weights, chosen = routed[0]
    assert weights.dtype == (torch.float32 if family == "mixtral" else torch.bfloat16)  # as each model applies them
    assert torch.equal(_tensor(reader, got[ROUTER_WEIGHTS]).reshape(weights.shape), weights.float())
    assert torch.equal(_tensor(reader, got[ROUTER_IDS]).reshape(chosen.shape), chosen)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_keeps_each_rows_position_and_sequence(side, tmp_path):
    model = build_moe("mixtral")
    a, b = _ids(17, seed=1)[0].tolist(), _ids(9, seed=2)[0].tolist()
    ids, mask = pad_batch([a, b], side=side)
    plain, routed, _ = _plain_run(model, input_ids=ids, attention_mask=mask)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "d", layers="1,2", points="input,router"):
        captured = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(plain, captured)
    reader, recs = _records(tmp_path / "d")
    for i in (1, 2):
        attn_in = recs[(f"model.layers.{i}.self_attn.input", 0)]
        seqs = attn_in.row_sequence_ids()
        assert set(seqs[mask.reshape(-1).numpy() == 1].tolist()) == {0, 1}
        for part in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS):
            rec = recs[(router_name(f"model.layers.{i}", part), 0)]
            assert rec.positions == attn_in.positions and rec.sequence_ids == attn_in.sequence_ids
            assert rec.shape[:-1] == attn_in.shape[:-1]
        rec_ids = _tensor(reader, recs[(router_name(f"model.layers.{i}", ROUTER_IDS), 0)]).reshape(-1, 2)
        real = mask.reshape(-1) == 1
        assert torch.equal(rec_ids[real], routed[i][2][real])


def test_router_alone_records_only_moe_layers_of_the_selection(tmp_path):
    model = build_moe("deepseek_v3")
    with torch.inference_mode(), dumper.capture(model, tmp_path / "d", layers="0,2", points="router"):
        model(input_ids=_ids(5))
    m = load_manifest(tmp_path / "d")
    assert m.capture_signature["points"] == [ROUTER_POINT]
    assert {r.layer for r in m.tensors} == {2}
    assert {r.name for r in m.tensors} == {
        router_name("model.layers.2", p) for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS, ROUTER_SCORES)
    }


def test_router_on_a_model_or_layers_without_moe_is_refused(tmp_path):
    model, _ = tiny_llama()
    with pytest.raises(
        UsageError,
        match=r"^capture point 'router': LlamaForCausalLM has no MoE router driftscope "
        r"reads \(known: Mixtral, .*GPT-OSS\)$",
    ):
        dumper.capture(model, tmp_path / "a", points="input,router")
    with pytest.raises(
        UsageError,
        match=r"^capture point 'router': DeepseekV3ForCausalLM has no MoE layer among "
        r"layers \[0\]; ",
    ):
        dumper.capture(build_moe("deepseek_v3"), tmp_path / "b", layers="0", points="router")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_router_on_a_compiled_untapped_model_or_past_the_tap_is_refused(tmp_path):
    model = build_moe("mixtral")
    with pytest.raises(
        UsageError,
        match=r"^capture point 'router': the model runs compiled \(torch.compile\), where "
        r"module hooks do not run; tap it with the router point before it compiles",
    ):
        dumper.capture(torch.compile(model), tmp_path / "a", layers="all", points="input,router")
    dumper.tap(model, layers="all", max_tokens=64)  # the input point only
    with pytest.raises(UsageError, match=r"^model\.layers\.0\.router .*: not tapped"):
        dumper.capture(model, tmp_path / "b", layers="all", points="input,router")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "backend"), [("mixtral", "inductor"), ("deepseek_v3", "aot_eager"), ("gpt_oss", "aot_eager")]
)
def test_the_tap_records_the_router_of_a_compiled_model(family, backend, tmp_path):
    """``dumper.tap(points="input,router")`` before torch.compile: the compiled model records the routing an eager
    capture records (same records, the same experts), and its logits are bit for bit those of the same compiled
    model without the tap."""
    from comparator import compare_dumps

    ids = _ids(11)
    plain = torch.compile(build_moe(family), backend=backend)
    with torch.inference_mode():
        reference = plain(input_ids=ids).logits
    torch.compiler.reset()
    model = build_moe(family)
    with torch.inference_mode(), dumper.capture(model, tmp_path / "eager", layers="all", points="input,router"):
        model(input_ids=ids)
    dumper.tap(model, layers="all", points="input,router", max_tokens=32)
    compiled = torch.compile(model, backend=backend)
    for out in ("compiled", "again"):  # the second pass replays the compiled graph
        with torch.inference_mode(), dumper.capture(compiled, tmp_path / out, layers="all", points="input,router"):
            logits = compiled(input_ids=ids).logits
        assert torch.equal(logits, reference)
    torch.compiler.reset()
    eager, tapped = (load_manifest(tmp_path / d) for d in ("eager", "again"))
    assert sorted((r.name, r.shape, r.dtype, r.point, str(r.positions), str(r.meta)) for r in eager.tensors) == sorted(
        (r.name, r.shape, r.dtype, r.point, str(r.positions), str(r.meta)) for r in tapped.tensors
    )
    report = compare_dumps(tmp_path / "eager", tmp_path / "again")
    assert report.passed and report.router is not None and report.router.flips == 0
    assert [la.layer for la in report.router.layers] == _moe_layers(model)


def test_record_router_refuses_an_unknown_part(tmp_path):
    with dumper.capture(None, tmp_path / "d") as cap:
        cap.record_router("model.layers.0", 0, {ROUTER_IDS: torch.tensor([[1, 0]], dtype=torch.int32)})
        with pytest.raises(UsageError, match=r"record_router\('model.layers.0'\): unknown part 'router.gates'"):
            cap.record_router("model.layers.0", 0, {"router.gates": torch.zeros(1, 2)})
    (rec,) = load_manifest(tmp_path / "d").tensors
    assert (rec.name, rec.dtype, rec.point, rec.layer) == ("model.layers.0.router.ids", "I64", ROUTER_CHOICE_POINT, 0)


@pytest.mark.slow
def test_cli_run_on_the_tiny_mixtral_preset_writes_router_records(tmp_path):
    out = tmp_path / "d"
    proc = run_cli(
        "dumper",
        "run",
        "--model",
        "tiny-mixtral",
        "--points",
        "input,router",
        "--layers",
        "all",
        "--prompt",
        TEXT,
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    reader, recs = _records(out)
    m = reader.manifest
    assert m.capture_signature["points"] == ["input", ROUTER_POINT] and m.capture_signature["num_layers"] == 4
    for i in range(4):
        attn_in = recs[(f"model.layers.{i}.self_attn.input", 0)]
        logits = recs[(router_name(f"model.layers.{i}", ROUTER_LOGITS), 0)]
        ids = recs[(router_name(f"model.layers.{i}", ROUTER_IDS), 0)]
        weights = recs[(router_name(f"model.layers.{i}", ROUTER_WEIGHTS), 0)]
        assert logits.shape[-1] == 8 and ids.shape[-1] == weights.shape[-1] == 2
        assert logits.positions == ids.positions == weights.positions == attn_in.positions
        chosen = _tensor(reader, ids)
        assert torch.equal(chosen, _tensor(reader, logits).topk(2, dim=-1).indices)
        w = _tensor(reader, weights)
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))  # Mixtral renormalises its top-2


@pytest.mark.slow
def test_cli_compiled_run_records_the_router_and_matches_eager(tmp_path):
    args = (
        "run",
        "--model",
        "tiny-mixtral",
        "--points",
        "input,router",
        "--layers",
        "all",
        "--prompt",
        TEXT,
        "--logprobs",
    )
    eager = run_cli("dumper", *args, "--out", tmp_path / "eager")
    compiled = run_cli("dumper", *args, "--compile", "--observer-check", "--out", tmp_path / "compiled")
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr + compiled.stderr
    assert "observer check: bit-exact" in compiled.stdout + compiled.stderr
    m = load_manifest(tmp_path / "compiled")
    assert m.capture_signature["points"] == ["input", ROUTER_POINT] and m.extra.get("compiled") is True
    assert {r.layer for r in m.tensors if r.point == ROUTER_POINT} == {0, 1, 2, 3}
    verdict = run_cli("comparator", tmp_path / "eager", tmp_path / "compiled", "--json", tmp_path / "r.json")
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    import json

    router = json.loads((tmp_path / "r.json").read_text())["router"]
    assert router["passed"] and [la["layer"] for la in router["layers"]] == [0, 1, 2, 3]
