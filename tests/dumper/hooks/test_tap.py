"""The graph-safe tap (dumper.hooks.tap) on the tiny HF preset, eager and under torch.compile.

A compiled capture must record what an eager capture records (names, positions, sequences,
rows; values within compile noise), the tap must change no output bit, compiled or eager,
and every way of asking for what the tap cannot give is a one-line UsageError. Each compiled
model sees one input shape (a second shape would recompile it with dynamic shapes, which
costs more than a first compile); the compiled models are module-scoped fixtures that run
everything they are asked for at set-up, since ``torch.compiler.reset()`` between models
(Dynamo's cache is keyed by code, not by model) drops their compiled code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps, rel_diff
from dumper.errors import UsageError
from dumper.format import MANIFEST_NAME, PAD_SEQUENCE, load_manifest
from dumper.format.reader import DumpReader
from dumper.hooks.tap import available_bytes, check_counts, remove_tap, tap_of
from tests.conftest import prompt_ids, run_cli, tiny_llama

N = 48
"""Tokens of the one prompt every compiled model sees (one shape: one compile)."""
POINTS = ("input", "residual")
BUG_LAYER, BUG_TOKEN = 3, 29
"""Where the seeded bug perturbs the residual stream."""
F32_EPS = torch.finfo(torch.float32).eps


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One prefill pass, called as ``python -m dumper run`` calls it (so both share compiled code)."""
    positions = torch.arange(ids.shape[1])[None]
    return model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False).logits.clone()


def _records(path: Path) -> dict[str, tuple[tuple[int, ...], list[int], list[int], np.ndarray]]:
    """name -> (shape, positions, sequence ids, float64 rows) of every tensor of a dump."""
    reader = DumpReader(path)
    return {
        t.name: (t.shape, t.row_positions().tolist(), t.row_sequence_ids().tolist(), reader.rows(t).astype(np.float64))
        for t in reader.manifest.tensors
    }


def _no_tap_left(model: torch.nn.Module) -> bool:
    """No tap, no sink buffers and no forward pre-hooks anywhere in ``model``."""
    return tap_of(model) is None and not any(
        "_driftscope_sink" in m._buffers or m._forward_pre_hooks for m in model.modules()
    )


def _one_line_usage(excinfo: pytest.ExceptionInfo) -> str:
    msg = str(excinfo.value)
    assert excinfo.type is UsageError and msg and "\n" not in msg, msg
    return msg


@dataclass(frozen=True)
class Runs:
    ids: torch.Tensor
    eager_dir: Path  # untapped eager model, module hooks
    compiled_dir: Path  # tapped, torch.compile'd, captured through the tap
    eager: torch.Tensor  # logits of the untapped eager model
    plain: torch.Tensor  # logits of torch.compile(untapped model)
    tapped: torch.Tensor  # logits of torch.compile(tapped model), under capture


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("tap")
    torch.set_num_threads(2)
    model, tok = tiny_llama()
    ids = prompt_ids(tok, N)
    with torch.inference_mode():
        with dumper.capture(model, root / "eager", layers="all", points=POINTS):
            eager = _forward(model, ids)
        torch.compiler.reset()
        plain = _forward(torch.compile(model), ids)
        torch.compiler.reset()  # a fresh compile of the tapped model, not the plain one's cached code
        dumper.tap(model, layers="all", points=POINTS, max_tokens=N)
        compiled = torch.compile(model)
        with dumper.capture(compiled, root / "compiled", layers="all", points=POINTS):
            tapped = _forward(compiled, ids)
    torch.compiler.reset()
    return Runs(ids, root / "eager", root / "compiled", eager, plain, tapped)


@pytest.mark.slow
def test_compiled_capture_records_what_eager_records(runs):
    eager, compiled = _records(runs.eager_dir), _records(runs.compiled_dir)
    assert sorted(compiled) == sorted(eager) and len(eager) == 2 * 8 + 1  # input and residual of 8 layers, final norm
    for name, (shape, pos, seq, values) in eager.items():
        c_shape, c_pos, c_seq, c_values = compiled[name]
        assert (c_shape, c_pos, c_seq) == (shape, pos, seq) == ((1, N, 64), list(range(N)), [0] * N), name
        # compile noise: rel_diff is a squared relative norm; a few float32 ulps of it (inductor
        # fuses and reorders reductions) is ~1e-13, where a bug is above the 1e-3 threshold
        assert math.sqrt(rel_diff(values, c_values)) < 16 * F32_EPS, name
    assert load_manifest(runs.compiled_dir).capture_signature["layers"] == list(range(8))
    report = compare_dumps(runs.eager_dir, runs.compiled_dir, CompareConfig())
    assert report and not report.unmatched_baseline and not report.unmatched_target


