"""The ``router`` point in vLLM: what its fused-MoE router chose, recorded where it chose it, judged against HF.

Real vLLM (CPU build) on the tiny Mixtral of :func:`tests.engine_models.build_moe_checkpoint` (4 MoE
layers, 8 experts, top-2), at one fixed path so that Inductor's cache is reused between runs. Every
vLLM job runs in one worker subprocess (:func:`_worker`), through driftscope's vLLM adapter
(:func:`dumper.engines.vllm.dump_llm`, vLLM's default multiprocess engine, the tap asked for in
``additional_config``): vLLM's default compiled mode (TP=1) with the observer check (the same
engine without the tap, its prompt logprobs compared bit for bit), and eager with TP=2 (the
router is replicated: each rank records it), and that eager TP=2 engine again with a routing bug
seeded on rank 1 alone (``tests/vllm_seed``: rank 1's MixtralMoE of layer :data:`BUG_LAYER` negates
its router logits at row :data:`BUG_TOKEN` of the step). HF fp32's own gate outputs, read by plain
forward hooks here, are the reference. The probe itself is also checked on a hand-built module (no vLLM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dumper.errors import UsageError
from dumper.format import ROUTER_CHOICE_POINT, ROUTER_IDS, ROUTER_LOGITS, ROUTER_POINT, ROUTER_WEIGHTS, load_manifest
from dumper.format.reader import DumpReader
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig
from tests.conftest import ROOT
from tests.dumper.engines.test_engine_vllm import (
    assert_worker_done,
    finish_worker,
    need,
    seeded,
    shared_checkpoint,
    worker_env,
)
from tests.engine_models import MOE_CONFIG, build_moe_checkpoint

N_LAYERS, N_EXPERTS, TOP_K = MOE_CONFIG["num_hidden_layers"], MOE_CONFIG["num_local_experts"], 2
_rng = np.random.default_rng(22)
PROMPTS = [[1] + _rng.integers(3, 300, n).tolist() for n in (47, 30, 12)]  # no shared prefix: no cache hits
JOBS = {"compiled": (), "eager-tp2": (("enforce_eager", "true"), ("tensor_parallel_size", "2"))}
"""Job name -> ``--engine-arg`` pairs: vLLM's default (compiled, TP=1) and eager over two TP ranks."""
POINTS = f"input,{ROUTER_POINT}"
BUG_LAYER, BUG_TOKEN = 1, 20
"""Where rank 1's seeded routing bug is: layer 1, row 20 of each engine step (prompt 0's token 20 among them)."""
BUG_SEED = {"layer": BUG_LAYER, "token": BUG_TOKEN, "where": "router", "rank": 1}


def shared_moe_checkpoint() -> Path:
    """The tiny Mixtral at one fixed path (Inductor's cache is reused between runs)."""
    return shared_checkpoint("moe", build_moe_checkpoint)


def _cfg(ckpt: Path, out: Path, engine_args: tuple) -> RunConfig:
    return RunConfig(
        out=str(out),
        model=str(ckpt),
        input_ids=tuple(map(tuple, PROMPTS)),
        layers="all",
        logprobs=LogprobSpec(top_k=5),
        engine="vllm",
        engine_args=engine_args,
        points=POINTS,
    )


def _worker(ckpt: str, out: str) -> None:
    """Every vLLM job, one engine each; writes ``out/results.json`` (seconds to load and to dump, per job)."""
    from dumper.engines.base import hf_identity
    from dumper.engines.vllm.engine import dump_llm, engine_kwargs, load_llm, observe_llm, release_llm
    from dumper.engines.vllm.tap import tap_config

    base, results = Path(out), {}
    for name, args in JOBS.items():
        cfg = _cfg(Path(ckpt), base / name, args)
        kw = engine_kwargs(cfg, Path(ckpt), PROMPTS)  # the tap in additional_config, the router point with it
        assert kw["additional_config"] == tap_config("all", POINTS)
        start = time.perf_counter()
        llm = load_llm(kw)
        loaded = time.perf_counter()
        dump_llm(llm, cfg, PROMPTS, Path(ckpt))
        results[name] = {"load_s": loaded - start, "dump_s": time.perf_counter() - loaded}
        del llm
        release_llm()
        if name == "compiled":  # the same engine without the tap: its logprobs against the dump's, bit for bit
            observe_llm(cfg, Path(ckpt), PROMPTS, vocab=int(hf_identity(Path(ckpt), cfg.model)["vocab_size"]))
            release_llm()
    cfg = _cfg(Path(ckpt), base / "bug-tp2", JOBS["eager-tp2"])  # the eager TP=2 engine, rank 1 seeded
    kw = engine_kwargs(cfg, Path(ckpt), PROMPTS)
    with seeded(BUG_SEED) as key:  # in the TP workers vLLM starts here
        llm = load_llm({**kw, "additional_config": {**kw["additional_config"], **key}})
    dump_llm(llm, cfg, PROMPTS, Path(ckpt))
    del llm
    release_llm()
    finish_worker(base, results)


