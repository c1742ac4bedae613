"""``compare_drills`` and ``python -m comparator drill A B`` on real drill logs of tiny-llama's layer 2 MLP.

The logs are recorded for real: :class:`~dumper.hooks.drill.record.OpRecorder` watches the MLP of one
bfloat16 model while it runs 30 positions, storing the rows of tokens 5 and 20, and
:func:`~dumper.hooks.drill.record.write_log` writes each log as ``python -m dumper drill`` does. Side B's fault is a
real op-level one: a CPU kernel registered for ``aten::silu`` (``torch.library``) that scales token
20's row by 1.25 (and leaves float64, the recorder's reference, exact). A "split" build computes the
activation as ``x.float() * sigmoid(x.float())`` cast back: other ops at that path, the same module
output, and every later op one index further. Ratios worked out by hand: :func:`test_row_ratios_by_hand`.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from comparator.drill import Basis, DrillComparison, Pairing, PathStatus, align_ops, compare_drills, row_ratios
from comparator.drill.align import path_order
from dumper.errors import NotComparableError
from dumper.format.drill import DRILL_NAME, ROWS_NAME, load_drill
from dumper.format.dtypes import unit_roundoff
from dumper.hooks.drill.record import OpRecorder, write_log
from dumper.prefill.presets import load_model
from tests.conftest import run_cli

LAYER = 2
HALF = f"model.layers.{LAYER}.mlp"
N = 30
TOKENS = [5, 20]
BAD_TOKEN = 20
GATE, ACT, UP, DOWN = (f"{HALF}.{m}" for m in ("gate_proj", "act_fn", "up_proj", "down_proj"))


HEADER = {"layer": LAYER, "half": "mlp", "engine": "hf", "dtype": "bfloat16", "model": "tiny-llama"}
"""What a drill's header says besides the recorder's own fields (``dumper.jobs.drill`` adds more)."""


@contextlib.contextmanager
def silu_fault() -> Iterator[None]:
    """aten::silu on CPU, with token ``BAD_TOKEN``'s row scaled by 1.25 unless it runs in float64."""

    def bad_silu(x: torch.Tensor) -> torch.Tensor:
        y = (x.float() * torch.sigmoid(x.float())).to(x.dtype)  # not aten::silu: no recursion
        if x.dtype != torch.float64:
            y[..., BAD_TOKEN, :] *= 1.25
        return y

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("silu", bad_silu, "CPU")
    try:
        yield
    finally:
        lib._destroy()


