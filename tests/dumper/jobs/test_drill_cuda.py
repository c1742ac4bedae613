"""The drill on a GPU: each op recorded and judged on the device (float64 references there, rows copied to the host).

Marked ``gpu`` (``bash .ci/gpu-check`` runs it): a transformers drill of each half of tiny-llama on CUDA, in float32 and
bfloat16, finds no op beyond its rounding, records the same op sequence as on the CPU, and a seeded CUDA kernel bug
(``aten::silu`` wrong at one token, replaced for the CUDA dispatch key only) is named at that op and token.
"""

from __future__ import annotations

import pytest
import torch

from dumper.jobs.drill import DrillConfig, drill
from tests.conftest import run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
POINTS = "input,attn_output,mlp_input,mlp_output"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("drill") / "base"
    r = run_cli("dumper", "run", "--model", "tiny-llama", "--points", POINTS, "--layers", "all", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("half", ["attn", "mlp"])
def test_clean_half_on_cuda_matches_the_cpu_op_list(base, tmp_path, dtype, half):
    logs = {}
    for device in ("cpu", "cuda"):
        cfg = DrillConfig(
            baseline=str(base), out=str(tmp_path / device), dtype=dtype, device=device, layer=2, half=half
        )
        logs[device] = drill(cfg)
    assert logs["cuda"].first_beyond() is None, logs["cuda"].summary()
    judged = [o.ratio for o in logs["cuda"].ops if o.ratio is not None]
    assert judged and max(judged) < 4
    assert [o.path for o in logs["cuda"].ops if o.judged] == [o.path for o in logs["cpu"].ops if o.judged]


def test_seeded_cuda_kernel_is_named(base, tmp_path):
    lib = torch.library.Library("aten", "IMPL")

    def silu(x):
        y = x * torch.sigmoid(x)
        if x.dtype != torch.float64:
            y = y.clone()
            y[..., 5, :] += 0.5 * y[..., 5, :].abs().mean()
        return y

    lib.impl("silu", silu, "CUDA")
    try:
        log = drill(DrillConfig(baseline=str(base), out=str(tmp_path / "d"), device="cuda", layer=1, half="mlp"))
    finally:
        lib._destroy()
    bad = log.first_beyond()
    assert bad is not None and (bad.op, bad.path, bad.ratio_token) == (
        "aten.silu.default",
        "model.layers.1.mlp.act_fn",
        5,
    )
