"""The drill on real vLLM (CPU build): from the layer verdict to the half to the op, and a repro that runs alone.

Issue 52's engine tests. The seeds (``tests/vllm_seed/drill_bug.py``) replace vLLM's own custom-op kernels
with ones wrong inside the op, so only the op itself computes wrong numbers:

- ``op_silu``: layer 2's ``SiluAndMul`` runs vLLM's ``_C.silu_and_mul`` kernel, wrong at row T of a call with
  exactly N rows (the prompt's length). The layer verdict names layer 2's ``mlp_output`` at token T; the drill
  from that report names ``_C.silu_and_mul`` at ``model.layers.2.mlp.act_fn``, token T, with the oneDNN GEMM
  before it within its rounding; the repro run alone is beyond its rounding with the seeded kernel and within
  it with vLLM's real one. A drill of the same half on the clean build finds no op beyond its rounding, and
  ``comparator drill clean seeded`` names the module path, although the clean build runs two aten ops there
  (x86's native SiLU-and-mul) where the seeded one runs one custom op;
- ``op_rope`` on the real trained checkpoint (SmolLM2, fp32): the rotary kernel rotates position 11 by position
  12's angles. The verdict names layer 1's attention output at token 11 (the tiny random model's near-uniform
  attention hides it, a trained one does not); the drill names ``_C.rotary_embedding`` at token 11, and the
  opaque attention op after it, judged on its own inputs, is within its rounding;
- a clean half of the real checkpoint in bfloat16: no op beyond its rounding.

Every job is a CLI in a subprocess: dumps in vLLM's default multiprocess mode, eager (the seeds replace
kernels vLLM calls as they are, eager or compiled); each drill starts vLLM eager in its own process. Six
engine starts: two dumps, four drills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dumper.format.drill import load_drill
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import need, shared_checkpoint

pytestmark = pytest.mark.engine

SEED_DIR = ROOT / "tests" / "vllm_seed"
POINTS = ("--points", "input,attn_output,mlp_input,mlp_output")
EAGER = ("--engine-arg", "enforce_eager=true")
N, T = 27, 17
"""The tiny prompt's length (the seeded silu kernel's token count) and the row it gets wrong."""
ROPE = 11
"""The position the seeded rotary kernel rotates by the next position's angles."""
WITHIN = 2.0
"""An op that rounds as its dtype predicts stays well within this many times its rounding (measured: < 1)."""


def _env(seed: dict | None) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR)))}
    if seed is not None:
        env["DRIFTSCOPE_TEST_SEED"] = json.dumps(seed)
    return env


def _ok(r, codes: tuple[int, ...] = (0,)) -> None:
    assert r.returncode in codes, r.stdout[-3000:] + r.stderr[-3000:]


def _baseline(model: Path, out: Path, ids: list[int], layers: str) -> Path:
    """The transformers float32 baseline with the sub-layer points of one prompt."""
    ids_arg = ",".join(map(str, ids))
    _ok(run_cli("dumper", "run", "--model", model, "--input-ids", ids_arg, *POINTS, "--layers", layers, "--out", out))
    return out


def _verdict(model: Path, base: Path, tmp: Path, ids: list[int], layers: str, seed: dict) -> dict:
    """The seeded vLLM dump of the prompt, compared with the baseline: the report's first divergence."""
    target, report = tmp / "target", tmp / "report.json"
    ids_arg = ",".join(map(str, ids))
    args = ("run", "--engine", "vllm", *EAGER, "--model", model, "--input-ids", ids_arg, *POINTS)
    _ok(run_cli("dumper", *args, "--layers", layers, "--out", target, "--quiet", env=_env(seed)))
    _ok(run_cli("comparator", base, target, "--json", report), (1,))
    return json.loads(report.read_text())["first_divergent"]


def _drill(model: Path, base: Path, out: Path, *args: str, seed: dict | None = None, code: int = 1):
    r = run_cli(
        "dumper", "drill", "--engine", "vllm", "--model", model, "--baseline", base, "--out", out, *args, env=_env(seed)
    )
    _ok(r, (code,))
    return load_drill(out), r.stdout


