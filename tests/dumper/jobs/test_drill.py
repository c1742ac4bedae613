"""``dumper.jobs.drill`` on transformers: bugs seeded inside one op of tiny-llama are named with their module and
token; the repro runs alone; what the drill, its repro and its log cannot use is refused in one line.

Each seed replaces one aten CPU kernel (``torch.library``) with one that computes the right value without
calling the op it replaces, except at one shape (a token count of :data:`N`), where it gets row :data:`T`
wrong; float64, the drill's reference, stays exact, so only the op itself is wrong:

- ``silu``: ``aten::silu`` adds half the row's mean magnitude to row T. The drill of layer 2's MLP names
  ``aten.silu`` at ``model.layers.2.mlp.act_fn``, token T;
- ``gemm``: ``aten::mm`` at the down projection's shape (K, N) = (intermediate, hidden) does the same to its
  output's row T. HF's ``Linear`` dispatches ``aten.linear`` (what the dispatch mode sees); on CPU its
  composite kernel folds the [1, n, K] input and runs ``aten::mm`` on [n, K] x [K, N] (the op that computes);
  the drill names ``aten.linear`` at ``model.layers.2.mlp.down_proj``;
- ``softmax``: ``aten::_softmax`` (eager attention's ``softmax(scores, dtype=float32)`` dispatches
  ``aten.softmax.int``, whose CPU kernel casts and calls ``aten::_softmax``) scales query row T's scores by 1.5
  before it normalizes: a softmax-scale bug inside the kernel. The drill of layer 5's attention names
  ``aten.softmax.int`` at ``model.layers.5.self_attn``, token T.

In each, every other judged op (before it and after it, each judged on its own inputs) is within
:data:`WITHIN` times its rounding. On the real trained checkpoint (SmolLM2), clean halves have no op beyond it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comparator import compare_dumps
from dumper.errors import DumpError
from dumper.format import DumpReader, to_float64
from dumper.format.drill import DRILL_NAME, ROWS_NAME, DrillLog, load_drill, read_rows
from dumper.hooks.drill.repro import REPRO_INPUTS, REPRO_META, REPRO_SCRIPT
from dumper.jobs.drill import DrillConfig, DrillTarget, drill, drill_halves
from dumper.prefill.run import RunConfig, dump_sequences, run_dump
from tests.conftest import run_cli, subprocess_env, tiny_llama
from tests.real_model import real_prompt_ids, smollm2_dir

N, T = 24, 20
"""The seeded kernels' token count (the prompt's length) and the row they get wrong."""
INTER, HIDDEN = 192, 64
"""tiny-llama's intermediate and hidden sizes: the down projection's (K, N)."""
IDS = list(range(5, 5 + N))
POINTS = ("input", "attn_output", "mlp_input", "mlp_output")
MLP_LAYER, ATTN_LAYER = 2, 5
WITHIN = 2.0
"""An op that rounds as its dtype predicts stays well within this many times its rounding (measured: under 0.9)."""
FACTOR = 16.0
"""The drill's default ``--factor``."""


# the seeded kernels: each the right value (not through the op it replaces), wrong at row T of one shape


def bad_silu(x: torch.Tensor) -> torch.Tensor:
    y = x * torch.special.expit(x)  # not aten::silu: no recursion
    if x.dtype != torch.float64 and x.dim() == 3 and x.shape[1] == N:
        y[0, T] += 0.5 * y[0, T].abs().mean()
    return y


def bad_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.bmm(a[None], b[None])[0]  # not aten::mm: no recursion
    if a.dtype != torch.float64 and a.shape[0] == N and tuple(b.shape) == (INTER, HIDDEN):
        y[T] += 0.5 * y[T].abs().mean()
    return y


def bad_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    s = x.clone()
    if x.dtype != torch.float64 and x.dim() == 4 and x.shape[-2] == N:
        s[..., T, :] *= 1.5  # query row T's scores scaled again inside the kernel
    e = (s - s.amax(dim, keepdim=True)).exp()  # not aten::_softmax: no recursion
    y = e / e.sum(dim, keepdim=True)
    return y.float() if half_to_float else y