def _hf_routing(ckpt: Path) -> dict[int, dict[str, np.ndarray]]:
    """Layer -> {logits, ids, weights} [rows, ...] of HF fp32's own gates, rows in (sequence, position) order."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    seen: dict[int, list] = {i: [] for i in range(N_LAYERS)}
    handles = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        for p in PROMPTS:
            model(torch.tensor([p]))
    for h in handles:
        h.remove()
    return {
        i: {name: torch.cat([o[j] for o in outs]).numpy() for j, name in enumerate(("logits", "weights", "ids"))}
        for i, outs in seen.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(job dirs root, worker results, HF routing): the worker and the HF reference side by side."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-router")
    ckpt = shared_moe_checkpoint()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from tests.dumper.engines.test_vllm_router import _worker; _worker({str(ckpt)!r}, {str(root)!r})",
        ],
        cwd=ROOT,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    hf = _hf_routing(ckpt)
    log, _ = worker.communicate(timeout=1500)
    assert_worker_done(worker.returncode, log, root)
    return root, json.loads((root / "results.json").read_text()), hf


def _routing(path: Path, rank: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Layer -> {part -> [rows, ...]} of one rank's router records, rows in (sequence, position) order, each once."""
    reader = DumpReader(path)
    rows: dict[tuple[int, str], dict] = {}
    for rec in reader.manifest.tensors:
        part = "router." + rec.name.rpartition(".router.")[2]  # ROUTER_LOGITS, ...
        if ".router." in rec.name and rec.rank == rank:
            for row, s, p in zip(reader.array(rec), rec.row_sequence_ids(), rec.row_positions(), strict=True):
                assert (s, p) not in rows.setdefault((rec.layer, part), {}), (rec.name, s, p)
                rows[(rec.layer, part)][(int(s), int(p))] = row
    want = [(s, p) for s, prompt in enumerate(PROMPTS) for p in range(len(prompt))]
    out: dict[int, dict[str, np.ndarray]] = {}
    for (layer, part), got in rows.items():
        assert sorted(got) == want, (layer, part)
        out.setdefault(layer, {})[part] = np.stack([got[k] for k in want])
    return out


@pytest.mark.engine
@pytest.mark.parametrize("job", list(JOBS))
def test_every_moe_layer_records_the_contract_s_parts(runs, job):
    m = load_manifest(runs[0] / job)
    router = [t for t in m.tensors if ".router." in t.name]
    kinds = {(t.name.split(".", 3)[3], t.point, t.dtype, t.shape[1:]) for t in router}
    assert kinds == {
        (ROUTER_LOGITS, ROUTER_POINT, "F32", (N_EXPERTS,)),
        (ROUTER_IDS, ROUTER_CHOICE_POINT, "I64", (TOP_K,)),
        (ROUTER_WEIGHTS, ROUTER_CHOICE_POINT, "F32", (TOP_K,)),
    }, kinds
    assert {(t.layer, t.name.rpartition(".router.")[0]) for t in router} == {
        (i, f"model.layers.{i}") for i in range(N_LAYERS)
    }
    assert m.extra["engine"]["settings"]["compiled"] is (job == "compiled")
    assert {t.rank for t in router} == set(range(2 if "tp2" in job else 1))
    assert sorted(_routing(runs[0] / job)) == list(range(N_LAYERS))  # each prompt position once per layer


@pytest.mark.engine
@pytest.mark.parametrize("job", list(JOBS))
def test_the_ids_are_the_top_k_of_the_logits_and_the_weights_their_renormalized_softmax(runs, job):
    """What vLLM's selection returned, recorded as is: its top-2 of the recorded logits, its weights the softmax
    over all experts renormalized over the two (vLLM computes it as a softmax over the two logits)."""
    for layer, parts in _routing(runs[0] / job).items():
        logits, ids, weights = (torch.from_numpy(parts[k]) for k in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS))
        top = torch.topk(logits, TOP_K, dim=-1)
        assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values), layer
        probs = torch.softmax(logits.double(), -1).gather(1, ids)
        expected = probs / probs.sum(-1, keepdim=True)
        assert torch.allclose(weights.double(), expected, rtol=0, atol=4 * torch.finfo(torch.float32).eps), layer


