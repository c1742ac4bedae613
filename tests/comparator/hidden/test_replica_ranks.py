"""A bug on one tensor-parallel rank is located where it starts, on that rank, not where it reaches rank 0.

Real TP=2 runs (two gloo processes, the Megatron split of :mod:`tests.tp_llama`) of tiny-llama in
fp32 write one dump each; the TP=1 baseline is made in this process without torch.distributed. In
the bug variant a forward pre-hook on rank 1's layer-:data:`LAYER` self-attention scales the
hidden state of token :data:`TOKEN`, before the capture records it: rank 0's input of that layer
is untouched, and the perturbed heads reach both ranks only at the next layer, through the
all-reduce. Comparing through rank 0 alone would report layer ``LAYER + 1``.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comparator import compare_dumps
from comparator.hidden.types import Report
from comparator.reports.files import json_text

WORLD = 2
N_TOKENS = 48
LAYER = 3
TOKEN = 20
NUM_LAYERS = 8
VARIANTS = ("tp2", "tp2_bug")
SCALE = 10.0
"""How much rank 1 scales the hidden state of TOKEN entering layer LAYER's self-attention."""


def _attn_input(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.input"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scale_token(module, args, kwargs):
    """Forward pre-hook: the hidden state of token TOKEN, SCALE times larger (a bug in one row of one rank)."""
    h = kwargs["hidden_states"].clone()  # [batch, tokens, hidden]
    h[:, TOKEN] *= SCALE
    return args, {**kwargs, "hidden_states": h}


def _tp_worker(rank: int, port: int, root: str) -> None:
    import dumper
    from tests.conftest import prompt_ids, tiny_llama
    from tests.tp_llama import shard_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        for variant in VARIANTS:
            model, tok = tiny_llama()
            shard_llama(model, rank, WORLD)
            if variant == "tp2_bug" and rank == 1:  # registered before the capture's hooks: recorded perturbed
                model.model.layers[LAYER].self_attn.register_forward_pre_hook(_scale_token, with_kwargs=True)
            with torch.inference_mode(), dumper.capture(model, f"{root}/{variant}", layers="all") as cap:
                cap.set_sequence_ids([0])
                model(input_ids=prompt_ids(tok, N_TOKENS))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The TP=1 baseline and both TP=2 dumps (one spawn of 2 gloo processes), by name."""
    import dumper
    from tests.conftest import prompt_ids, tiny_llama

    root = tmp_path_factory.mktemp("replica-ranks")
    mp.start_processes(_tp_worker, args=(_free_port(), str(root)), nprocs=WORLD, start_method="spawn", join=True)
    assert not (dist.is_available() and dist.is_initialized())
    model, tok = tiny_llama()
    with torch.inference_mode(), dumper.capture(model, root / "tp1", layers="all") as cap:
        cap.set_sequence_ids([0])
        model(input_ids=prompt_ids(tok, N_TOKENS))
    return {name: root / name for name in ("tp1", *VARIANTS)}


@pytest.fixture(scope="module")
def bug_report(dumps) -> Report:
    return compare_dumps(dumps["tp1"], dumps["tp2_bug"])


def _replica_rows(report: Report) -> list[tuple[str | None, int | None, int]]:
    return [(t.replica_side, t.layer, t.rank) for t in report.tensors if t.replica_side is not None]


@pytest.mark.slow
def test_clean_tp2_vs_tp1_passes_in_fp32(dumps):
    report = compare_dumps(dumps["tp1"], dumps["tp2"])  # default thresholds: all-reduce rounding only
    assert report.passed, report.first_divergent
    assert not report.replica_mismatches
    assert not _replica_rows(report)  # bit-identical replicas are not compared a second time
    assert report.matched == len(report.tensors) == NUM_LAYERS


@pytest.mark.slow
def test_replica_mismatch_names_rank_layer_token(bug_report):
    (m,) = bug_report.replica_mismatches  # from the next layer on, the all-reduce makes the ranks agree again
    assert (m.side, m.name, m.layer, m.rank, m.reference_rank, m.first_token) == (
        "target",
        _attn_input(LAYER),
        LAYER,
        1,
        0,
        TOKEN,
    )


@pytest.mark.slow
def test_first_divergence_is_the_lowest_layer_over_all_ranks(bug_report):
    fd = bug_report.first_divergent
    assert not bug_report.passed
    assert (fd.layer, fd.name, fd.rank, fd.replica_side) == (LAYER, _attn_input(LAYER), 1, "target")
    assert fd.token == fd.onset == TOKEN
    by_layer = {t.layer: t for t in bug_report.tensors if t.replica_side is None}
    assert by_layer[LAYER].passed and by_layer[LAYER].rank == 0  # rank 0 alone sees nothing at this layer
    assert not by_layer[LAYER + 1].passed  # ... and only the next one, through the all-reduce
    assert all(by_layer[k].passed for k in range(LAYER))
    # one extra comparison: the differing replica; layers whose replicas agree are compared once
    assert _replica_rows(bug_report) == [("target", LAYER, 1)]
    assert bug_report.matched == NUM_LAYERS


@pytest.mark.slow
def test_heatmap_follows_the_divergent_rank(bug_report):
    hm = bug_report.heatmap
    row = hm.values[hm.layers.index(LAYER)]
    at = hm.positions.index(TOKEN)
    limit = bug_report.token_threshold
    assert row[at] > limit and all(v <= limit for v in row[:at])


@pytest.mark.slow
def test_a_baseline_replica_is_judged_too(dumps):
    report = compare_dumps(dumps["tp2_bug"], dumps["tp1"])
    fd = report.first_divergent
    assert (fd.layer, fd.rank, fd.replica_side, fd.onset) == (LAYER, 1, "baseline", TOKEN)
    assert [(m.side, m.layer, m.rank) for m in report.replica_mismatches] == [("baseline", LAYER, 1)]


@pytest.mark.slow
def test_report_json_round_trips(bug_report):
    back = Report.from_json(json.loads(json_text(bug_report)))
    assert back == bug_report
    assert back.first_divergent.replica_side == "target"


@pytest.mark.slow
def test_cli_exits_1_and_names_the_rank(dumps, tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "report.json"
    res = run_cli("comparator", dumps["tp1"], dumps["tp2_bug"], "--json", out)
    assert res.returncode == 1, res.stdout + res.stderr
    data = json.loads(out.read_text())
    fd = data["first_divergent"]
    assert (fd["layer"], fd["rank"], fd["replica_side"], fd["onset"]) == (LAYER, 1, "target", TOKEN)
    (mm,) = data["replica_mismatches"]
    assert (mm["rank"], mm["layer"], mm["first_token"]) == (1, LAYER, TOKEN)
    text = " ".join(res.stdout.split())  # rich wraps at the terminal width
    assert f"differs between rank 0 and rank 1 from token {TOKEN}" in text
    assert f"rank 1 of the target diverges first, at layer {LAYER}" in text
    assert "the representative rank 0 still agrees" in text
