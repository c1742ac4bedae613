"""The CLIs as a user runs them: real subprocesses over real dumps of the tiny presets."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from dumper.format import MANIFEST_NAME

CONTRACT_KEYS = {
    "passed",
    "threshold",
    "token_threshold",
    "matched",
    "unmatched_baseline",
    "unmatched_target",
    "first_divergent",
    "tensors",
}
TENSOR_KEYS = {
    "name",
    "layer",
    "forward_pass",
    "rank",
    "rel_diff",
    "max_token_rel_diff",
    "max_abs_diff",
    "cosine",
    "passed",
}


@pytest.fixture(scope="module")
def eager_dump(tmp_path_factory):
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("eager") / "dump"
    r = run_cli("dumper", "run", "--out", out, "--layers", "all")
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,dtype",
    [("tiny-llama", "float32"), ("tiny-llama", "bfloat16"), ("tiny-qwen2", "float32"), ("tiny-qwen2", "bfloat16")],
)
def test_eager_vs_sdpa_passes(cli, tmp_path, preset, dtype):
    for attn in ("eager", "sdpa"):
        r = cli(
            "dumper",
            "run",
            "--model",
            preset,
            "--dtype",
            dtype,
            "--attn",
            attn,
            "--layers",
            "all",
            "--out",
            tmp_path / attn,
        )
        assert r.returncode == 0, r.stderr
    r = cli("comparator", tmp_path / "eager", tmp_path / "sdpa", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["matched"] > 0 and report["first_divergent"] is None
    assert "PASS" in r.stdout


@pytest.mark.slow
def test_default_run_and_ls(cli, tmp_path, eager_dump):
    r = cli("dumper", "run", "--out", tmp_path / "default")
    assert r.returncode == 0, r.stderr
    ls = cli("dumper", "ls", tmp_path / "default", "--tensors")
    assert ls.returncode == 0, ls.stderr
    # the default layer spec on the 8-layer preset is first + last + every 8th = layers 0 and 7
    assert "layers: [0, 7]" in ls.stdout and "forward passes: 2" in ls.stdout
    assert "model.layers.7.self_attn.input" in ls.stdout and "tokens 0.." in ls.stdout


@pytest.mark.slow
def test_diverging_run_exits_1_with_json_and_csv(cli, tmp_path, eager_dump):
    r = cli("dumper", "run", "--out", tmp_path / "other", "--layers", "all", "--seed", "1")
    assert r.returncode == 0, r.stderr
    r = cli(
        "comparator",
        eager_dump,
        tmp_path / "other",
        "--json",
        tmp_path / "r.json",
        "--csv",
        tmp_path / "r.csv",
        "--tensors",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FIRST DIVERGENCE" in r.stdout and "DIVERGED at layer 0" in r.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert CONTRACT_KEYS <= set(report)
    assert report["passed"] is False and report["matched"] == 16
    fd = report["first_divergent"]
    assert {"name", "layer", "rel_diff", "token", "worst_token"} <= set(fd) and fd["layer"] == 0 and fd["token"] == 0
    assert all(TENSOR_KEYS <= set(t) for t in report["tensors"])
    table = pd.read_csv(tmp_path / "r.csv")
    assert len(table) == 16 and {"name", "rel_diff", "passed"} <= set(table.columns)


@pytest.mark.slow
def test_threshold_flag_and_env(cli, tmp_path, eager_dump):
    r = cli("dumper", "run", "--out", tmp_path / "sdpa", "--layers", "all", "--attn", "sdpa")
    assert r.returncode == 0
    assert (
        cli("comparator", eager_dump, tmp_path / "sdpa", "--threshold", "0", "--token-threshold", "0").returncode == 1
    )
    assert (
        cli(
            "comparator",
            eager_dump,
            tmp_path / "sdpa",
            env={"DRIFTSCOPE_DIFF_THRESHOLD": "0", "DRIFTSCOPE_TOKEN_THRESHOLD": "0"},
        ).returncode
        == 1
    )
    bad = cli("comparator", eager_dump, tmp_path / "sdpa", env={"DRIFTSCOPE_DIFF_THRESHOLD": "nan"})
    assert bad.returncode == 2 and "DRIFTSCOPE_DIFF_THRESHOLD" in bad.stderr


def _single_line_error(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.slow
def test_renamed_tensors_zero_matched_exit_2(cli, tmp_path, eager_dump):
    renamed = tmp_path / "renamed"
    shutil.copytree(eager_dump, renamed)
    m = json.loads((renamed / MANIFEST_NAME).read_text())
    for t in m["tensors"]:
        t["name"] = t["name"].replace("self_attn", "attention")
    (renamed / MANIFEST_NAME).write_text(json.dumps(m))
    _single_line_error(cli("comparator", eager_dump, renamed), "zero tensors match")


@pytest.mark.slow
def test_truncated_file_exit_2_names_file(cli, tmp_path, eager_dump):
    broken = tmp_path / "broken"
    shutil.copytree(eager_dump, broken)
    f = sorted(broken.glob("*.safetensors"))[-1]
    f.write_bytes(f.read_bytes()[:1000])
    _single_line_error(cli("comparator", eager_dump, broken), f.name, "truncated")


@pytest.mark.slow
def test_missing_manifest_exit_2(cli, tmp_path, eager_dump):
    partial = tmp_path / "partial"
    shutil.copytree(eager_dump, partial)
    (partial / MANIFEST_NAME).unlink()
    _single_line_error(cli("comparator", partial, eager_dump), "partial", "incomplete dump")
    _single_line_error(cli("comparator", tmp_path / "nope", eager_dump), "nope", "no such dump")


@pytest.mark.slow
def test_shape_mismatch_and_empty_dump_exit_2(cli, tmp_path, eager_dump):
    r = cli("dumper", "run", "--out", tmp_path / "short", "--layers", "all", "--prompt", "short", "--prompt", "x")
    assert r.returncode == 0, r.stderr
    _single_line_error(cli("comparator", eager_dump, tmp_path / "short"), "short", "cannot align")
    empty = tmp_path / "empty"
    shutil.copytree(eager_dump, empty)
    m = json.loads((empty / MANIFEST_NAME).read_text())
    m["tensors"] = []
    (empty / MANIFEST_NAME).write_text(json.dumps(m))
    _single_line_error(cli("comparator", eager_dump, empty), "captured no tensors")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--threshold", "abc"], "invalid float"),
        (["--threshold", "-1"], "threshold"),
        ([], "required"),
    ],
)
def test_bad_comparator_arguments_exit_2(cli, eager_dump, args, needle):
    positional = [] if args == [] else [eager_dump, eager_dump]
    _single_line_error(cli("comparator", *positional, *args), needle)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--layers", "99"], "out of range"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--input-ids", "1,2,999999"], "outside the vocabulary"),
        (["--device", "cuda"], "CUDA is not available"),
    ],
)
def test_bad_dumper_arguments_exit_2(cli, tmp_path, args, needle):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _single_line_error(cli("dumper", "run", "--out", tmp_path / "x", *args), needle)
    assert not (tmp_path / "x" / MANIFEST_NAME).exists()


@pytest.mark.slow
def test_prompts_file_and_input_ids(cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "hello"}\n{"input_ids": [1, 5, 9, 200]}\n')
    r = cli("dumper", "run", "--out", tmp_path / "a", "--prompts", prompts, "--layers", "last")
    assert r.returncode == 0, r.stderr
    r = cli("dumper", "run", "--out", tmp_path / "b", "--input-ids", "1,5,9,200", "--layers", "last")
    assert r.returncode == 0, r.stderr
    from dumper.format import load_manifest

    a, b = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "b")
    assert a.extra["input_ids"] == [[1, 107, 104, 111, 111, 114], [1, 5, 9, 200]]
    assert [t.shape for t in a.tensors] == [(1, 6, 64), (1, 4, 64)] and b.tensors[0].shape == (1, 4, 64)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    _single_line_error(
        cli("dumper", "run", "--out", tmp_path / "c", "--prompts", tmp_path / "bad.jsonl"), "bad.jsonl:2"
    )


@pytest.mark.slow
def test_report_outputs_through_the_cli(cli, tmp_path, eager_dump):
    copy = tmp_path / "copy"  # a dump is never compared with itself (exit 2): compare it with a copy
    shutil.copytree(eager_dump, copy)
    r = cli(
        "comparator",
        eager_dump,
        copy,
        "--format",
        "json",
        "--html",
        tmp_path / "r.html",
        "--markdown",
        tmp_path / "r.md",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # stdout carries the JSON report alone
    assert report["passed"] and report["matched"] == 16 and report["heatmap"] is None
    html = (tmp_path / "r.html").read_text()
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert "PASS" in (tmp_path / "r.md").read_text()
    r = cli("comparator", eager_dump, copy, "--format", "json", "--markdown")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_dumper_quiet(cli, tmp_path):
    r = cli("dumper", "run", "--out", tmp_path / "q", "--quiet", "--layers", "last")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    assert (tmp_path / "q" / MANIFEST_NAME).exists()