class SplitSiLU(nn.Module):
    """SiLU as a build that does not call the fused kernel: upcast, sigmoid, multiply, cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.sigmoid(x.float())).to(x.dtype)


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> dict[str, Path]:
    """Drill logs of one model's layer 2 MLP: ``a``, ``a2`` (two clean runs), ``b`` (the silu fault), ``split``
    (the activation split into four ops), ``split_up`` (split, and one weight of up_proj moved), ``late``
    (clean, storing tokens 20 and 25) and ``other`` (clean, storing token 7 only)."""
    root = tmp_path_factory.mktemp("drills")
    model, _ = load_model("tiny-llama", dtype="bfloat16")
    mlp = model.model.layers[LAYER].mlp
    torch.manual_seed(0)
    x = torch.randn(1, N, model.config.hidden_size).to(model.dtype)

    def record(name: str, tokens: list[int] = TOKENS) -> Path:
        rec = OpRecorder(half_path=HALF, positions=range(N), tokens=tokens)
        with torch.inference_mode(), rec.watch(mlp, HALF), rec:
            mlp(x)
        return write_log(root / name, HEADER, rec)

    out = {name: record(name) for name in ("a", "a2")}
    out["late"] = record("late", [20, 25])
    out["other"] = record("other", [7])
    with silu_fault():
        out["b"] = record("b")
    act, mlp.act_fn = mlp.act_fn, SplitSiLU()
    try:
        out["split"] = record("split")
        with torch.no_grad():
            mlp.up_proj.weight[0, 0] += 8.0
        out["split_up"] = record("split_up")
        with torch.no_grad():
            mlp.up_proj.weight[0, 0] -= 8.0
    finally:
        mlp.act_fn = act
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(root: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    meta = json.loads((root / DRILL_NAME).read_text())
    change(meta)
    (root / DRILL_NAME).write_text(json.dumps(meta))
    return root


# the metric, by hand


def test_unit_roundoffs_are_the_rounding_models():
    assert [unit_roundoff(d) for d in ("float64", "float32", "bfloat16", "float16")] == [
        2.0**-53,
        2.0**-24,
        2.0**-8,
        2.0**-11,
    ]
    assert unit_roundoff("int64") == unit_roundoff("bool") == 0.0


def test_row_ratios_by_hand():
    """One bfloat16 ulp (2^-7 at 1) in one of four elements: rms(a - b) = 2^-7 / 2 = 2^-8, each side's bound
    rms is (2^-8 + 2^-24) * rms(|x|): the ratio is just under 2^-8 / (2 * 2^-8) = 0.5."""
    scale = 2.0**-8 + 2.0**-24  # u(bfloat16) + u(float32) * sqrt(1)
    a = np.ones((1, 4))
    b = np.array([[1.0, 1.0, 1.0, 1.0 + 2.0**-7]])
    rms_b = math.sqrt((3 + (1 + 2.0**-7) ** 2) / 4)
    assert row_ratios(a, b, scale, scale)[0] == pytest.approx(2.0**-8 / (scale * (1 + rms_b)), rel=1e-12)
    assert row_ratios(a, b, scale, scale)[0] == pytest.approx(0.4995, abs=1e-4)
    # scaling both rows changes nothing; equal rows are 0 whatever their dtype
    assert row_ratios(a * 1e300, b * 1e300, scale, scale)[0] == pytest.approx(row_ratios(a, b, scale, scale)[0])
    assert row_ratios(a, a, 0.0, 0.0)[0] == 0.0


@pytest.mark.parametrize(
    ("x", "y", "want"),
    [
        (math.nan, math.nan, 0.0),  # the same NaN on both sides: exact
        (math.inf, math.inf, 0.0),
        (math.nan, 1.0, math.inf),  # a NaN never passes
        (math.inf, 1.0, math.inf),
        (-math.inf, math.inf, math.inf),
    ],
)
def test_a_non_finite_mismatch_is_infinite(x, y, want):
    a = np.array([[1.0, x], [2.0, 3.0]])
    b = np.array([[1.0, y], [2.0, 3.0]])
    assert list(row_ratios(a, b, 2.0**-8, 2.0**-8)) == [want, 0.0]


def test_integers_must_be_equal():
    a, b = np.array([[1.0, 2.0]]), np.array([[1.0, 3.0]])
    assert row_ratios(a, b, 0.0, 0.0)[0] == math.inf


# alignment, planned from the op lists


def test_path_order_keeps_each_sides_order():
    assert path_order(["p", "q", "r"], ["p", "x", "q", "r", "y"]) == ["p", "x", "q", "r", "y"]
    assert path_order(["p", "q"], ["z", "q"]) == ["z", "p", "q"]


def test_a_split_op_pairs_the_module_output_and_keeps_the_other_slots(drills):
    a, split = load_drill(drills["a"]), load_drill(drills["split"])
    plans = {p.path: p for p in align_ops(a.ops, split.ops)}
    assert list(plans) == [GATE, ACT, UP, HALF, DOWN]
    act = plans[ACT]
    assert act.pairing is Pairing.OUTPUT and [o.short_name for o in act.ops_a] == ["aten.silu"]
    assert "aten.sigmoid" in [o.short_name for o in act.ops_b]
    assert act.pairs[0][1] is [o for o in act.ops_b if o.rows is not None][-1]  # the module's output
    for path in (UP, HALF, DOWN):  # every later op sits further along B's log, yet meets its own
        ((oa, ob),) = plans[path].pairs
        assert plans[path].pairing is Pairing.SLOTS and oa.op == ob.op and ob.index > oa.index


# compare_drills


def test_two_clean_runs_agree_bit_for_bit(drills):
    result = compare_drills(drills["a"], drills["a2"])
    assert result and result.passed and result.first_path is None
    assert [p.status for p in result.paths] == [PathStatus.PASS] * 5
    assert all(p.ratio == 0.0 and p.token is None for p in result.paths)
    assert result.summary == "PASS: 5 paths agree bit for bit (factor 16)"
    assert result.a.first_beyond is None and result.b.first_beyond is None
    assert result.notes == ()


def test_a_faulty_kernel_is_named_with_its_token(drills):
    result = compare_drills(drills["a"], drills["b"])
    assert not result and result.first_path == ACT
    act = result.first
    assert act is not None and act.token == BAD_TOKEN and act.ratio is not None and act.ratio > result.factor
    assert [o.op for o in act.ops_a] == [o.op for o in act.ops_b] == ["aten.silu"]
    assert result.paths[0].path == GATE and result.paths[0].ratio == 0.0  # the path before it agrees
    assert result.summary.startswith(
        f"DIVERGED at {ACT}: A aten.silu [1, 30, 192] bfloat16 vs B aten.silu [1, 30, 192] bfloat16, "
    )
    assert result.summary.endswith(
        f"x the two sides' rounding at token {BAD_TOKEN} (the path before it agrees bit for bit)"
    )
    # each side's own verdict against float64: B's silu is beyond its rounding, A has nothing
    assert result.b.first_beyond is not None and result.b.first_beyond.path == ACT
    assert result.b.first_beyond_token == BAD_TOKEN and result.a.first_beyond is None
    # a factor above the ratio passes it
    assert compare_drills(drills["a"], drills["b"], factor=act.ratio * 2)


def test_a_split_op_still_aligns_the_other_paths(drills):
    result = compare_drills(drills["a"], drills["split"])
    assert result.passed, result.summary
    by = {p.path: p for p in result.paths}
    assert by[ACT].pairing is Pairing.OUTPUT and by[ACT].ratio is not None and by[ACT].ratio < 1
    assert "aten.sigmoid" in [o.op for o in by[ACT].ops_b]
    assert by[GATE].ratio == by[UP].ratio == 0.0
    assert any(n.startswith(f"{ACT}: A dispatched aten.silu; B aten.to.dtype, ") for n in result.notes), result.notes
    # and a fault after the split op is found at its own path
    result = compare_drills(drills["a"], drills["split_up"])
    assert result.first_path == UP, result.summary
    assert [p.status for p in result.paths[:2]] == [PathStatus.PASS, PathStatus.PASS]


def test_different_tokens_compare_at_the_common_ones(drills):
    result = compare_drills(drills["a"], drills["late"])
    assert result.passed and all(q.basis is Basis.ROWS for p in result.paths for q in p.pairs)
    assert result.notes == ("A stores tokens [5, 20], B [20, 25]: compared at the common positions [20]",)
    result = compare_drills(drills["late"], drills["b"])
    assert result.first_path == ACT and result.first is not None and result.first.token == BAD_TOKEN


def test_no_common_token_falls_back_to_hashes(drills):
    result = compare_drills(drills["a"], drills["other"])
    assert result.passed and all(q.basis is Basis.HASH for p in result.paths for q in p.pairs)
    result = compare_drills(drills["other"], drills["b"])  # the hashes tell where they part, not by how much
    by = {p.path: p for p in result.paths}
    assert by[GATE].status is PathStatus.PASS and by[ACT].status is PathStatus.NOT_COMPARED
    assert by[ACT].pairs[0].basis is Basis.UNKNOWN and "not compared: " + ACT in result.summary


def test_drills_of_different_halves_do_not_compare(drills, tmp_path):
    other = _edit(_copy(drills["a2"], tmp_path / "l3"), lambda m: m.update(layer=3))
    with pytest.raises(NotComparableError, match=r"l3/drill.json is layer 3 MLP") as e:
        compare_drills(drills["a"], other)
    assert f"{drills['a'] / DRILL_NAME} is layer 2 MLP" in str(e.value)


def test_nothing_aligned_is_unusable(drills, tmp_path):
    def blind(meta: dict[str, Any]) -> None:
        for op in meta["ops"]:
            op.update(rows=None, hash="0" * 16)

    b = _edit(_copy(drills["b"], tmp_path / "blind"), blind)
    with pytest.raises(NotComparableError, match="no op aligned between A"):
        compare_drills(drills["a"], b)


def test_the_comparison_round_trips_through_json(drills):
    for other in ("a2", "b", "split", "other"):
        result = compare_drills(drills["a"], drills[other])
        text = json.dumps(result.to_json(), allow_nan=False)
        back = DrillComparison.from_json(json.loads(text))
        assert back == result and back.summary == result.summary and back.to_json() == result.to_json()


# the command line, in real subprocesses


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout
    for needle in needles:
        assert needle in r.stderr, r.stderr


@pytest.mark.slow
def test_cli_exit_codes_and_outputs(drills, tmp_path):
    r = run_cli("comparator", "drill", drills["a"], drills["a2"])
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "PASS: 5 paths agree bit for bit (factor 16)"
    r = run_cli("comparator", "drill", drills["a"], drills["b"], "--json", tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith(f"DIVERGED at {ACT}: A aten.silu") and f"at token {BAD_TOKEN}" in last, r.stdout
    assert "FAIL" in r.stdout and ACT in r.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["first_path"] == ACT and saved["passed"] is False and saved["summary"] == last
    r = run_cli("comparator", "drill", drills["a"], drills["b"], "--json", "-")
    assert r.returncode == 1 and json.loads(r.stdout)["first_path"] == ACT, r.stdout + r.stderr
    r = run_cli("comparator", "drill", drills["a"], drills["b"], "--factor", "1e9")
    assert r.returncode == 0, r.stdout + r.stderr


def _missing_meta(root: Path) -> None:
    (root / DRILL_NAME).unlink()


def _not_json(root: Path) -> None:
    (root / DRILL_NAME).write_text('{"format": "driftscope-drill", "ops": [')


def _wrong_shape_rows(root: Path) -> None:
    rows = load_file(str(root / ROWS_NAME))
    rows["op1"] = torch.zeros(2, 5, dtype=torch.bfloat16)
    save_file(rows, str(root / ROWS_NAME))


def _bare_nan_ratio(root: Path) -> None:
    text = (root / DRILL_NAME).read_text()
    meta = json.loads(text)
    meta["ops"][1]["ratio"] = math.nan
    (root / DRILL_NAME).write_text(json.dumps(meta))  # json writes NaN bare
    assert "NaN" in (root / DRILL_NAME).read_text()


def _nan_rows(root: Path) -> None:
    rows = load_file(str(root / ROWS_NAME))
    rows["op1"][0, 0, 0] = math.nan  # while drill.json says the op's output is finite
    save_file(rows, str(root / ROWS_NAME))


def _not_safetensors(root: Path) -> None:
    (root / ROWS_NAME).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00[1, 2] ")


def _missing_key(root: Path) -> None:
    rows = load_file(str(root / ROWS_NAME))
    del rows["op3"]
    save_file(rows, str(root / ROWS_NAME))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spoil", "needle"),
    [
        (_missing_meta, f"{DRILL_NAME}: missing"),
        (_not_json, f"{DRILL_NAME}: not JSON"),
        (_wrong_shape_rows, f"{ROWS_NAME}[op1] has shape [2, 5], not [2, 1, 192]"),
        (_bare_nan_ratio, "ops[1].ratio nan is not a ratio"),
        (_missing_key, "ops[3].rows names 'op3', which ops.safetensors does not hold"),
        (_nan_rows, "op1 holds NaN or Inf, but drill.json says op 1's output is finite"),
        (_not_safetensors, f"{ROWS_NAME}: not a safetensors file"),
    ],
    ids=["missing drill.json", "not JSON", "wrong-shape rows", "NaN ratio", "missing rows key", "NaN rows", "bad rows"],
)
def test_cli_refuses_a_hostile_log_in_one_line(drills, tmp_path, spoil, needle):
    bad = _copy(drills["b"], tmp_path / "bad")
    spoil(bad)
    r = run_cli("comparator", "drill", drills["a"], bad)
    _one_line_error(r, str(bad), needle)


@pytest.mark.slow
def test_cli_refuses_drills_that_do_not_compare(drills, tmp_path):
    other = _edit(_copy(drills["a2"], tmp_path / "attn"), lambda m: m.update(half="attn"))
    _one_line_error(run_cli("comparator", "drill", drills["a"], other), str(drills["a"]), str(other), "attention")
    _one_line_error(run_cli("comparator", "drill", drills["a"], tmp_path / "nowhere"), "no such drill directory")
    _one_line_error(run_cli("comparator", "drill", drills["a"], drills["b"], "--factor", "0"), "factor 0.0")
