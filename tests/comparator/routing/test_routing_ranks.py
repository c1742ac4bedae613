"""A routing bug on one tensor-parallel rank fails, named with its rank, even where rank 0 routes right.

Real TP=2 runs (two gloo processes) of the tiny Mixtral of :mod:`tests.routing_dumps` in fp32, the
router replicated on both ranks as under vLLM's tensor parallelism, write one dump each with the
``router`` point; the TP=1 baseline is made in this process without torch.distributed. Routing is
compared through each side's lowest rank, so rank 1's own choice is checked against rank 0's
(bit for bit, as replicated rows are). The bugs sit inside rank 1's router of layer :data:`LAYER`
(:func:`tests.routing_dumps.seed_router_bug`): ``bias`` moves one token to another expert, ``order``
keeps every expert and changes the combine weights. Checked by hand once with plain forward hooks
on the gates of a seeded and a clean model: at layer 1 the seeded one's logits and experts differ
at the seeded row alone (74: sequence 1, token 34); at layer 2 no expert differs and 62 rows' logits
differ by rounding (each expert's batch of tokens changed with the flip).
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
from comparator.outcome import Outcome, headline
from dumper.format import ROUTER_IDS, ROUTER_WEIGHTS
from tests.routing_dumps import choose_flip_token, mixtral, prompt_ids, seed_router_bug

pytestmark = pytest.mark.slow  # two gloo processes and four models, as test_replica_ranks.py's

WORLD, LAYER = 2, 1
VARIANTS = ("tp2", "tp2_bias", "tp2_order")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out: str, bug: str | None, flip: tuple[int, int, float]) -> None:
    import dumper

    model = mixtral()
    if bug is not None:
        token, expert, bias = flip
        seed_router_bug(model.model.layers[LAYER].mlp.gate, bug, token=token, expert=expert, bias=bias)
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points=("input", "router")):
        model(prompt_ids())


def _tp_worker(rank: int, port: int, root: str, flip: tuple[int, int, float]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        for variant in VARIANTS:
            bug = variant.partition("_")[2] or None
            _run(f"{root}/{variant}", bug if rank == 1 else None, flip)  # the bug on rank 1 only
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """(the TP=1 baseline and the three TP=2 dumps by name, the bias bug's (flat row, expert, bias))."""
    root = tmp_path_factory.mktemp("routing-ranks")
    flip = choose_flip_token(LAYER)
    mp.start_processes(_tp_worker, args=(_free_port(), str(root), flip), nprocs=WORLD, start_method="spawn", join=True)
    _run(str(root / "tp1"), None, flip)
    return {name: root / name for name in ("tp1", *VARIANTS)}, flip


def _token(flip: tuple[int, int, float]) -> tuple[int, int]:
    """(sequence, position) of the bias bug's flat row in the [2, 40] batch."""
    return divmod(flip[0], prompt_ids().shape[1])


def test_clean_tp2_routes_like_tp1_on_both_ranks(dumps):
    report = compare_dumps(dumps[0]["tp1"], dumps[0]["tp2"])
    assert report.passed, headline(report)
    assert report.router is not None and report.router.passed and not report.router.ranks


def test_a_rank_1_flip_fails_naming_rank_layer_and_token(dumps):
    paths, flip = dumps
    report: Report = compare_dumps(paths["tp1"], paths["tp2_bias"])
    router = report.router
    assert router is not None and not router.passed
    assert all(la.passed for la in router.layers)  # rank 0, the one compared, routes as the baseline does
    r = router.ranks[0]  # later layers may differ on rank 1 too: its hidden states follow its own routing
    assert (r.side, r.layer, r.rank, r.reference_rank, (r.sequence, r.token)) == ("target", LAYER, 1, 0, _token(flip))
    assert flip[1] in r.ids and flip[1] not in r.reference_ids and ROUTER_IDS in r.parts
    assert r.rows == 1  # layer LAYER's input is the same on both ranks: only the seeded token routes otherwise
    assert {x.rank for x in router.ranks} == {1} and min(x.layer for x in router.ranks) == LAYER
    assert Outcome.of(report) is Outcome.ROUTING
    line = headline(report)
    assert f"target rank 1 routes layer {LAYER}" in line and f"token {r.token} of sequence {r.sequence}" in line, line


def test_a_rank_1_weight_bug_with_the_same_experts_fails_on_the_weights(dumps):
    report = compare_dumps(dumps[0]["tp1"], dumps[0]["tp2_order"])
    assert report.router is not None and all(la.passed for la in report.router.layers)
    r = report.router.ranks[0]
    assert (r.layer, r.rank) == (LAYER, 1) and r.ids == r.reference_ids and r.parts == (ROUTER_WEIGHTS,)
    assert r.weight_max_diff > 0.01 and r.rows > 0
    assert "with other weights" in headline(report), headline(report)


def test_the_rank_check_survives_the_report_json(dumps, tmp_path):
    from comparator.reports.files import json_text

    report = compare_dumps(dumps[0]["tp1"], dumps[0]["tp2_bias"])
    again = Report.from_json(json.loads(json_text(report)))
    assert again.router is not None and again.router.ranks == report.router.ranks and not again.passed
