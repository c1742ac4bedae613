"""A real tensor-parallel (TP=2, gloo, CPU) forward of tiny-llama, dumped and compared against TP=1.

The TP=2 runs are real torch.distributed processes running a Megatron-split model
(:mod:`tests.tp_llama`). Both ranks write into the same dump directory: replicated tensors (the
self-attention inputs) appear once per rank and must be identical across ranks; the q_proj
outputs are column-parallel (``shard_dim=-1``) and are reassembled by the comparator.

All TP=2 dumps come from one spawn of 2 processes per module (the model is rebuilt per variant);
the TP=1 baseline is made in this process without torch.distributed.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comparator import compare_dumps
from dumper.format import load_manifest
from tests.tp_llama import q_proj_name

WORLD = 2
N_TOKENS = 48
HIDDEN = 64
BAD_Q_LAYER = 3
REPLICA_LAYER = 4  # rank 1's output of this decoder layer is perturbed: layer 5's input differs across ranks
VARIANTS = ("tp2", "tp2_again", "tp2_bad_q", "tp2_replica")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perturb_output(module, args, out):
    """Forward hook: add 1e-3 * randn (fixed seed) to a decoder layer's hidden states."""
    h = out[0] if isinstance(out, tuple) else out
    noise = 1e-3 * torch.randn(h.shape, generator=torch.Generator().manual_seed(1), dtype=h.dtype)
    return (h + noise, *out[1:]) if isinstance(out, tuple) else h + noise