@pytest.mark.engine
def test_tensor_parallel_ranks_record_the_same_routing(runs):
    """The gate is replicated across TP ranks: every rank records the whole router, byte for byte the same."""
    ranks = [_routing(runs[0] / "eager-tp2", rank) for rank in (0, 1)]
    for layer in range(N_LAYERS):
        for part in (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS):
            assert ranks[0][layer][part].tobytes() == ranks[1][layer][part].tobytes(), (layer, part)


@pytest.mark.engine
def test_capturing_the_router_leaves_the_logprobs_bit_identical(runs):
    """The observer check: the compiled engine without the tap gives the dump's prompt logprobs bit for bit."""
    observer = load_manifest(runs[0] / "compiled").extra["observer"]
    assert observer["bit_exact"] is True and observer["values"] >= sum(len(p) - 1 for p in PROMPTS), observer


@pytest.mark.engine
@pytest.mark.parametrize("job", list(JOBS))
def test_the_experts_agree_with_hf_except_at_near_ties(runs, job):
    """vLLM's choice is HF's on every row but one whose HF margin (2nd minus 3rd logit) the logits' own difference
    could close; the weights differ by no more than that difference moves them."""
    _, results, hf = runs
    flips = 0
    for layer, parts in _routing(runs[0] / job).items():
        ref = hf[layer]
        delta = np.abs(parts[ROUTER_LOGITS] - ref["logits"]).max(-1)
        assert delta.max() < 1e-4 * np.abs(ref["logits"]).max(), layer  # the same fp32 gate, up to rounding
        ordered = np.sort(ref["logits"], -1)
        margin = ordered[:, -TOP_K] - ordered[:, -TOP_K - 1]
        same = (np.sort(parts[ROUTER_IDS], -1) == np.sort(ref["ids"], -1)).all(-1)
        assert (margin[~same] <= 2 * delta[~same]).all(), layer
        flips += int((~same).sum())
        hf_w = {tuple(i): w for i, w in zip(np.sort(ref["ids"], -1), ref["weights"])}  # by expert, slot order aside
        order, hf_order = np.argsort(parts[ROUTER_IDS], -1), np.argsort(ref["ids"], -1)
        got = np.take_along_axis(parts[ROUTER_WEIGHTS], order, -1)[same]
        want = np.take_along_axis(ref["weights"], hf_order, -1)[same]
        assert hf_w and (np.abs(got - want) <= delta[same, None] + 1e-6).all(), layer
    print(
        f"{job}: {flips} expert flips vs HF over {N_LAYERS * sum(map(len, PROMPTS))} rows; "
        f"load {results[job]['load_s']:.0f} s, dump {results[job]['dump_s']:.1f} s"
    )


# -- the probe on a hand-built module (no vLLM) ------------------------------------------------------------------


class _Router:
    """A router as vLLM's ``MoERunner.router``: ``select_experts(hidden_states=, router_logits=) -> (weights, ids)``."""

    global_num_experts, top_k = N_EXPERTS, TOP_K

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        values, ids = torch.topk(router_logits, self.top_k, dim=-1, sorted=False)
        return torch.softmax(values, -1), ids.to(torch.int32)


class _Runner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _Router()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router.select_experts(hidden_states=x, router_logits=logits)
        return x * weights.sum(-1, keepdim=True) + ids.sum(-1, keepdim=True)


class _Layer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.self_attn = nn.Identity()
        self.gate = nn.Linear(16, N_EXPERTS, bias=False)
        self.experts = _Runner() if moe else nn.Identity()


