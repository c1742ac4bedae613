"""End-to-end localization on a real tiny Llama: inject a bug, find its layer and token."""

from __future__ import annotations

import math

import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from tests.conftest import prompt_ids, tiny_llama

N_LAYERS = 8


def _dump(model, ids, out, *, layers="all"):
    with torch.inference_mode(), dumper.capture(model, out, layers=layers):
        model(input_ids=ids, use_cache=False)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 128)
    out = _dump(model, ids, tmp_path_factory.mktemp("base") / "dump")
    return out, ids


def test_identical_runs_have_zero_rel_diff(base, tmp_path):
    out, ids = base
    model, _ = tiny_llama()
    again = _dump(model, ids, tmp_path / "again")
    report = compare_dumps(out, again)
    assert report.passed and report.matched == N_LAYERS
    assert all(t.rel_diff == 0.0 and t.max_token_rel_diff == 0.0 and t.max_abs_diff == 0.0 for t in report.tensors)
    assert report.first_divergent is None


@pytest.mark.parametrize("k", [0, 3, 6])
def test_mlp_weight_perturbation_localizes_to_next_layer(base, tmp_path, k):
    out, ids = base
    model, _ = tiny_llama()
    with torch.no_grad():
        w = model.model.layers[k].mlp.down_proj.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(k)))
    bad = _dump(model, ids, tmp_path / "bad")
    report = compare_dumps(out, bad)
    assert not report.passed
    fd = report.first_divergent
    assert fd is not None and fd.layer == k + 1
    assert fd.name == f"model.layers.{k + 1}.self_attn.input"
    for t in report.tensors:
        assert t.passed == (t.layer <= k), (t.name, t.rel_diff)
    # every token is touched by an MLP change, so the first failing token is position 0
    assert fd.token == 0


def _perturb_after_layer(model, k, token, fn):
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        fn(hidden[0, token])
        return output

    return model.model.layers[k].register_forward_hook(hook)


@pytest.mark.parametrize("k,token", [(2, 57), (5, 100)])
def test_single_token_perturbation_is_caught_by_the_token_threshold(base, tmp_path, k, token):
    out, ids = base
    model, _ = tiny_llama()
    gen = torch.Generator().manual_seed(1)

    def bump(row):
        row.add_(0.2 * row.norm() / math.sqrt(row.numel()) * torch.randn(row.shape, generator=gen))

    handle = _perturb_after_layer(model, k, token, bump)
    bad = _dump(model, ids, tmp_path / "bad")
    handle.remove()
    report = compare_dumps(out, bad)
    fd = report.first_divergent
    assert fd is not None and fd.layer == k + 1 and fd.token == token
    first = next(t for t in report.tensors if t.layer == k + 1)
    # the max-type signal: the whole tensor stays under the threshold, one token does not
    assert first.rel_diff < report.threshold < first.max_token_rel_diff
    assert first.failing_tokens == 1 and first.worst_token == token
    # attention then spreads the error to later tokens, never to earlier ones
    later = next(t for t in report.tensors if t.layer == k + 2) if k + 2 < N_LAYERS else None
    if later is not None:
        assert later.first_failing_token == token


def test_nan_in_one_position_diverges_at_that_layer_and_token(base, tmp_path):
    out, ids = base
    model, _ = tiny_llama()
    handle = _perturb_after_layer(model, 4, 33, lambda row: row.__setitem__(7, float("nan")))
    bad = _dump(model, ids, tmp_path / "bad")
    handle.remove()
    report = compare_dumps(out, bad)
    fd = report.first_divergent
    assert fd is not None and fd.layer == 5 and fd.token == 33
    t5 = next(t for t in report.tensors if t.layer == 5)
    assert math.isinf(t5.rel_diff) and not t5.passed
    assert t5.nan_target > 0 and t5.nan_baseline == 0 and t5.nonfinite_mismatches > 0
    # a threshold of infinity still cannot pass a NaN
    lenient = compare_dumps(out, bad, CompareConfig(threshold=1e300, token_threshold=1e300))
    assert not lenient.passed and lenient.first_divergent.layer == 5


def test_same_nan_on_both_sides_is_not_a_difference(tmp_path):
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    for name in ("a", "b"):
        with dumper.capture(None, tmp_path / name):
            dumper.dump("t", x, layer=0, positions=[0, 1, 2, 3])
    report = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert report.passed and report.tensors[0].nan_baseline == 1 and report.tensors[0].rel_diff == 0.0