def _judged_within(log, skip: int | None = None) -> list[float]:
    ratios = [o.ratio for o in log.ops if o.ratio is not None and o.index != skip]
    assert ratios and max(ratios) < WITHIN, [(o.op, o.path, o.ratio) for o in log.ops if o.judged]
    return ratios


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    need("vllm")
    ckpt = shared_checkpoint()
    ids = [1, *range(300, 300 + N - 1)]
    base = _baseline(ckpt, tmp_path_factory.mktemp("drill") / "base", ids, "all")
    return ckpt, base, ids


def test_mlp_kernel_bug_from_verdict_to_op_to_repro(tiny: tuple[Path, Path, list[int]], tmp_path: Path) -> None:
    ckpt, base, ids = tiny
    seed = {"op_silu": [2, N, T]}
    fd = _verdict(ckpt, base, tmp_path, ids, "all", seed)
    assert (fd["name"], fd["token"]) == ("model.layers.2.mlp.output", T)

    log, out = _drill(
        ckpt,
        base,
        tmp_path / "seeded",
        "--from-report",
        tmp_path / "report.json",
        "--repro",
        tmp_path / "repro",
        seed=seed,
    )
    bad = log.first_beyond()
    assert bad is not None and (bad.op, bad.path, bad.ratio_token) == (
        "_C.silu_and_mul.default",
        "model.layers.2.mlp.act_fn",
        T,
    ), log.summary()
    before = [o for o in log.ops if o.judged and o.index < bad.index]
    assert [o.op for o in before] == ["_C.onednn_mm.default"]  # the gate/up GEMM, within its rounding
    _judged_within(log, skip=bad.index)
    assert "layer 2 MLP: _C.silu_and_mul (model.layers.2.mlp.act_fn" in out and f"at token {T}" in out
    assert log.header["half_check"]["worst_token"] == T

    alone = _repro(tmp_path / "repro", seed)
    assert alone.returncode == 1 and "BEYOND" in alone.stdout, alone.stdout + alone.stderr
    real = _repro(tmp_path / "repro", None)  # vLLM's own kernel on the same inputs
    assert real.returncode == 0 and "within" in real.stdout, real.stdout + real.stderr

    clean, _ = _drill(ckpt, base, tmp_path / "clean", "--layer", "2", "--half", "mlp", code=0)
    assert clean.first_beyond() is None
    assert {o.op for o in clean.ops if o.path == "model.layers.2.mlp.act_fn" and o.judged} == {
        "aten.silu.default",
        "aten.mul.Tensor",
    }
    _judged_within(clean)
    r = run_cli("comparator", "drill", tmp_path / "clean", tmp_path / "seeded")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model.layers.2.mlp.act_fn" in r.stdout


def _repro(root: Path, seed: dict | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **_env(seed)}
    if seed is None:
        env.pop("DRIFTSCOPE_TEST_SEED", None)
    return subprocess.run(
        [sys.executable, str(root / "repro.py")], capture_output=True, text=True, env=env, timeout=300
    )


def test_rope_kernel_bug_on_the_real_checkpoint(tmp_path: Path) -> None:
    from tests.real_model import smollm2_dir

    need("vllm")
    model = smollm2_dir()
    ids = _real_ids(model)
    base = _baseline(model, tmp_path / "base", ids, "0,1,2")
    seed = {"op_rope": ROPE}
    fd = _verdict(model, base, tmp_path, ids, "0,1,2", seed)
    assert fd["name"].endswith("self_attn.output") and fd["token"] == ROPE, fd

    log, _ = _drill(model, base, tmp_path / "drill", "--from-report", tmp_path / "report.json", seed=seed)
    bad = log.first_beyond()
    assert bad is not None and (bad.op, bad.ratio_token) == ("_C.rotary_embedding.default", ROPE), log.summary()
    assert bad.path == f"model.layers.{fd['layer']}.self_attn.rotary_emb"
    after = [o for o in log.ops if o.judged and o.index > bad.index]
    assert "vllm.unified_attention_with_output.default" in {o.op for o in after}
    _judged_within(log, skip=bad.index)

    clean, out = _drill(
        model, base, tmp_path / "bf16", "--layer", str(fd["layer"]), "--half", "attn", "--dtype", "bfloat16", code=0
    )
    assert clean.first_beyond() is None, out
    assert max(o.ratio for o in clean.ops if o.ratio is not None) < WITHIN


def _real_ids(model: Path) -> list[int]:
    from tests.real_model import real_prompt_ids

    return real_prompt_ids(model)[0]
