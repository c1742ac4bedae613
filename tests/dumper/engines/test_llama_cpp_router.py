"""llama.cpp's MoE routing (``--points router``): a tiny Mixtral converted to f32 GGUF, dumped by llama.cpp.

The records come from the tensors llama.cpp's ``build_moe_ffn`` names (``ffn_moe_logits``,
``ffn_moe_topk``, ``ffn_moe_weights_norm`` for Mixtral), copied by the eval callback. They are
checked against themselves (ids = top-k of the logits, weights = the renormalised softmax at the
ids), against a run without the callback (logits bit for bit), against a chunked batched run,
and against HF fp32's own router (``mlp.gate``) on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dumper.engines import run_engine
from dumper.engines.llama_cpp_ggml import GGML_NODES, GGML_TYPE, GgufSession
from dumper.format import (
    ROUTER_CHOICE_POINT,
    ROUTER_IDS,
    ROUTER_LOGITS,
    ROUTER_POINT,
    ROUTER_WEIGHTS,
    DumpReader,
    load_manifest,
)
from dumper.prefill.run import RunConfig
from tests.conftest import run_cli
from tests.dumper.engines.test_engine_llama_cpp import need
from tests.engine_models import MOE_CONFIG, build_checkpoint, build_moe_checkpoint, to_gguf

LAYERS = [0, 1, 2, 3]
E, K = MOE_CONFIG["num_local_experts"], MOE_CONFIG["num_experts_per_tok"]
PARTS = {
    ROUTER_LOGITS: (ROUTER_POINT, "F32", E),
    ROUTER_IDS: (ROUTER_CHOICE_POINT, "I64", K),
    ROUTER_WEIGHTS: (ROUTER_CHOICE_POINT, "F32", K),
}
"""Routing part -> (capture point, stored dtype, last dim) the contract gives it."""


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mixtral checkpoint, its f32 GGUF, and a llama.cpp dump of it (input and router, all layers)."""
    need("llama.cpp")
    root = tmp_path_factory.mktemp("llama_cpp_router")
    ckpt = build_moe_checkpoint(root / "ckpt")
    paths = {"root": root, "ckpt": ckpt, "gguf": to_gguf(ckpt, root / "moe-f32.gguf", "f32"), "dump": root / "ll"}
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "llama.cpp",
        "--model",
        paths["gguf"],
        "--engine-arg",
        f"hf_dir={ckpt}",
        "--layers",
        "all",
        "--points",
        "input,router",
        "--out",
        paths["dump"],
    )
    assert r.returncode == 0, r.stderr
    return paths


def routing(dump: Path) -> dict[tuple[int, str], tuple[np.ndarray, torch.Tensor]]:
    """``(layer, part)`` -> (the (sequence, position) of each row, the rows), rows sorted by sequence then position."""
    reader = DumpReader(dump)
    rows: dict[tuple[int, str], list[tuple[int, int, np.ndarray]]] = {}
    for rec in reader.manifest.tensors:
        if rec.point in (ROUTER_POINT, ROUTER_CHOICE_POINT):
            part = rec.name.removeprefix(f"model.layers.{rec.layer}.")
            rows.setdefault((rec.layer, part), []).extend(
                zip(rec.row_sequence_ids(), rec.row_positions(), np.array(reader.rows(rec)), strict=True)
            )
    out = {}
    for key, got in rows.items():
        got.sort(key=lambda r: (r[0], r[1]))
        out[key] = (np.array([(s, p) for s, p, _ in got]), torch.from_numpy(np.stack([a for *_, a in got])))
    return out


