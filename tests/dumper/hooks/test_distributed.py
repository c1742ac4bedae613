"""Multi-rank capture with real torch.distributed (gloo) processes: each rank writes its own files."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comparator import compare_dumps
from dumper.format import load_manifest

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str, bad_rank: int) -> None:
    import dumper
    from tests.conftest import prompt_ids, tiny_llama

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model, tok = tiny_llama()
        if rank == bad_rank:
            with torch.no_grad():
                w = model.model.layers[2].mlp.down_proj.weight
                w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
        ids = prompt_ids(tok, 32 + 8 * rank)  # ranks see different data, as data-parallel ranks do
        with torch.inference_mode(), dumper.capture(model, out, layers="1,3,5") as cap:
            cap.set_sequence_ids([rank])  # request ids are global: the engine names them
            model(input_ids=ids)
    finally:
        dist.destroy_process_group()


def _run(out, bad_rank: int = -1) -> None:
    mp.start_processes(_worker, args=(_free_port(), str(out), bad_rank), nprocs=WORLD, start_method="spawn", join=True)


@pytest.fixture(scope="module")
def rank_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    _run(root / "base")
    _run(root / "bad", bad_rank=1)
    return root / "base", root / "bad"


@pytest.mark.slow
def test_each_rank_writes_its_own_files(rank_dumps):
    base, _ = rank_dumps
    m = load_manifest(base)
    assert sorted({f.split("-")[0] for f in m.files}) == ["r0", "r1"]
    assert m.capture_signature["world_size"] == WORLD
    by_rank = {r: [t for t in m.tensors if t.rank == r] for r in range(WORLD)}
    assert [len(v) for v in by_rank.values()] == [3, 3]
    assert [t.shape for t in by_rank[0]] == [(1, 32, 64)] * 3 and [t.shape for t in by_rank[1]] == [(1, 40, 64)] * 3
    for r, ts in by_rank.items():
        assert all(t.file.startswith(f"r{r}-") for t in ts)


@pytest.mark.slow
def test_comparator_names_the_rank_that_diverged(rank_dumps):
    base, bad = rank_dumps
    report = compare_dumps(base, bad)
    assert report.matched == 6 and not report.passed
    fd = report.first_divergent
    assert fd.layer == 3 and fd.rank == 1 and fd.sequence == 1
    assert all(t.passed for t in report.tensors if t.rank == 0)