SEEDS: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    "silu": ("silu", bad_silu),
    "gemm": ("mm", bad_mm),
    "softmax": ("_softmax", bad_softmax),
}
"""Seed -> the aten op whose CPU kernel it replaces, and the kernel."""
EXPECT = {
    "silu": ("mlp", MLP_LAYER, "aten.silu.default", f"model.layers.{MLP_LAYER}.mlp.act_fn"),
    "gemm": ("mlp", MLP_LAYER, "aten.linear.default", f"model.layers.{MLP_LAYER}.mlp.down_proj"),
    "softmax": ("attn", ATTN_LAYER, "aten.softmax.int", f"model.layers.{ATTN_LAYER}.self_attn"),
}
"""Seed -> the half it is drilled in, its layer, and the op and module path the drill must name."""


@contextlib.contextmanager
def seeded(seed: str) -> Iterator[None]:
    """Inside: the seed's kernel replaces the aten op's CPU kernel; restored on the way out."""
    op, kernel = SEEDS[seed]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(op, kernel, "CPU")
    try:
        yield
    finally:
        lib._destroy()


WRAPPER = '''\
"""python seed.py repro.py ARGS | python seed.py -m MODULE ARGS, with a seeded aten::{op} CPU kernel."""
import runpy
import sys
import warnings

import torch

N, T, INTER, HIDDEN = {consts}

{source}

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lib = torch.library.Library("aten", "IMPL")
    lib.impl({op!r}, {name}, "CPU")
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
'''


def seed_script(seed: str, where: Path) -> Path:
    """A script that installs the seed's kernel (the same source), then runs a script or a module."""
    op, kernel = SEEDS[seed]
    text = WRAPPER.format(
        op=op, name=kernel.__name__, consts=f"{N}, {T}, {INTER}, {HIDDEN}", source=inspect.getsource(kernel)
    )
    path = where / f"seed_{seed}.py"
    path.write_text(text)
    return path


def run_py(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, env=subprocess_env(), cwd=cwd, timeout=600
    )


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str, prefix: str = "") -> None:
    """Exit 2, exactly one line on stderr (starting with ``prefix``) holding every needle, no traceback."""
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(prefix), r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


