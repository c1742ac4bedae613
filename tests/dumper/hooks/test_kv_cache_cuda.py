"""The cache points on a GPU: the HF cache object read on the device, fingerprints taken there (no host copy).

Marked ``gpu`` (``bash .ci/gpu-check`` runs it): the same decode job on CUDA and on the CPU records the same
cache rows within fp32 device noise, and every row a query read is the row written there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comparator import compare_dumps
from dumper.format import load_manifest
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import prompt_ids, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cache_points_on_cuda_match_the_cpu(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 20)[0].tolist()
    seqs = [ids, ids[:13]]
    cfg = {"layers": "all", "points": "input,k_cache,v_cache", "new_tokens": 3, "batch_size": 2}
    dump_sequences(model, seqs, RunConfig(out=str(tmp_path / "cpu"), **cfg))
    dump_sequences(model.cuda(), seqs, RunConfig(out=str(tmp_path / "cuda"), device="cuda", **cfg))
    kv = load_manifest(tmp_path / "cuda").extra["kv_cache"]
    assert kv["readback"]["checked"] > 0 and kv["readback"]["failed"] == 0
    report = compare_dumps(tmp_path / "cpu", tmp_path / "cuda")
    cache = [t for t in report.tensors if t.point in ("k_cache", "v_cache")]
    assert cache and all(t.passed for t in cache), [t.name for t in cache if not t.passed]
    assert np.isfinite([t.rel_diff for t in cache]).all()
