"""``python -m dumper run --calibrate``: the baseline and its benign variants in one command, the noise kept inside.

Real CLIs in subprocesses on the tiny preset in bfloat16: the calibrated baseline holds NOISE.json
and its row-noise side file (and nothing of the variants); ``python -m comparator BASE TARGET``
judges by that noise without a flag and says so; a one-token bug fails at its layer and token;
``--ignore-baseline-noise`` goes back to the fixed thresholds, whose dtype-blindness the verdict
names; what --calibrate cannot do is one line, exit 2, and leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from dumper.format import load_manifest
from dumper.prefill.run import RunConfig, dump_sequences
from dumper.prompts import BUILTIN_PROMPTS
from tests.conftest import forward_hook, run_cli, tiny_llama

pytestmark = pytest.mark.slow

FLAGS = ("--dtype", "bfloat16", "--layers", "all", "--points", "input,mlp_output", "--quiet")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated")
    r = run_cli("dumper", "run", "--out", root / "base", "--calibrate", *FLAGS)
    assert r.returncode == 0, r.stderr
    r = run_cli("dumper", "run", "--out", root / "c5", "--chunk-size", "5", *FLAGS)
    assert r.returncode == 0, r.stderr
    return root


def test_the_baseline_holds_its_noise_and_nothing_else(calibrated):
    base = calibrated / "base"
    files = set(os.listdir(base))
    assert {"NOISE.json", "NOISE.rows.safetensors", "manifest.json"} <= files
    assert files - {"NOISE.json", "NOISE.rows.safetensors"} == {"manifest.json", *load_manifest(base).files}
    noise = json.loads((base / "NOISE.json").read_text())
    kinds = [v.split(" (")[1].rstrip(")") for v in noise["variants"]]
    assert noise["baseline"] == str(base) and kinds[:3] == ["attn-sdpa", "chunk-16", "batch-2"], kinds
    assert all(k.startswith("attn-sdpa-chunk-") for k in kinds[3:])
    assert noise["dtype"] == "bfloat16" and noise["rows"]["file"] == "NOISE.rows.safetensors"
    assert not [p for p in os.listdir(calibrated) if p.startswith(".")]  # no staging directory left


def test_the_comparator_judges_by_the_baselines_noise_without_a_flag(calibrated, tmp_path):
    base = calibrated / "base"
    r = run_cli("comparator", base, calibrated / "c5", "--json", tmp_path / "r.json", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["noise"] == str(base / "NOISE.json") and "row noise: " in " ".join(report["notes"])
    assert not any("dtype-blind" in n for n in report["notes"])
    r = run_cli(
        "comparator", base, calibrated / "c5", "--ignore-baseline-noise", "--json", tmp_path / "f.json", "--quiet"
    )
    report = json.loads((tmp_path / "f.json").read_text())
    assert report["noise"] is None and any("fixed thresholds are dtype-blind: bfloat16" in n for n in report["notes"])


def _bug_dump(out, *, layer: int, token: int):
    """The CLI's job in bfloat16 with 5% of token ``token``'s row norm added after decoder layer ``layer``."""
    model, tok = tiny_llama(dtype="bfloat16")

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [1, seq, hidden]
        row = hidden[0, token]
        row.add_(0.05 * row.float().norm().to(row.dtype) / math.sqrt(row.numel()))
        return output

    with forward_hook(model.model.layers[layer], hook):
        dump_sequences(
            model,
            [tok.encode(p) for p in BUILTIN_PROMPTS],
            RunConfig(out=str(out), layers="all", dtype="bfloat16", points=("input", "mlp_output")),
        )


def test_a_one_token_bug_fails_against_the_baselines_noise(calibrated, tmp_path):
    _bug_dump(tmp_path / "bug", layer=3, token=9)
    r = run_cli("comparator", calibrated / "base", tmp_path / "bug", "--json", tmp_path / "r.json", "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    fd = json.loads((tmp_path / "r.json").read_text())["first_divergent"]
    assert fd["layer"] == 4 and fd["token"] == 9 and fd["point"] == "input", fd


@pytest.mark.parametrize(
    "extra, why",
    [
        (("--engine", "llama.cpp"), "engine's variants are not built in"),
        (("--new-tokens", "2"), "prefill dumps of full rows only"),
        (("--observer-check",), "run the observer check on its own"),
    ],
)
def test_what_calibrate_cannot_do_is_one_line(tmp_path, extra, why):
    r = run_cli("dumper", "run", "--out", tmp_path / "x", "--calibrate", *FLAGS, *extra)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert not os.listdir(tmp_path)


def test_an_existing_directory_is_refused_and_kept(calibrated):
    before = sorted(os.listdir(calibrated / "c5"))
    r = run_cli("dumper", "run", "--out", calibrated / "c5", "--calibrate", *FLAGS)
    assert r.returncode == 2 and "already exists" in r.stderr, r.stderr
    assert sorted(os.listdir(calibrated / "c5")) == before
