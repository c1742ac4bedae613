"""``python -m dumper replay --split [--reference float64]``: what each half of a layer adds, on the tiny HF Llama.

A bug seeded in layer 2's MLP (or its attention) of the model under test is named as that half's
cause, every other half adding nothing; against a float64 reference, a bfloat16 side is the one
that is off, whichever side it is. On a tiny Mixtral whose layer-1 gate row of expert 6 is moved,
the MoE block is the cause, its flips are recorded, and with the baseline's experts forced
(``--force-routing``) the block adds what its weights alone add: nothing with ``all``.
"""

from __future__ import annotations

import pytest

from comparator import compare_dumps
from comparator.hidden.onset import rounding_floor
from dumper.errors import ModelMismatchError
from dumper.jobs.replay_split import split_replay_model
from dumper.prefill.presets import load_model
from dumper.prefill.run import RunConfig, dump_sequences
from tests.conftest import run_cli, tiny_llama
from tests.moe_models import moved_gate_checkpoints

pytestmark = pytest.mark.slow

POINTS = "input,attn_output,mlp_input,mlp_output"
LAYER, TOKEN = 2, 20
SEQS = [list(range(3, 51)), list(range(60, 90))]


def _bug(module, args, kwargs, output):
    """Adds to the module's output at token TOKEN (an index: no data branch)."""
    hidden = output[0] if isinstance(output, tuple) else output
    hidden[:, TOKEN].add_(0.5 * hidden.abs().mean())
    return output


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    model, _ = tiny_llama()
    dump_sequences(model, SEQS, RunConfig(out=str(root / "base"), layers="all", points=tuple(POINTS.split(","))))
    return root


@pytest.mark.parametrize("half,child", [("MLP", "mlp"), ("attention", "self_attn")])
def test_a_bug_in_one_half_is_that_halfs_cause_and_no_other_half_adds_anything(base, tmp_path, half, child):
    model, _ = tiny_llama()
    handle = getattr(model.model.layers[LAYER], child).register_forward_hook(_bug, with_kwargs=True)
    try:
        halves = split_replay_model(model, base / "base", tmp_path / "split")
    finally:
        handle.remove()
    assert [(h.layer, h.half) for h in halves] == [(k, x) for k in range(8) for x in ("attention", "MLP")]
    bugged = next(h for h in halves if (h.layer, h.half) == (LAYER, half))
    assert bugged.cause and bugged.rel_diff > 1e3 * rounding_floor(["F32"])
    assert all(h.rel_diff <= rounding_floor(["F32"]) and not h.cause for h in halves if h is not bugged)
    fd = compare_dumps(base / "base", tmp_path / "split").first_divergent  # the dump judges the halves too
    assert fd is not None and (fd.layer, fd.token, fd.name) == (LAYER, TOKEN, bugged.name)


@pytest.mark.parametrize(
    "baseline_dtype,target_dtype,off", [("float32", "bfloat16", "target's"), ("bfloat16", "float32", "baseline's")]
)
def test_the_float64_reference_says_which_side_is_off(tmp_path, baseline_dtype, target_dtype, off):
    r = run_cli(
        "dumper",
        "run",
        "--layers",
        "0,1",
        "--points",
        POINTS,
        "--dtype",
        baseline_dtype,
        "--input-ids",
        ",".join(map(str, SEQS[0])),
        "--out",
        tmp_path / "base",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    r = run_cli(
        "dumper",
        "replay",
        "--baseline",
        tmp_path / "base",
        "--dtype",
        target_dtype,
        "--split",
        "--reference",
        "float64",
        "--out",
        tmp_path / "split",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["layer 0", "layer 1"]
    assert all(line.count(f"the {off} is off]") == 2 for line in lines), r.stdout


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ("--split",),
            "holds no 'attn_output' point; re-run it with `python -m dumper run ... --points input,attn_output",
        ),
        (("--reference", "float64"), "--reference needs --split"),
    ],
)
def test_what_split_replay_cannot_do_is_one_line(tmp_path, args, words):
    r = run_cli("dumper", "run", "--layers", "0", "--input-ids", "1,2,3,4", "--out", tmp_path / "base", "--quiet")
    assert r.returncode == 0, r.stderr
    r = run_cli("dumper", "replay", "--baseline", tmp_path / "base", *args, "--out", tmp_path / "split")
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "split").exists()


