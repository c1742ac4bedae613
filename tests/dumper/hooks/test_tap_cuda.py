"""The tap under CUDA graphs: torch.compile's ``reduce-overhead`` mode replays the tap's copies.

These (and the other tests marked ``gpu``; ``bash .ci/gpu-check`` runs them all) are the only tests
that skip under ``CI=true``: they need a CUDA device. Each checks,
on the GPU, what the CPU tests check there: the tap changes no output bit, and a compiled
capture (here replayed from CUDA graphs, which run no Python) records the rows an eager
capture records, within compile noise.
"""

from __future__ import annotations

import pytest
import torch

import dumper
from dumper.format import load_manifest
from dumper.format.reader import DumpReader
from tests.conftest import tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]


def _rows(path, name: str) -> torch.Tensor:
    reader = DumpReader(path)
    return torch.cat(
        [torch.from_numpy(reader.rows(t).astype("float64")) for t in load_manifest(path).tensors if t.name == name]
    )


def test_cuda_graph_replays_record_what_eager_records(tmp_path):
    model, _ = tiny_llama()
    model = model.cuda().eval()
    ids = torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        with dumper.capture(model, tmp_path / "eager", layers="all"):
            eager = model(ids).logits
        plain = torch.compile(model, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            ref = plain(ids).logits.clone()
        torch.compiler.reset()
        dumper.tap(model, layers="all", max_tokens=64)
        compiled = torch.compile(model, mode="reduce-overhead")
        for _ in range(2):
            compiled(ids)
        with dumper.capture(compiled, tmp_path / "graphs", layers="all"):
            out = compiled(ids).logits.clone()
    assert torch.equal(out, ref), "the tap changed the CUDA-graph model's logits"
    assert (out - eager).abs().max() < 1e-3
    name = "model.layers.1.self_attn.input"
    a, b = _rows(tmp_path / "eager", name), _rows(tmp_path / "graphs", name)
    assert a.shape == b.shape
    rel = float(((a - b).double().norm() ** 2) / (a.double().norm() ** 2 + b.double().norm() ** 2))
    assert rel < 1e-9