# the dumps and drills, once per module


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The float32 transformers baseline of one N-token prompt, every layer, with the sub-layer points."""
    out = tmp_path_factory.mktemp("drill") / "base"
    model, _ = tiny_llama()
    dump_sequences(model, [IDS], RunConfig(out=str(out), layers="all", points=POINTS, input_ids=(tuple(IDS),)))
    return out


@pytest.fixture(scope="module")
def drills(base: Path) -> dict[tuple[str, str], DrillLog]:
    """(seed, dtype) -> the drill of the seed's half under the seed; ``silu`` in bfloat16 also writes a repro
    (``base.parent / "repro"``)."""
    logs = {}
    for seed, (half, layer, _, _) in EXPECT.items():
        for dtype in ("float32", "bfloat16"):
            repro = str(base.parent / "repro") if (seed, dtype) == ("silu", "bfloat16") else None
            cfg = DrillConfig(
                baseline=str(base),
                out=str(base.parent / f"{seed}-{dtype}"),
                dtype=dtype,
                layer=layer,
                half=half,
                repro=repro,
            )
            with seeded(seed):
                logs[seed, dtype] = drill(cfg)
    return logs


# seeded op bugs: the drill names the op, its module and the token


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", list(EXPECT))
def test_a_seeded_op_is_named_with_its_module_and_token(drills, seed: str, dtype: str) -> None:
    log = drills[seed, dtype]
    half, layer, op, path = EXPECT[seed]
    bad = log.first_beyond()
    assert bad is not None, log.summary()
    assert (bad.op, bad.path, bad.ratio_token) == (op, path, T), log.summary()
    assert bad.ratio is not None and bad.ratio > 4 * FACTOR, log.summary()  # clearly beyond, not borderline
    assert log.header["first_beyond"] == bad.index and (log.layer, log.half) == (layer, half)
    before = [o for o in log.ops if o.judged and o.index < bad.index]
    others = [o for o in log.ops if o.judged and o.index != bad.index]
    assert before, log.summary()
    assert max(o.ratio for o in others) < WITHIN, [(o.op, o.path, o.ratio) for o in others]
    summary = log.summary()
    assert summary.startswith(f"layer {layer} {'MLP' if half == 'mlp' else 'attention'}: {bad.short_name} ({path}, ")
    assert f"at token {T}; the {len(before)} ops before it are within" in summary, summary


@pytest.mark.parametrize("seed", list(EXPECT))
def test_without_the_seed_the_same_half_has_no_op_beyond(base: Path, tmp_path: Path, seed: str) -> None:
    half, layer, _, _ = EXPECT[seed]
    for dtype in ("float32", "bfloat16"):
        cfg = DrillConfig(baseline=str(base), out=str(tmp_path / dtype), dtype=dtype, layer=layer, half=half)
        log = drill(cfg)
        judged = [o for o in log.ops if o.judged]
        assert log.first_beyond() is None and log.header["first_beyond"] is None, log.summary()
        assert judged and max(o.ratio for o in judged) < WITHIN, [(o.op, o.path, o.ratio) for o in judged]


def _baseline_rows(base: Path, name: str) -> np.ndarray:
    reader = DumpReader(base)
    (rec,) = [r for r in reader.manifest.tensors if r.name == name and r.rank == 0]
    rows = to_float64(reader.rows(rec), rec.dtype)
    assert list(rec.row_positions()) == list(range(N))
    return rows


def test_the_silu_drill_by_hand(drills, base: Path) -> None:
    """The silu seed in bfloat16, worked out again from what the log stores: the silu op's per-row ratio is its
    error against float64 silu of the gate's stored output over the elementwise bound (u(bf16) + u(fp32)) |ref|,
    largest at T; the half's output (the down projection's rows) is furthest from the baseline's at T."""
    log = drills["silu", "bfloat16"]
    gate, act, *_, down = log.ops
    assert (gate.path, act.path, down.path) == tuple(
        f"model.layers.2.mlp.{m}" for m in ("gate_proj", "act_fn", "down_proj")
    )
    assert log.tokens == tuple(range(N))
    x, y = log.rows(gate), log.rows(act)  # [N, 1, 192] each, token first
    assert x is not None and y is not None and x.shape == y.shape == (N, 1, INTER)
    ref = x / (1 + np.exp(-x))
    bound = np.where(y == ref, 0.0, (2.0**-8 + 2.0**-24) * np.abs(ref))  # an exact element counts for nothing
    by_hand = np.sqrt(((y - ref) ** 2).reshape(N, -1).sum(1) / (bound**2).reshape(N, -1).sum(1))
    stored = read_rows(log.path, f"op{act.index}.ratio")
    assert stored.shape == (N,)
    np.testing.assert_allclose(stored, by_hand, rtol=1e-4)
    assert int(np.argmax(stored)) == T and act.ratio == pytest.approx(float(stored[T]), rel=1e-6)
    assert np.delete(stored, T).max() < WITHIN  # every other row rounds as bfloat16 does
    # the half's output against the baseline's, per token: worst at T, as the log's half_check says
    out = log.rows(down)
    assert out is not None and out.shape == (N, 1, HIDDEN)
    want = _baseline_rows(base, log.header["half_check"]["point"])
    per = np.linalg.norm(out.reshape(N, -1) - want, axis=1) / np.linalg.norm(want, axis=1)
    assert int(np.argmax(per)) == T == log.header["half_check"]["worst_token"]
    assert per[T] > 10 * np.delete(per, T).max()


# the repro, alone