def test_forcing_experts_needs_the_router_point_in_the_baseline(base, tmp_path):
    r = run_cli(
        "dumper",
        "replay",
        "--baseline",
        base / "base",
        "--split",
        "--force-routing",
        "ids",
        "--out",
        tmp_path / "split",
    )
    words = "holds no 'router' point, so there is no expert choice to force"
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "split").exists()


def test_the_model_must_be_the_baselines(base, tmp_path):
    other, _ = load_model("tiny-qwen2")
    with pytest.raises(ModelMismatchError, match="the baseline's model has num_layers 8, tiny-qwen2 has 6"):
        split_replay_model(other, base / "base", tmp_path / "split")
    assert not (tmp_path / "split").exists()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Mixtral baseline dump (every half's ends and the router point), and a checkpoint of it whose layer-1
    gate row of expert 6 is moved by half its norm (its experts and attention untouched)."""
    root = tmp_path_factory.mktemp("split-moe")
    moved_gate_checkpoints(root)
    ids = [a for p in SEQS for a in ("--input-ids", ",".join(str(t % 250 + 3) for t in p))]
    r = run_cli(
        "dumper",
        "run",
        "--model",
        root / "ref",
        "--out",
        root / "base",
        "--points",
        POINTS + ",router",
        "--layers",
        "all",
        "--quiet",
        *ids,
    )
    assert r.returncode == 0, r.stderr
    return root


def _moe_split(root, mode: str | None) -> tuple[list[str], object]:
    """``replay --split --reference float64`` of the moved-gate checkpoint (``--force-routing mode``): its lines and
    the comparator's report of the dump it wrote."""
    out = root / (mode or "plain")
    force = ["--force-routing", mode] if mode else []
    r = run_cli(
        "dumper",
        "replay",
        "--model",
        root / "bug",
        "--baseline",
        root / "base",
        "--split",
        "--reference",
        "float64",
        "--out",
        out,
        "--quiet",
        *force,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines(), compare_dumps(root / "base", out)


def test_split_replay_of_an_moe_block_records_its_flips_and_names_it_the_cause(moe):
    lines, report = _moe_split(moe, None)
    assert lines[1].startswith("layer 1: attention adds 0 [") and "MLP adds" in lines[1], lines
    assert "(the cause)" in lines[1].split("MLP adds")[1], lines
    assert all("MLP adds 0 [" in line for i, line in enumerate(lines) if i != 1), lines
    flips = {la.layer: la.flips for la in report.router.layers}
    assert flips[1] > 0 and flips[0] == flips[2] == 0, flips  # each block on the baseline's own input
    # inside the block, the gate's logits come before its output: the moved gate row is named first
    assert not report.passed and report.first_divergent.name == "model.layers.1.router.logits"


@pytest.mark.parametrize("mode", ["ids", "all"])
def test_forcing_the_baselines_experts_leaves_what_the_blocks_weights_add(moe, mode):
    """``all``: the experts and their weights are the baseline's, so the block adds exactly nothing (its experts are
    the baseline's weights); ``ids``: what is left is the moved gate's own combine weights. The float64 reference
    takes the same experts, so both sides stay measured against one choice."""
    lines, report = _moe_split(moe, mode)
    assert "MLP (the baseline's experts, " + mode + ") adds" in lines[1], lines
    assert report.router.flips == 0  # the forced choice is what the dump records
    mlp1 = next(t for t in report.tensors if t.name == "model.layers.1.mlp.output")
    if mode == "all":
        assert mlp1.metrics["rel_diff"] == 0.0, lines
        # what still differs is the gate's own output, recorded as the moved gate computed it
        assert {t.name for t in report.tensors if not t.passed} == {"model.layers.1.router.logits"}
        assert "baseline 0, target 0]" not in lines[1] and lines[1].count("vs float64: baseline") == 2
        b, t = lines[1].split("MLP")[1].split("[vs float64: baseline ")[1].split("]")[0].split(", target ")
        assert b == t.split(":")[0], lines[1]  # one computation, one error against the reference
    else:
        assert mlp1.metrics["rel_diff"] > 0 and report.router.layers[1].weight_max_err > 0
