"""Capture points inside a layer (attn_output, mlp_input, mlp_output) on the tiny HF Llama, and the verdict that
names the first divergent point.

The truth first, with plain hooks: the rows each point records are bit for bit what a plain
forward hook on the module sees. Then a bug seeded in layer 2's MLP output (or its attention
output) at token 20 is named at that point, with the layer's earlier points agreeing; with the
attention input alone it reads "layer 3, token 20" for both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dumper
from comparator import compare_dumps
from dumper.format import load_manifest
from dumper.format.reader import DumpReader
from dumper.format.sketch import SketchSpec
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import prompt_ids, run_cli, tiny_llama

SUBLAYER = "input,residual,attn_output,mlp_input,mlp_output"
LAYER, TOKEN = 2, 20


def _rows(path, name: str) -> np.ndarray:
    reader = DumpReader(path)
    return np.concatenate([reader.rows(t) for t in load_manifest(path).tensors if t.name == name])


def _bug(module, args, kwargs, output):
    """Adds to the module's output at token TOKEN (an index, not a data branch: torch.compile traces it)."""
    hidden = output[0] if isinstance(output, tuple) else output
    hidden[:, TOKEN].add_(0.5 * hidden.abs().mean())
    return output


def test_each_point_records_what_a_plain_hook_sees(tmp_path):
    model, tok = tiny_llama()
    ids = prompt_ids(tok, 48)
    seen: dict[str, torch.Tensor] = {}
    layer = model.model.layers[LAYER]
    handles = [
        layer.self_attn.register_forward_hook(lambda m, a, o: seen.__setitem__("attn", o[0].detach().clone())),
        layer.mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("mlp_in", a[0].detach().clone())),
        layer.mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("mlp_out", o.detach().clone())),
    ]
    try:
        with torch.inference_mode():
            model(ids)
            plain = model(ids).logits
            with dumper.capture(model, tmp_path / "d", layers=[LAYER], points=SUBLAYER):
                captured = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(plain, captured)  # the probe changes nothing
    for key, name in (("attn", "self_attn.output"), ("mlp_in", "mlp.input"), ("mlp_out", "mlp.output")):
        assert np.array_equal(_rows(tmp_path / "d", f"model.layers.{LAYER}.{name}"), seen[key][0].numpy()), name
    points = {(t.name, t.point) for t in load_manifest(tmp_path / "d").tensors}
    assert points == {
        (f"model.layers.{LAYER}.{n}", p)
        for n, p in (
            ("residual", "residual"),
            ("self_attn.input", "input"),
            ("self_attn.output", "attn_output"),
            ("mlp.input", "mlp_input"),
            ("mlp.output", "mlp_output"),
        )
    }


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A baseline and the same run with a bug in layer 2's MLP output, then in its attention output, at token 20."""
    root = tmp_path_factory.mktemp("sublayer")
    model, _ = tiny_llama()
    seqs = [list(range(3, 51))]

    def run(name: str) -> None:  # every point, and the attention input alone
        dump_sequences(model, seqs, RunConfig(out=str(root / name), layers="all", points=SUBLAYER))
        dump_sequences(model, seqs, RunConfig(out=str(root / f"{name}-input"), layers="all"))

    run("base")
    for where, module in (("mlp", model.model.layers[LAYER].mlp), ("attn", model.model.layers[LAYER].self_attn)):
        handle = module.register_forward_hook(_bug, with_kwargs=True)
        try:
            run(where)
        finally:
            handle.remove()
    return root


@pytest.mark.parametrize(
    "where,point,name,agree",
    [
        ("mlp", "mlp_output", "mlp.output", ["residual", "input", "attn_output", "mlp_input"]),
        ("attn", "attn_output", "self_attn.output", ["residual", "input"]),
    ],
)
def test_the_verdict_names_the_first_divergent_point_inside_the_layer(dumps, where, point, name, agree):
    report = compare_dumps(dumps / "base", dumps / where)
    fd = report.first_divergent
    assert fd is not None and not report.passed
    assert (fd.layer, fd.point, fd.name, fd.token) == (LAYER, point, f"model.layers.{LAYER}.{name}", TOKEN)
    assert fd.agreeing == agree
    r = run_cli("comparator", dumps / "base", dumps / where, "--quiet", "--json", dumps / f"{where}.json")
    words = {"mlp": "layer 2's MLP output (model.layers.2.mlp.output", "attn": "layer 2's attention output"}[where]
    assert r.returncode == 1 and words in r.stdout and " agree" in r.stdout, r.stdout
    assert json.loads((dumps / f"{where}.json").read_text())["first_divergent"]["point"] == point


def test_without_the_points_inside_the_layer_both_bugs_read_as_the_next_layer(dumps):
    for where in ("mlp", "attn"):
        fd = compare_dumps(dumps / "base-input", dumps / f"{where}-input").first_divergent
        assert fd is not None and (fd.layer, fd.token, fd.point, fd.agreeing) == (LAYER + 1, TOKEN, "input", [])


def test_a_sketch_projects_the_points_inside_the_layer_and_still_names_the_point(dumps, tmp_path):
    model, _ = tiny_llama()
    seqs = [list(range(3, 51))]
    handle = model.model.layers[LAYER].mlp.register_forward_hook(_bug, with_kwargs=True)
    try:
        dump_sequences(
            model, seqs, RunConfig(out=str(tmp_path / "mlp"), layers="all", points=SUBLAYER, sketch=SketchSpec(k=16))
        )
    finally:
        handle.remove()
    sketched = [t for t in load_manifest(tmp_path / "mlp").tensors if t.point in ("attn_output", "mlp_output")]
    assert sketched and all(t.sketch is not None and t.shape[-1] == 16 for t in sketched)
    fd = compare_dumps(dumps / "base", tmp_path / "mlp").first_divergent  # a full baseline, read as a sketch
    assert fd is not None and (fd.layer, fd.point, fd.token) == (LAYER, "mlp_output", TOKEN)