@pytest.mark.slow
def test_the_repro_is_beyond_with_the_seeded_kernel_and_within_with_torchs(drills, base: Path, tmp_path: Path):
    repro = base.parent / "repro"
    meta = json.loads((repro / REPRO_META).read_text())
    assert (meta["op"], meta["path"], meta["token"]) == ("aten.silu.default", "model.layers.2.mlp.act_fn", T)
    r = run_py(seed_script("silu", tmp_path), repro / REPRO_SCRIPT, cwd=tmp_path)
    assert r.returncode == 1 and "BEYOND" in r.stdout and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("aten.silu.default at model.layers.2.mlp.act_fn: "), r.stdout
    r = run_py(repro / REPRO_SCRIPT, cwd=tmp_path)  # torch's own kernel on the same inputs
    assert r.returncode == 0 and "within" in r.stdout and "BEYOND" not in r.stdout, r.stdout + r.stderr


def _drop_input(root: Path) -> None:
    t = load_file(str(root / REPRO_INPUTS))
    del t["in.0"]
    save_file(t, str(root / REPRO_INPUTS))


def _wrong_shape(root: Path) -> None:
    t = load_file(str(root / REPRO_INPUTS))
    t["in.0"] = t["in.0"][:, :5].contiguous()
    save_file(t, str(root / REPRO_INPUTS))


def _nan_reference(root: Path) -> None:
    t = load_file(str(root / REPRO_INPUTS))
    t["reference.0"][0, 3, 7] = math.nan
    save_file(t, str(root / REPRO_INPUTS))


def _not_json(root: Path) -> None:
    (root / REPRO_META).write_text('{"op": "aten.silu.default", "args": [')


def _wrong_dtype(root: Path) -> None:
    t = load_file(str(root / REPRO_INPUTS))
    t["in.0"] = t["in.0"].float()  # float32 silu would pass where the bfloat16 kernel does not
    save_file(t, str(root / REPRO_INPUTS))


def _unknown_op(root: Path) -> None:
    meta = json.loads((root / REPRO_META).read_text())
    meta["op"] = "aten.no_such_op.default"
    (root / REPRO_META).write_text(json.dumps(meta))


def _header_not_object(root: Path) -> None:
    data = (root / REPRO_INPUTS).read_bytes()
    n = int.from_bytes(data[:8], "little")
    (root / REPRO_INPUTS).write_bytes((5).to_bytes(8, "little") + b"[1,2]" + data[8 + n :])