def _tp_worker(rank: int, port: int, root: str, variants: tuple[str, ...]) -> None:
    import dumper
    from tests.conftest import prompt_ids, tiny_llama
    from tests.tp_llama import record_q_proj, shard_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        for variant in variants:
            model, tok = tiny_llama()
            shard_llama(model, rank, WORLD)
            if variant == "tp2_bad_q" and rank == 1:
                with torch.no_grad():
                    w = model.model.layers[BAD_Q_LAYER].self_attn.q_proj.weight
                    w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
            if variant == "tp2_replica" and rank == 1:
                model.model.layers[REPLICA_LAYER].register_forward_hook(_perturb_output)
            record_q_proj(model)
            ids = prompt_ids(tok, N_TOKENS)
            with torch.inference_mode(), dumper.capture(model, f"{root}/{variant}", layers="all") as cap:
                cap.set_sequence_ids([0])  # both ranks process the same sequence
                logits = model(input_ids=ids).logits
            if variant == "tp2":
                torch.save(logits.clone(), f"{root}/logits-tp2-r{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    """TP=1 baseline in this process (no torch.distributed): dump path and logits."""
    import dumper
    from tests.conftest import prompt_ids, tiny_llama
    from tests.tp_llama import record_q_proj

    assert not (dist.is_available() and dist.is_initialized())
    out = tmp_path_factory.mktemp("tp1") / "dump"
    model, tok = tiny_llama()
    handles = record_q_proj(model)
    try:
        with torch.inference_mode(), dumper.capture(model, out, layers="all") as cap:
            cap.set_sequence_ids([0])
            logits = model(input_ids=prompt_ids(tok, N_TOKENS)).logits.clone()
    finally:
        for h in handles:
            h.remove()
    return out, logits


@pytest.fixture(scope="module")
def tp2_root(tmp_path_factory):
    """All TP=2 dumps, made by one spawn of 2 gloo processes."""
    root = tmp_path_factory.mktemp("tp2")
    mp.start_processes(
        _tp_worker, args=(_free_port(), str(root), VARIANTS), nprocs=WORLD, start_method="spawn", join=True
    )
    return root


def _q_comparisons(report):
    return [t for t in report.tensors if t.name.endswith(".self_attn.q_proj.output")]


@pytest.mark.slow
def test_tp2_logits_equal_tp1(tp1, tp2_root):
    _, ref = tp1
    for rank in range(WORLD):
        logits = torch.load(tp2_root / f"logits-tp2-r{rank}.pt")
        assert logits.shape == ref.shape == (1, N_TOKENS, 384)
        assert (logits - ref).abs().max().item() < 1e-5


@pytest.mark.slow
def test_tp2_dump_layout(tp2_root):
    m = load_manifest(tp2_root / "tp2")
    assert m.capture_signature["world_size"] == WORLD
    assert sorted({f.split("-")[0] for f in m.files}) == ["r0", "r1"]
    q = [t for t in m.tensors if t.name == q_proj_name(0)]
    assert sorted(t.rank for t in q) == [0, 1]
    assert all(t.shape == (1, N_TOKENS, HIDDEN // WORLD) and t.shard_dim == 2 for t in q)
    attn_in = [t for t in m.tensors if t.name == "model.layers.0.self_attn.input"]
    assert sorted(t.rank for t in attn_in) == [0, 1]
    assert all(t.shape == (1, N_TOKENS, HIDDEN) and t.shard_dim is None for t in attn_in)


def _assert_clean_pass(report):
    assert report.passed, report.first_divergent
    assert not report.replica_mismatches
    assert not report.unmatched_baseline and not report.unmatched_target
    q = _q_comparisons(report)
    assert len(q) == 8
    assert all(t.shape == (N_TOKENS, HIDDEN) for t in q)  # the shards were joined into the full hidden dim
    assert report.matched == 16


@pytest.mark.slow
def test_tp2_vs_tp1_passes(tp1, tp2_root):
    _assert_clean_pass(compare_dumps(tp1[0], tp2_root / "tp2"))


@pytest.mark.slow
def test_tp1_vs_tp2_passes(tp1, tp2_root):
    _assert_clean_pass(compare_dumps(tp2_root / "tp2", tp1[0]))


@pytest.mark.slow
def test_tp2_vs_tp2_passes(tp2_root):
    report = compare_dumps(tp2_root / "tp2", tp2_root / "tp2_again")
    _assert_clean_pass(report)
    assert all(t.rel_diff == 0 for t in report.tensors)  # same processes, same split: bit-identical


@pytest.mark.slow
def test_bug_in_one_ranks_shard_is_localized(tp1, tp2_root):
    report = compare_dumps(tp1[0], tp2_root / "tp2_bad_q")
    assert not report.passed
    fd = report.first_divergent
    assert fd.layer == BAD_Q_LAYER
    assert fd.name == q_proj_name(BAD_Q_LAYER)
    assert fd.rank == 1
    (q,) = [t for t in report.tensors if t.name == q_proj_name(BAD_Q_LAYER)]
    assert not q.passed and q.rank == 1 and q.shape == (N_TOKENS, HIDDEN)
    # everything before the bad shard still agrees, and the replicated inputs stay identical
    assert all(t.passed for t in report.tensors if t.layer is not None and t.layer < BAD_Q_LAYER)
    assert not report.replica_mismatches


@pytest.mark.slow
def test_replicas_must_be_identical_across_ranks(tp1, tp2_root):
    report = compare_dumps(tp1[0], tp2_root / "tp2_replica")
    assert not report.passed
    assert report.replica_mismatches
    first = min(report.replica_mismatches, key=lambda m: (m.layer, m.rank, m.first_token))
    assert first == report.replica_mismatches[0]
    assert (first.side, first.layer, first.rank, first.reference_rank) == ("target", REPLICA_LAYER + 1, 1, 0)
    assert first.name == f"model.layers.{REPLICA_LAYER + 1}.self_attn.input"
    # the baseline (TP=1) holds no replicas at all
    assert all(m.side == "target" for m in report.replica_mismatches)


@pytest.mark.slow
def test_cli_reports_replica_mismatch(tp1, tp2_root, tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "report.json"
    res = run_cli("comparator", tp1[0], tp2_root / "tp2_replica", "--json", out)
    assert res.returncode == 1, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["passed"] is False
    mm = data["replica_mismatches"]
    assert mm and any(m["rank"] == 1 and m["layer"] == REPLICA_LAYER + 1 and m["side"] == "target" for m in mm)
    assert (mm[0]["rank"], mm[0]["layer"], mm[0]["reference_rank"]) == (1, REPLICA_LAYER + 1, 0)
