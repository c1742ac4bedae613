"""One verdict for hidden states and logprobs, and logprob comparisons across dumps and engine outputs."""

from __future__ import annotations

import json

import pytest
import torch

from comparator import compare_dumps
from comparator.logprobs.sources import read_logprob_source
from comparator.reports.files import json_text
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, dump_sequences, run_dump
from tests.conftest import tiny_llama

LOGPROB_KEYS = {
    "mse",
    "rmse",
    "max_abs_err",
    "k3_mean",
    "k3_max",
    "kl_mean",
    "kl_max",
    "kl_percentiles",
    "top1_agreement",
    "topk_max_err",
    "topk_mean_err",
    "passed",
}
PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def f(x): return x * x + 1")
SPEC = LogprobSpec(top_k=5, save_logits=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("lp") / "base"
    run_dump(RunConfig(out=str(out), prompts=PROMPTS, layers="all", logprobs=SPEC))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_benign_change_passes_both_verdicts(cli, tmp_path, dtype):
    for attn in ("eager", "sdpa"):
        r = cli(
            "dumper",
            "run",
            "--out",
            tmp_path / attn,
            "--layers",
            "all",
            "--dtype",
            dtype,
            "--attn",
            attn,
            "--logprobs",
            "--top-k",
            "5",
            "--save-logits",
        )
        assert r.returncode == 0, r.stderr
    r = cli("comparator", tmp_path / "eager", tmp_path / "sdpa", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    lp = report["logprobs"]
    assert LOGPROB_KEYS <= set(lp) and lp["passed"] and report["passed"]
    assert lp["compared_positions"] > 200 and lp["top1_agreement"] > 0.95  # bf16 flips near-ties
    assert "hidden states match; logprobs pass" in r.stdout


def _bad_run(out, layer: int):
    """The prompts through tiny-llama with a perturbed MLP in ``layer``, logprobs recorded."""
    model, tok = tiny_llama()
    with torch.no_grad():
        w = model.model.layers[layer].mlp.down_proj.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    dump_sequences(model, [tok.encode(p) for p in PROMPTS], RunConfig(out=str(out), layers="all", logprobs=SPEC))


def test_divergence_that_reaches_the_output(base, tmp_path):
    _bad_run(tmp_path / "bad", layer=5)
    report = compare_dumps(base, tmp_path / "bad")
    assert not report.passed and report.first_divergent.layer == 6
    v = report.logprobs
    assert v is not None and not v.passed and "kl_max" in v.failures()
    assert v.kl_max.value > 1e-4 and v.kl_max.request in ("0", "1") and v.kl_max.position >= 1
    assert v.max_abs_err.value == pytest.approx(max(abs(d) for s in _deltas(base, tmp_path / "bad") for d in s))
    data = json.loads(json_text(report))
    assert LOGPROB_KEYS <= set(data["logprobs"]) and data["logprobs"]["passed"] is False


def _deltas(a, b):
    sa, sb = read_logprob_source(a), read_logprob_source(b)
    out = []
    for x, y in zip(sa.sequences, sb.sequences, strict=True):
        out.append([q - p for p, q in zip(x.logprobs, y.logprobs, strict=True) if p is not None])
    return out


def test_chunked_and_batched_logprobs_agree_with_one_pass(base, tmp_path):
    run_dump(
        RunConfig(
            out=str(tmp_path / "layout"),
            prompts=PROMPTS,
            layers="all",
            logprobs=SPEC,
            chunk_size=9,
            batch_size=2,
            padding_side="left",
        )
    )
    report = compare_dumps(base, tmp_path / "layout")
    assert (
        report.passed
        and report.logprobs.passed
        and report.logprobs.compared_positions == sum(len(p.encode()) for p in PROMPTS)
    )  # every token but the first of each prompt (+1 for the bos)


def _sglang_lines(src, *, corrupt: tuple[str, int] | None = None) -> str:
    lines = []
    for s in src.sequences:
        triples = [[lp, tid, None] for lp, tid in zip(s.logprobs, s.token_ids, strict=True)]
        if corrupt is not None and corrupt[0] == s.request:
            triples[corrupt[1]][1] += 1
        tops = [None if t is None else [[v, i, None] for i, v in t] for t in s.top]
        lines.append(
            json.dumps(
                {
                    "text": "",
                    "meta_info": {"id": s.request, "input_token_logprobs": triples, "input_top_logprobs": tops},
                }
            )
        )
    return "\n".join(lines) + "\n"


def test_logprobs_cli_mixes_dumps_and_engine_outputs(cli, base, tmp_path):
    src = read_logprob_source(base)
    (tmp_path / "sglang.jsonl").write_text(_sglang_lines(src))
    r = cli("comparator", "logprobs", base, tmp_path / "sglang.jsonl", "--json", tmp_path / "v.json")
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["passed"] and v["mse"] == 0.0 and v["topk_max_err"] == 0.0 and v["kl_mean"] is None
    (tmp_path / "bad.jsonl").write_text(_sglang_lines(src, corrupt=("1", 7)))
    r = cli("comparator", "logprobs", base, tmp_path / "bad.jsonl")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'1'" in r.stderr and "7" in r.stderr, r.stderr
    r = cli("comparator", "logprobs", base, tmp_path / "sglang.jsonl", "--logprob-threshold", "mse=abc")
    assert r.returncode == 2 and "mse=abc" in r.stderr


def test_logprob_threshold_flags_decide(cli, base, tmp_path):
    run_dump(RunConfig(out=str(tmp_path / "bf16"), prompts=PROMPTS, layers="all", logprobs=SPEC, dtype="bfloat16"))
    args = ("comparator", "logprobs", base, tmp_path / "bf16")
    assert (
        cli(
            *args,
            "--logprob-threshold",
            "mse=1",
            "--logprob-threshold",
            "max_abs_err=10",
            "--logprob-threshold",
            "k3_mean=1",
            "--logprob-threshold",
            "kl_mean=1",
            "--logprob-threshold",
            "kl_max=10",
            "--logprob-threshold",
            "topk_max_err=10",
        ).returncode
        == 0
    )
    r = cli(*args, "--logprob-threshold", "mse=0", "--quiet")
    assert r.returncode == 1 and "FAIL (mse" in r.stdout
    r = cli(*args, "--quiet", env={"DRIFTSCOPE_LOGPROB_MSE": "0"})
    assert r.returncode == 1


def test_zero_matched_hidden_tensors_fail_even_with_logprobs(base, tmp_path):
    import shutil

    from dumper.errors import NotComparableError

    renamed = tmp_path / "renamed"
    shutil.copytree(base, renamed)
    m = json.loads((renamed / "manifest.json").read_text())
    for t in m["tensors"]:
        if t["point"] == "input":
            t["name"] = t["name"].replace("self_attn", "attention")
    (renamed / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(NotComparableError, match="zero tensors match"):
        compare_dumps(base, renamed)
    # dumps that hold logprobs only are compared on logprobs alone
    m["tensors"] = [t for t in m["tensors"] if t["point"] != "input"]
    (renamed / "manifest.json").write_text(json.dumps(m))
    shutil.copytree(renamed, tmp_path / "again")
    report = compare_dumps(renamed, tmp_path / "again")
    assert report.passed and report.matched == 0 and report.logprobs.compared_positions > 0