class _Model(nn.Module):
    def __init__(self, moe: tuple[bool, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(m) for m in moe)


def test_the_probe_records_what_select_experts_returned_and_changes_nothing():
    from dumper.engines.vllm.tap import install_router_tap

    torch.manual_seed(0)
    model = _Model((False, True))
    x, logits = torch.randn(5, 16), torch.randn(5, N_EXPERTS)
    before = model.layers[1].experts(x, logits)
    expected = model.layers[1].experts.router.select_experts(hidden_states=x, router_logits=logits)
    tap = install_router_tap(model, layers="all", capacity=8)
    assert [(e.prefix, e.layer) for e in tap.probes] == [("layers.1", 1)]
    compiled = torch.compile(model.layers[1].experts, fullgraph=True, backend="aot_eager")  # the op stays in the graph
    for run in (model.layers[1].experts, compiled):
        tap.clear()
        assert torch.equal(run(x, logits), before)
        [(prefix, layer, parts, meta)] = tap.parts(tokens=5)
        assert torch.equal(parts[ROUTER_LOGITS], logits) and parts[ROUTER_IDS].dtype == torch.int64
        assert torch.equal(parts[ROUTER_IDS], expected[1].long()) and torch.equal(parts[ROUTER_WEIGHTS], expected[0])
    tap.clear()
    with pytest.raises(Exception, match="saw 0 of the pass's 5 tokens"):
        tap.parts(tokens=5)


def test_the_router_point_of_a_model_without_moe_layers_is_refused():
    from dumper.engines.vllm.tap import install_router_tap

    with pytest.raises(UsageError, match=r"_Model has no MoE layer among layers \[0\]"):
        install_router_tap(_Model((False, True)), layers=[0], capacity=8)
    with pytest.raises(UsageError, match="vLLM records it beside the 'input' point"):
        from dumper.engines.vllm.tap import split_points

        split_points(ROUTER_POINT)


@pytest.mark.engine
@pytest.mark.parametrize("job", list(JOBS))
def test_the_comparator_finds_no_failing_flip_between_vllm_and_hf(runs, job, tmp_path):
    """HF fp32 dumped by ``python -m dumper run`` (router point) against vLLM's dump: the routing verdict passes,
    every flip (if any) a near tie by the margin rule, and the weights agree."""
    from comparator import compare_dumps
    from tests.conftest import run_cli

    ids = [arg for p in PROMPTS for arg in ("--input-ids", ",".join(map(str, p)))]
    proc = run_cli(
        "dumper",
        "run",
        "--model",
        shared_moe_checkpoint(),
        *ids,
        "--layers",
        "all",
        "--points",
        POINTS,
        "--out",
        tmp_path / "hf",
    )
    assert proc.returncode == 0, proc.stderr
    r = compare_dumps(tmp_path / "hf", runs[0] / job).router
    assert r is not None and [la.layer for la in r.layers] == list(range(N_LAYERS))
    assert all(la.tokens == sum(map(len, PROMPTS)) for la in r.layers)
    assert r.passed and r.failing_flips == 0, r.to_json()
    print(f"{job} vs HF fp32: {r.flips} flips, max |Δw| {max(la.weight_max_err for la in r.layers):.3e}")


@pytest.mark.engine
def test_a_routing_bug_on_rank_1_alone_fails_naming_rank_1(runs):
    """Rank 1's router of layer BUG_LAYER sends token BUG_TOKEN to other experts; rank 0's, the one compared against
    the baseline, routes as before. The verdict fails on the ranks' disagreement, naming rank 1, layer and token."""
    from comparator import compare_dumps
    from comparator.outcome import Outcome
    from tests.conftest import run_cli

    root = runs[0]
    mine = [_routing(root / "bug-tp2", rank)[BUG_LAYER][ROUTER_IDS] for rank in (0, 1)]
    clean = _routing(root / "eager-tp2")[BUG_LAYER][ROUTER_IDS]
    assert np.array_equal(mine[0], clean)  # plain reads of the records: rank 0 untouched
    keys = [(s, p) for s, prompt in enumerate(PROMPTS) for p in range(len(prompt))]
    off = [keys[i] for i in np.flatnonzero((np.sort(mine[1], -1) != np.sort(clean, -1)).any(-1))]
    # rank 1 off at row BUG_TOKEN of each engine step: vLLM-CPU runs each of these prefills as a step of its own
    assert (0, BUG_TOKEN) in off and {p for _, p in off} == {BUG_TOKEN}, off
    report = compare_dumps(root / "eager-tp2", root / "bug-tp2")
    router = report.router
    assert router is not None and not report.passed and Outcome.of(report) is Outcome.ROUTING
    assert router.layers[BUG_LAYER].flips == 0  # rank 0 alone would pass this layer
    r = router.ranks[0]
    assert (r.side, r.layer, r.rank, r.reference_rank, r.sequence, r.token, r.rows) == (
        "target",
        BUG_LAYER,
        1,
        0,
        0,
        BUG_TOKEN,
        len(off),
    )
    assert not set(r.ids) & set(r.reference_ids)  # negated logits: its lowest-scored experts
    proc = run_cli("comparator", root / "eager-tp2", root / "bug-tp2")
    assert proc.returncode == 1, proc.stderr
    assert f"target rank 1 routes layer {BUG_LAYER}" in proc.stdout, proc.stdout
    assert f"token {BUG_TOKEN} of sequence 0" in proc.stdout, proc.stdout