@pytest.mark.slow
def test_tap_leaves_compiled_logits_bit_identical(runs):
    assert torch.equal(runs.tapped, runs.plain)
    # ... and they are compiled logits, equal to eager's within compile noise (a few ulps)
    assert (runs.tapped - runs.eager).abs().max() <= 16 * F32_EPS * runs.eager.abs().max()


def test_tap_leaves_eager_logits_and_rows_bit_identical(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 40)
    with torch.inference_mode():
        with dumper.capture(model, tmp_path / "hooks", layers="all", points=POINTS):
            plain = _forward(model, ids)
        dumper.tap(model, layers="all", points=POINTS, max_tokens=64)
        with dumper.capture(model, tmp_path / "tap", layers="all", points=POINTS):  # eager, through the tap
            tapped = _forward(model, ids)
    assert torch.equal(tapped, plain)
    hooks, tap = _records(tmp_path / "hooks"), _records(tmp_path / "tap")
    assert sorted(hooks) == sorted(tap)
    for name, (shape, pos, seq, values) in hooks.items():
        assert tap[name][:3] == (shape, pos, seq) and np.array_equal(tap[name][3], values), name


def test_the_row_counts_are_read_from_the_device_once_per_pass():
    """Every capture reading one pass shares one host copy of the counts (one sync on a GPU); a new pass reads anew."""
    model, tok = tiny_llama()
    tap = dumper.tap(model, layers="all", max_tokens=64)
    ids = prompt_ids(tok, 40)
    with torch.inference_mode():
        tap.clear()
        _forward(model, ids)
        first = check_counts(tap)
        assert first == [40] * len(tap.points)
        tap.count.fill_(7)  # what a second read of the device would see
        assert check_counts(tap) is first
        tap.clear()
        _forward(model, ids[:, :30])
        assert check_counts(tap) == [30] * len(tap.points)


def test_remove_tap_restores_module_hooks_and_plain_logits(tmp_path):
    model, tok = tiny_llama()
    ref, _ = tiny_llama()
    ids = prompt_ids(tok, 40)
    dumper.tap(model, layers="first", points=POINTS, max_tokens=64)
    remove_tap(model)
    assert _no_tap_left(model)
    with torch.inference_mode():
        # layers="all" would be refused by the tap (it held layer 0 only): module hooks record it
        with dumper.capture(model, tmp_path / "removed", layers="all", points=POINTS):
            out = _forward(model, ids)
        with dumper.capture(ref, tmp_path / "ref", layers="all", points=POINTS):
            expected = _forward(ref, ids)
    assert torch.equal(out, expected)
    removed, untapped = _records(tmp_path / "removed"), _records(tmp_path / "ref")
    assert sorted(removed) == sorted(untapped) and len(removed) == 17
    for name, (shape, pos, seq, values) in untapped.items():
        assert removed[name][:3] == (shape, pos, seq) and np.array_equal(removed[name][3], values), name


@pytest.mark.slow
def test_seeded_bug_is_localized_in_the_compiled_capture(runs, tmp_path):
    model, _ = tiny_llama()
    bump = torch.zeros(1, N, 1)
    bump[0, BUG_TOKEN] = 0.05  # one token of the residual stream entering layer BUG_LAYER

    def bug(module, args, kwargs):  # pure tensor code, installed before the tap and the compile
        if args:
            return (args[0] + bump, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + bump}

    model.model.layers[BUG_LAYER].register_forward_pre_hook(bug, with_kwargs=True)
    dumper.tap(model, layers="all", points=POINTS, max_tokens=N)
    torch.compiler.reset()
    compiled = torch.compile(model)
    try:
        with torch.inference_mode(), dumper.capture(compiled, tmp_path / "bug", layers="all", points=POINTS):
            _forward(compiled, runs.ids)
    finally:
        torch.compiler.reset()
    report = compare_dumps(runs.eager_dir, tmp_path / "bug", CompareConfig())
    fd = report.first_divergent
    assert not report and fd is not None
    assert (fd.layer, fd.token, fd.sequence) == (BUG_LAYER, BUG_TOKEN, 0), fd
    failed = {t.layer for t in report.tensors if not t.passed}
    assert min(failed) == BUG_LAYER and all(t.first_failing_token == BUG_TOKEN for t in report.tensors if not t.passed)


# -- refusals -----------------------------------------------------------------------------


def test_capture_of_a_compiled_model_without_tap_is_refused(tmp_path):
    model, _ = tiny_llama()
    with pytest.raises(UsageError) as e:
        dumper.capture(torch.compile(model), tmp_path / "d", layers="all")
    assert "tap" in _one_line_usage(e)
    assert not (tmp_path / "d").exists()


def test_tap_on_a_compiled_model_is_refused():
    model, _ = tiny_llama()
    with pytest.raises(UsageError) as e:
        dumper.tap(torch.compile(model), layers="all")
    assert "before torch.compile" in _one_line_usage(e)
    assert _no_tap_left(model)


