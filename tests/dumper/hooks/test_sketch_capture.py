"""Sketching where rows are recorded: what a sketch capture writes, that it changes no output bit, the compiled tap,
and the projection on a GPU (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

import dumper
from comparator import compare_dumps
from dumper.format import DumpReader, load_manifest
from dumper.format.sketch import NORM_SUFFIX, SketchSpec, project, sign_bits
from dumper.hooks.sketch import Sketcher, sign_matrix
from tests.conftest import run_cli, tiny_llama

K = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny Llama captured full and sketched (every layer, input and residual), on the same ids."""
    root = tmp_path_factory.mktemp("sketch-capture")
    model, _ = tiny_llama()
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with dumper.capture(model, root / "full", layers="all", points="input,residual"):
            full_logits = model(ids).logits
        with dumper.capture(model, root / "sketch", layers="all", points="input,residual", sketch=K, sketch_seed=7):
            sketch_logits = model(ids).logits
    return root, full_logits, sketch_logits


def test_a_sketch_holds_each_rows_projection_and_exact_norm_beside_it(pair):
    root, _, _ = pair
    full, sketch = DumpReader(root / "full"), DumpReader(root / "sketch")
    assert sketch.manifest.capture_signature["sketch"] == {"kind": "rademacher", "k": K, "seed": 7}
    assert "sketch" not in full.manifest.capture_signature
    by_name = {t.name: t for t in full.manifest.tensors}
    for rec in sketch.manifest.tensors:
        whole = by_name[rec.name]
        assert rec.sketch == {"hidden": whole.shape[-1], "dtype": whole.dtype}
        assert rec.dtype == "F32" and rec.shape == (*whole.shape[:-1], K) and rec.positions == whole.positions
        with safe_open(root / "sketch" / rec.file, "np") as f:  # the norms in the projection's own file
            assert rec.norm_key == rec.key + NORM_SUFFIX and rec.norm_key in f.keys()
        x = full.rows(whole).astype(np.float64)
        # the capture's float32 projection is the float64 one to float32 rounding; the norms are exact
        np.testing.assert_allclose(sketch.rows(rec), project(x, SketchSpec(k=K, seed=7)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sketch.sq_norms(rec), np.einsum("ij,ij->i", x, x), rtol=1e-12)
    assert sum(sketch.manifest.files.values()) < sum(full.manifest.files.values()) / 2


def test_sketching_changes_no_output_bit(pair):
    _, full_logits, sketch_logits = pair
    assert torch.equal(full_logits, sketch_logits)


@pytest.mark.slow
def test_the_observer_check_proves_a_sketch_run_bit_exact(tmp_path):
    r = run_cli("dumper", "run", "--sketch", str(K), "--logprobs", "--observer-check", "--out", tmp_path / "d")
    assert r.returncode == 0 and "observer check: bit-exact" in r.stdout + r.stderr, r.stdout + r.stderr
    assert load_manifest(tmp_path / "d").extra["observer"]["bit_exact"] is True


@pytest.mark.slow
def test_a_compiled_capture_through_the_tap_sketches_and_matches_eager(pair, tmp_path):
    root, _, _ = pair
    model, _ = tiny_llama()
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    dumper.tap(model, layers="all", points="input,residual", max_tokens=64)
    compiled = torch.compile(model)
    with (
        torch.inference_mode(),
        dumper.capture(compiled, tmp_path / "c", layers="all", points="input,residual", sketch=K, sketch_seed=7),
    ):
        compiled(ids)
    report = compare_dumps(root / "full", tmp_path / "c")
    assert report.passed and report.matched == 2 * len(load_manifest(root / "full").tensors), report  # 2 sequences
    assert not report.unmatched_baseline and not report.unmatched_target
    assert report.sketch == {
        "kind": "rademacher",
        "k": K,
        "seed": 7,
        "baseline": False,
        "target": True,
        "spread": SketchSpec(k=K).spread,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the projection built on the device)")
def test_the_projection_on_a_gpu_is_the_cpus():
    spec = SketchSpec(k=64, seed=3)
    assert torch.equal(sign_matrix(spec, 1000, "cuda").cpu(), sign_matrix(spec, 1000))
    assert np.array_equal((sign_matrix(spec, 1000, "cuda") < 0).cpu().numpy(), sign_bits(3, 64, 1000))
    x = torch.randn(257, 1000, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    cpu, gpu = Sketcher(spec)(x), Sketcher(spec)(x.cuda())
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_the_projection_ignores_a_users_tf32_setting_and_leaves_it_as_it_was(precision):
    """On a GPU the projection runs in full float32 (TF32 would raise its floor by decades); the user's setting,
    made with torch's legacy call, reads back unchanged by either API (flags only: no GPU needed)."""
    from dumper.hooks.sketch import _ieee_fp32

    matmul, saved = torch.backends.cuda.matmul, torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        before = matmul.fp32_precision
        with _ieee_fp32(torch.device("cuda")):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == before and torch.get_float32_matmul_precision() == precision
        with _ieee_fp32(torch.device("cpu")):  # a CPU has no TF32: nothing touched
            assert matmul.fp32_precision == before
    finally:
        torch.set_float32_matmul_precision(saved)