def _truncated(root: Path) -> None:
    data = (root / REPRO_INPUTS).read_bytes()
    (root / REPRO_INPUTS).write_bytes(data[: len(data) // 2])


def _truncated_header(root: Path) -> None:
    data = (root / REPRO_INPUTS).read_bytes()
    (root / REPRO_INPUTS).write_bytes(data[:20])


@pytest.mark.parametrize(
    ("spoil", "name", "needle"),
    [
        (_drop_input, REPRO_INPUTS, "in.0 (args[0]) is missing"),
        (_wrong_shape, REPRO_INPUTS, "in.0 has shape [1, 5, 192], repro.json says [1, 24, 192]"),
        (_nan_reference, REPRO_INPUTS, "reference.0 holds NaN"),
        (_not_json, REPRO_META, "unreadable"),
        (_wrong_dtype, REPRO_INPUTS, "in.0 is float32, repro.json says bfloat16"),
        (_unknown_op, REPRO_META, "op 'aten.no_such_op.default' is not an op of this torch"),
        (_header_not_object, REPRO_INPUTS, "not a safetensors file (its header is not an object)"),
        (_truncated, REPRO_INPUTS, "its bytes do not match its shape"),
        (_truncated_header, REPRO_INPUTS, "not a safetensors file"),
    ],
    ids=[
        "missing tensor",
        "wrong shape",
        "NaN reference",
        "repro.json not JSON",
        "wrong dtype",
        "unknown op",
        "header not an object",
        "truncated data",
        "truncated header",
    ],
)
@pytest.mark.slow
def test_a_hostile_repro_dir_is_one_line(drills, base: Path, tmp_path: Path, spoil, name: str, needle: str):
    bad = shutil.copytree(base.parent / "repro", tmp_path / "bad")
    spoil(bad)
    r = run_py(bad / REPRO_SCRIPT, cwd=tmp_path)
    one_line_error(r, needle, prefix=f"{bad / name}: ")
    assert r.stdout == "", r.stdout


# hostile logs: what tests/comparator/drill does not cover (missing drill.json, not JSON, wrong-shape rows,
# a bare NaN ratio and a rows key the rows file lacks are refused there)


def _edit_op(i: int, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def spoil(root: Path) -> None:
        meta = json.loads((root / DRILL_NAME).read_text())
        change(meta["ops"][i])
        (root / DRILL_NAME).write_text(json.dumps(meta))

    return spoil


def _no_ops(root: Path) -> None:
    meta = json.loads((root / DRILL_NAME).read_text())
    meta["ops"] = []
    (root / DRILL_NAME).write_text(json.dumps(meta))


def _truncated_rows(root: Path) -> None:
    data = (root / ROWS_NAME).read_bytes()
    (root / ROWS_NAME).write_bytes(data[:6])


def _swapped(root: Path) -> None:
    meta = json.loads((root / DRILL_NAME).read_text())
    meta["ops"][0], meta["ops"][1] = meta["ops"][1], meta["ops"][0]
    (root / DRILL_NAME).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("spoil", "needle"),
    [
        (_edit_op(1, lambda op: op.pop("rows")), "ops[1] lacks rows"),
        (_edit_op(1, lambda op: op.update(ratio=-1.0)), "ops[1].ratio -1.0 is not a ratio"),
        (_edit_op(1, lambda op: op.update(ratio_token=-3)), "ops[1].ratio_token -3 is not a position"),
        (_edit_op(1, lambda op: op.update(token_dim=7)), "ops[1].token_dim 7 is not a dimension of its first output"),
        (_edit_op(1, lambda op: op.update(rows="op4")), f"{ROWS_NAME}[op4] has shape [24, 1, 64], not [24, 1, 192]"),
        (_swapped, "ops[0].index is 1, not 0"),
        (_no_ops, "it lists no op"),
        (_truncated_rows, f"{ROWS_NAME}: not a safetensors file"),
    ],
    ids=[
        "rows field missing",
        "negative ratio",
        "bad token",
        "bad token_dim",
        "rows of another op",
        "out of order",
        "no ops",
        "truncated rows file",
    ],
)
def test_load_drill_refuses_a_hostile_log_naming_the_file(drills, tmp_path: Path, spoil, needle: str) -> None:
    bad = shutil.copytree(drills["silu", "bfloat16"].path, tmp_path / "bad")
    spoil(bad)
    with pytest.raises(DumpError) as e:
        load_drill(bad)
    assert str(bad) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# the command line: exit codes, and what it refuses in one line


@pytest.mark.slow
def test_cli_exit_codes(base: Path, tmp_path: Path) -> None:
    args = ("drill", "--baseline", base, "--layer", "2", "--half", "mlp", "--dtype", "bfloat16")
    r = run_py(seed_script("silu", tmp_path), "-m", "dumper", *args, "--out", tmp_path / "d", "--repro", tmp_path / "r")
    assert r.returncode == 1, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("layer 2 MLP: aten.silu (model.layers.2.mlp.act_fn, [1, 24, 192], bfloat16) is "), first
    assert f"at token {T}; the 1 ops before it are within" in first, first
    assert f"repro in {tmp_path / 'r'}" in r.stdout and (tmp_path / "r" / REPRO_SCRIPT).is_file()
    assert load_drill(tmp_path / "d").first_beyond() is not None
    r = run_cli("dumper", *args, "--out", tmp_path / "clean", "--repro", tmp_path / "r2")  # torch's own kernels
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("layer 2 MLP: no op beyond 16x its rounding (5 of 5 ops judged"), r.stdout
    assert "no repro written" in r.stdout and not (tmp_path / "r2").exists()


@pytest.fixture(scope="module")
def input_report(base: Path) -> tuple[Path, Path]:
    """Dumps of the ``input`` point only, the target's layer 2 MLP off at token T, and the real comparator's report
    of them: the first divergent tensor is layer 3's input (between the halves). Returns (baseline, report)."""
    root = base.parent / "input-only"
    model, _ = tiny_llama()
    cfg = RunConfig(out=str(root / "a"), layers="all", points=("input",))
    dump_sequences(model, [IDS], cfg)

    def off(module, args, output):
        output[:, T] += 0.5 * output.abs().mean()
        return output

    handle = model.model.layers[2].mlp.register_forward_hook(off)
    try:
        dump_sequences(model, [IDS], RunConfig(out=str(root / "b"), layers="all", points=("input",)))
    finally:
        handle.remove()
    report = compare_dumps(root / "a", root / "b")
    fd = report.first_divergent
    assert fd is not None and (fd.layer, fd.token) == (3, T), fd
    (root / "report.json").write_text(json.dumps(report.to_json()))
    return root / "a", root / "report.json"


@pytest.fixture(scope="module")
def attn_only(base: Path) -> Path:
    """A baseline of layer 2's attention points only (no ``mlp_input``)."""
    out = base.parent / "attn-only"
    model, _ = tiny_llama()
    dump_sequences(model, [IDS], RunConfig(out=str(out), layers="2", points=("input", "attn_output")))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["llama.cpp", "input report", "out not empty", "no mlp_input", "layer and report", "tokens past the end"],
)
def test_cli_refuses_in_one_line(base, input_report, attn_only, tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    mlp2 = ("--layer", "2", "--half", "mlp")
    baseline, report = input_report
    args, needles = {
        "llama.cpp": (("--baseline", base, *mlp2, "--engine", "llama.cpp"), ["--engine llama.cpp", "ggml"]),
        "input report": (
            ("--baseline", baseline, "--from-report", report),
            [str(report), "model.layers.3.self_attn.input is the input point, not a half's output", "--layer 3 --half"],
        ),
        "out not empty": (("--baseline", base, *mlp2), [f"--out {out}: exists and is not an empty directory"]),
        "no mlp_input": (("--baseline", attn_only, *mlp2), [str(attn_only), "mlp_input"]),
        "layer and report": (("--baseline", base, *mlp2, "--from-report", report), ["not both"]),
        "tokens past the end": (
            ("--baseline", base, *mlp2, "--tokens", f"3,{N}"),
            [f"--tokens [{N}]", f"has positions 0..{N - 1}"],
        ),
    }[case]
    if case == "out not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    r = run_cli("dumper", "drill", *args, "--out", out)
    one_line_error(r, *needles, prefix="error: ")
    assert r.stdout == "", r.stdout
    if case == "out not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind
    else:
        assert not out.exists()


# clean halves of the real trained checkpoint


@pytest.mark.slow
def test_clean_halves_of_the_real_checkpoint_are_within_their_rounding(tmp_path: Path) -> None:
    model = smollm2_dir()
    ids = real_prompt_ids(model)[0]
    base = tmp_path / "base"
    layers = (0, 14, 29)
    run_dump(
        RunConfig(
            out=str(base), model=str(model), input_ids=(tuple(ids),), layers=",".join(map(str, layers)), points=POINTS
        )
    )
    halves = [DrillTarget(layer, half) for layer in layers for half in ("attn", "mlp")]
    for dtype in ("float32", "bfloat16"):  # every half of a dtype on one model load
        cfg = DrillConfig(baseline=str(base), out="-", model=str(model), dtype=dtype, layer=0, half="attn")
        outs = [tmp_path / f"{dtype}-{t.layer}-{t.half}" for t in halves]
        ratios = []
        for target, log in zip(halves, drill_halves(cfg, halves, outs), strict=True):
            assert (log.layer, log.half) == (target.layer, target.half)
            assert log.first_beyond() is None, log.summary()
            judged = [o for o in log.ops if o.judged]
            assert judged and all(o.ratio is not None and math.isfinite(o.ratio) for o in judged), log.summary()
            ratios += [(o.ratio, f"layer {log.layer} {log.half}: {o.op} at {o.path}") for o in judged]
            if dtype == "float32":  # the baseline's kernels on the baseline's rows: its output, bit for bit
                assert log.header["half_check"]["rel_diff"] == 0.0, log.header["half_check"]
        ratio, where = max(ratios)
        print(f"{dtype}: the largest ratio over {len(ratios)} judged ops (6 halves) is {ratio:.3g}x ({where})")
        assert ratio < 4, where