def test_tapping_twice_is_refused():
    model, _ = tiny_llama()
    first = dumper.tap(model, layers="first", max_tokens=32)
    with pytest.raises(UsageError) as e:
        dumper.tap(model, layers="all", max_tokens=32)
    assert "already tapped" in _one_line_usage(e)
    assert tap_of(model) is first and first.names() == ["model.layers.0.self_attn.input"]


@pytest.mark.parametrize("compiled", [False, True])
def test_capturing_a_layer_the_tap_lacks_is_refused(tmp_path, compiled):
    model, _ = tiny_llama()
    dumper.tap(model, layers="first,last", max_tokens=32)
    target = torch.compile(model) if compiled else model
    with pytest.raises(UsageError) as e:
        dumper.capture(target, tmp_path / "d", layers="all")
    assert "model.layers.1.self_attn.input" in _one_line_usage(e) and "not tapped" in str(e.value)
    assert not (tmp_path / "d").exists()
    with pytest.raises(UsageError):  # a point it does not hold, too
        dumper.capture(target, tmp_path / "d", layers="first", points=POINTS)


def test_a_pass_larger_than_the_tap_is_refused_and_leaves_no_dump(tmp_path):
    model, tok = tiny_llama()
    dumper.tap(model, layers="all", max_tokens=16)
    out = tmp_path / "d"
    with pytest.raises(UsageError) as e, torch.inference_mode(), dumper.capture(model, out, layers="all"):
        _forward(model, prompt_ids(tok, 24))
    assert "24 rows" in _one_line_usage(e) and "capacity of 16" in str(e.value)
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("*.safetensors"))


def test_a_sink_larger_than_free_memory_is_refused_before_allocation():
    model, _ = tiny_llama()
    free = available_bytes(torch.device("cpu"))
    assert free is not None
    per_token = 8 * 64 * 4  # 8 points (layers all, input) × hidden 64 × float32
    with pytest.raises(UsageError) as e:
        dumper.tap(model, layers="all", max_tokens=math.ceil(2 * free / per_token))
    assert "MiB are free" in _one_line_usage(e)
    assert _no_tap_left(model)  # nothing allocated, nothing hooked: the model is as it was


# -- the CLI ---------------------------------------------------------------------------------


def _dump(out: Path, *args: str) -> None:
    res = run_cli(
        "dumper",
        "run",
        "--model",
        "tiny-llama",
        "--layers",
        "all",
        "--points",
        "input,residual",
        "--logprobs",
        "--out",
        out,
        *args,
    )
    assert res.returncode == 0, res.stderr


def _compare(baseline: Path, target: Path) -> None:
    res = run_cli("comparator", "--require-all", baseline, target)
    assert res.returncode == 0 and "\nPASS: matched" in "\n" + res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_cli_compiled_run_passes_against_eager(runs, tmp_path):
    # the prompt and call of the ``runs`` fixture, so that this compile finds its graph in inductor's cache
    ids = ",".join(map(str, runs.ids[0].tolist()))
    _dump(tmp_path / "eager", "--input-ids", ids)
    _dump(tmp_path / "compiled", "--input-ids", ids, "--compile")
    assert load_manifest(tmp_path / "compiled").extra["compiled"] is True
    assert load_manifest(tmp_path / "eager").extra["compiled"] is False
    _compare(tmp_path / "eager", tmp_path / "compiled")


@pytest.mark.slow
def test_cli_compiled_chunked_padded_batch_passes_against_eager(tmp_path):
    # two prompts in one right-padded batch, prefilled in two chunks through the KV cache: two
    # compiles (the second chunk reads the cache; Dynamo makes its grown mask dim dynamic)
    args = (
        "--input-ids",
        ",".join(map(str, range(3, 43))),
        "--input-ids",
        ",".join(map(str, range(50, 78))),
        "--batch-size",
        "2",
        "--chunk-size",
        "20",
    )
    _dump(tmp_path / "eager", *args)
    _dump(tmp_path / "compiled", *args, "--compile")
    rows = {}
    for side in ("eager", "compiled"):
        hidden = [t for t in load_manifest(tmp_path / side).tensors if t.point in POINTS]
        rows[side] = sorted(
            (t.name, t.forward_pass, t.shape, tuple(t.row_positions().tolist()), tuple(t.row_sequence_ids().tolist()))
            for t in hidden
        )
    assert rows["compiled"] == rows["eager"]
    assert len({r[1] for r in rows["compiled"]}) == 2 and {r[2] for r in rows["compiled"]} == {(2, 20, 64)}
    assert {s for r in rows["compiled"] for s in r[4]} == {0, 1, PAD_SEQUENCE}  # the second prompt's padding
    _compare(tmp_path / "eager", tmp_path / "compiled")