def hf_router(ckpt: Path, seqs: list[list[int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF fp32's router per layer on ``seqs`` (one at a time): (logits [n, E], weights [n, k], ids [n, k])."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    got: dict[int, list[tuple[torch.Tensor, ...]]] = {i: [] for i in LAYERS}
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(
            lambda _m, _a, out, i=i: got[i].append(tuple(t.detach().to("cpu") for t in out))
        )
        for i in LAYERS
    ]
    try:
        with torch.inference_mode():
            for ids in seqs:
                model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return {
        i: tuple(torch.cat([o[j] for o in outs]) for j in range(3))  # type: ignore[misc]
        for i, outs in got.items()
    }


def job_ids(dump: Path) -> list[list[int]]:
    return json.loads((dump / "manifest.json").read_text())["extra"]["input_ids"]


@pytest.mark.engine
def test_router_records_follow_the_contract(moe: dict[str, Path]) -> None:
    manifest = load_manifest(moe["dump"])
    routed = [r for r in manifest.tensors if r.point in (ROUTER_POINT, ROUTER_CHOICE_POINT)]
    inputs = {(r.forward_pass, r.layer): r for r in manifest.tensors if r.point == "input"}
    assert sorted({r.layer for r in routed}) == LAYERS
    for rec in routed:
        part = rec.name.removeprefix(f"model.layers.{rec.layer}.")
        point, dtype, width = PARTS[part]
        twin = inputs[(rec.forward_pass, rec.layer)]  # same rows as the layer's input record of the pass
        assert (rec.point, rec.dtype, rec.shape) == (point, dtype, (twin.shape[0], width)), rec.name
        assert (rec.positions, rec.sequence_ids) == (twin.positions, twin.sequence_ids)
    tokens = sum(map(len, job_ids(moe["dump"])))
    per_token_layer = sum(r.nbytes for r in routed) / (tokens * len(LAYERS))
    assert per_token_layer == 4 * E + 8 * K + 4 * K  # f32 logits, int64 ids, f32 weights
    print(f"router point: {per_token_layer:.0f} bytes per token per layer (E={E}, k={K})")


@pytest.mark.engine
def test_ids_are_the_top_k_and_weights_the_renormalised_softmax(moe: dict[str, Path]) -> None:
    r = routing(moe["dump"])
    for layer in LAYERS:
        logits, ids, weights = (r[(layer, p)][1] for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS))
        probs = torch.softmax(logits.double(), dim=-1)
        top = torch.topk(probs, K + 1, dim=-1)
        differ = (ids != top.indices[:, :K]).any(dim=-1)
        tie = torch.isclose(top.values[:, :-1], top.values[:, 1:], rtol=1e-6, atol=0).any(dim=-1)
        assert not (differ & ~tie).any(), f"layer {layer}: ids are not the top-{K} of the logits"
        expect = probs.gather(-1, ids)
        torch.testing.assert_close(weights.double(), expect / expect.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


@pytest.mark.engine
def test_capture_leaves_the_logits_bit_identical(moe: dict[str, Path]) -> None:
    ids = job_ids(moe["dump"])[0]
    logits = []
    for capture in (False, True):
        with GgufSession.open(str(moe["gguf"])) as s:
            s.new_context(
                n_ctx=len(ids),
                n_batch=len(ids),
                n_seqs=1,
                threads=torch.get_num_threads(),
                kv_type=GGML_TYPE["f32"],
                flash_attn=0,
                capture=capture,
            )
            want = {(p, layer) for p in GGML_NODES for layer in LAYERS} if capture else set()  # every point
            got = s.decode(ids, range(len(ids)), [0] * len(ids), want=want, router=set(LAYERS) if capture else set())
            assert sorted(got.router) == (LAYERS if capture else [])
            logits.append(got.logits)
    assert torch.equal(logits[0], logits[1])


@pytest.mark.engine
def test_expert_choices_agree_with_hf_fp32_except_near_ties(moe: dict[str, Path]) -> None:
    r = routing(moe["dump"])
    hf = hf_router(moe["ckpt"], job_ids(moe["dump"]))
    flips, margins = 0, []
    for layer in LAYERS:
        logits, ids, weights = (r[(layer, p)][1] for p in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS))
        hf_logits, hf_weights, hf_ids = hf[layer]
        assert logits.shape == hf_logits.shape
        err = (logits.double() - hf_logits.double()).abs().amax(-1)
        assert err.max() <= 1e-4 * hf_logits.abs().max()  # f32 all the way
        same = (ids.sort(-1).values == hf_ids.sort(-1).values).all(-1)
        hf_sorted = hf_logits.double().sort(-1, descending=True).values
        margin = hf_sorted[:, K - 1] - hf_sorted[:, K]  # how far HF's k-th expert is ahead of the next
        # a flip is only possible where the two engines' logits differ by at least half that margin
        assert (margin[~same] <= 2 * err[~same]).all(), f"layer {layer}: a flip away from any tie"
        flips, margins = flips + int((~same).sum()), margins + margin[~same].tolist()
        order = ids.argsort(-1), hf_ids.argsort(-1)
        torch.testing.assert_close(
            weights.gather(-1, order[0])[same], hf_weights.gather(-1, order[1])[same], rtol=1e-4, atol=1e-6
        )
    total = sum(map(len, job_ids(moe["dump"]))) * len(LAYERS)
    assert flips <= total // 100
    print(f"expert-set flips vs HF fp32: {flips} of {total} (smallest margin {min(margins, default=None)})")


@pytest.mark.engine
def test_chunked_batched_routing_matches_one_pass(moe: dict[str, Path]) -> None:
    out = moe["root"] / "chunked"
    run_engine(
        RunConfig(
            out=str(out),
            model=str(moe["gguf"]),
            layers="all",
            points=("input", ROUTER_POINT),
            chunk_size=16,
            batch_size=2,
            engine="llama.cpp",
            engine_args=(("hf_dir", str(moe["ckpt"])),),
        ),
        engine="llama.cpp",
    )
    assert len({t.forward_pass for t in load_manifest(out).tensors}) > 2  # several decodes through the KV cache
    one, chunked = routing(moe["dump"]), routing(out)
    assert one.keys() == chunked.keys()
    for key, (rows, x) in one.items():
        assert np.array_equal(rows, chunked[key][0]), key  # the same (sequence, position) of every row
        if key[1] == ROUTER_LOGITS:
            torch.testing.assert_close(chunked[key][1], x, rtol=1e-5, atol=1e-6)


@pytest.mark.engine
def test_router_on_a_dense_model_is_a_one_line_usage_error(moe: dict[str, Path]) -> None:
    dense = to_gguf(build_checkpoint(moe["root"] / "dense"), moe["root"] / "dense.gguf", "f32")
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "llama.cpp",
        "--model",
        dense,
        "--input-ids",
        "1,2,3",
        "--layers",
        "0,3",
        "--points",
        "input,router",
        "--out",
        moe["root"] / "never",
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{dense} has no MoE layer among layers 0,3" in lines[0] and "expert_count is 0" in lines[0]
    assert not (moe["root"] / "never").exists()
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "llama.cpp",
        "--model",
        moe["gguf"],
        "--input-ids",
        "1,2,3",
        "--points",
        "residual",
        "--out",
        moe["root"] / "never",
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "residual" in r.stderr, r.stderr


@pytest.mark.engine
def test_the_moe_blocks_output_matches_hf_s(moe: dict[str, Path], tmp_path: Path) -> None:
    """``mlp_output`` of an MoE layer reads ``ffn_moe_out`` (the block's output before the residual add, where no
    shared expert adds an ``ffn_out``): it matches HF's MoE block, as the other points inside the layer do."""
    from comparator import compare_dumps

    points = "input,attn_output,mlp_input,mlp_output"
    ids = ",".join(map(str, job_ids(moe["dump"])[0]))
    for engine, model, out in (("llama.cpp", moe["gguf"], "l"), ("transformers", moe["ckpt"], "h")):
        r = run_cli(
            "dumper",
            "run",
            "--engine",
            engine,
            "--model",
            model,
            "--layers",
            "all",
            "--points",
            points,
            "--input-ids",
            ids,
            *(["--engine-arg", f"hf_dir={moe['ckpt']}"] if out == "l" else []),
            "--out",
            tmp_path / out,
            "--quiet",
        )
        assert r.returncode == 0, r.stderr
    report = compare_dumps(tmp_path / "h", tmp_path / "l")
    assert report.passed and not report.unmatched_baseline and not report.unmatched_target
    assert {t.point for t in report.tensors} == set(points.split(","))
