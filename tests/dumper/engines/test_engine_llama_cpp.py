"""llama.cpp engine adapter: real GGUF conversions of one tiny checkpoint, dumped by llama.cpp, judged against HF fp32.

One HF checkpoint per module, converted to f32 and q8_0 GGUF by llama.cpp's own
``convert_hf_to_gguf.py``; the HF reference and every llama.cpp dump go through the real CLIs.
The checkpoint uses ``initializer_range=0.2``: with the default 0.02 a random model's logits
are nearly uniform and q8_0's rounding stays under the default thresholds (measured: layer
rel_diff <= 1.0e-4, max |Δlogprob| 0.010), so nothing would tell q8_0 from f32. At 0.2 the
q8_0 error grows through the layers as in a trained model (max |Δlogprob| 0.67), f32 stays
exact to ~1e-11.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from comparator import CompareConfig, compare_dumps
from dumper.engines import run_engine
from dumper.errors import ModelError, UsageError
from dumper.prefill.logprob_records import LogprobSpec
from dumper.prefill.run import RunConfig, run_dump
from tests.conftest import run_cli
from tests.engine_models import build_checkpoint, engine_missing, to_gguf

LAYERS = [0, 1, 2, 3]


def need(name: str) -> None:
    """Skip when the engine is absent on a developer machine; fail in CI, where it must be installed."""
    why = engine_missing(name)
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF checkpoint, its f32 and q8_0 GGUF files, and the HF fp32 reference dump."""
    need("llama.cpp")
    root = tmp_path_factory.mktemp("llama_cpp")
    ckpt = build_checkpoint(root / "ckpt", initializer_range=0.2)
    with ThreadPoolExecutor(2) as pool:  # two converter processes at once
        ggufs = dict(
            zip(
                ("f32", "q8_0"),
                pool.map(lambda t: to_gguf(ckpt, root / f"m-{t}.gguf", t), ("f32", "q8_0")),
                strict=True,
            )
        )
    paths = {"root": root, "ckpt": ckpt, "hf": root / "hf", **ggufs}
    run_dump(RunConfig(out=str(paths["hf"]), model=str(ckpt), layers="all", logprobs=LogprobSpec(top_k=5)))
    return paths


_DUMPS: dict[tuple[str, ...], Path] = {}


def llama_dump(work: dict[str, Path], gguf: str, *args: str) -> Path:
    """A llama.cpp dump of ``work[gguf]`` with the HF job's prompts, through the CLI (made once per argument list)."""
    key = (str(work["root"]), gguf, *args)
    if key not in _DUMPS:
        out = work["root"] / f"ll-{len(_DUMPS)}"
        r = run_cli(
            "dumper",
            "run",
            "--engine",
            "llama.cpp",
            "--model",
            work[gguf],
            "--engine-arg",
            f"hf_dir={work['ckpt']}",
            "--layers",
            "all",
            "--logprobs",
            "--top-k",
            "5",
            "--out",
            out,
            *args,
        )
        assert r.returncode == 0, r.stderr
        assert "llama_model_loader" not in r.stderr and "ggml" not in r.stderr  # llama.cpp's log is silenced
        _DUMPS[key] = out
    return _DUMPS[key]


def llama_dump_here(
    work: dict[str, Path], name: str, *, engine_args: tuple[tuple[str, str], ...] = (), **cfg: int
) -> Path:
    """A llama.cpp dump of the f32 GGUF made in this process (``RunConfig`` fields in ``cfg``), HF job's prompts."""
    out = work["root"] / name
    if not out.exists():
        args = (("hf_dir", str(work["ckpt"])), *engine_args)
        run_engine(
            RunConfig(
                out=str(out),
                model=str(work["f32"]),
                layers="all",
                logprobs=LogprobSpec(top_k=5),
                engine="llama.cpp",
                engine_args=args,
                **cfg,
            ),
            engine="llama.cpp",
        )
    return out


def compare(base: Path, target: Path, *, logprobs: bool = False) -> tuple[int, dict, str]:
    """Run ``python -m comparator [logprobs] BASE TARGET --json``: (exit code, JSON report, stdout)."""
    report = target.parent / f"{target.name}-vs-{base.name}{'-lp' if logprobs else ''}.json"
    r = run_cli("comparator", *(["logprobs"] if logprobs else []), base, target, "--json", report)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(report.read_text()), r.stdout


def max_logprob_err(report: dict) -> float:
    lp = report.get("logprobs", report)
    return float(lp["max_abs_err"]["value"])


@pytest.mark.engine
def test_f32_with_f32_kv_passes_against_hf(work: dict[str, Path]) -> None:
    dump = llama_dump(work, "f32")
    rc, report, _ = compare(work["hf"], dump)
    assert rc == 0 and report["passed"]
    assert sorted({t["layer"] for t in report["tensors"]}) == LAYERS and report["matched"] == 8
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-9  # measured 4e-12: f32 all the way
    assert "different weights format: 'hf' (baseline) vs 'gguf:F32' (target)" in report["notes"]
    rc, lp, _ = compare(work["hf"], dump, logprobs=True)
    assert rc == 0 and max_logprob_err(lp) < 1e-3  # measured 2.8e-5
    manifest = json.loads((dump / "manifest.json").read_text())
    hf = json.loads((work["hf"] / "manifest.json").read_text())
    assert manifest["model"]["config_hash"] == hf["model"]["config_hash"]  # hf_dir gives the HF identity
    assert manifest["model"]["weights_format"] == "gguf:F32"
    env = manifest["environment"]
    assert (env["engine"], env["engine_kv_cache_dtype"], env["engine_file_type"]) == ("llama.cpp", "f32", "F32")


@pytest.mark.engine
def test_q8_0_diverges_at_the_first_layer_past_threshold(work: dict[str, Path]) -> None:
    rc, report, stdout = compare(work["hf"], llama_dump(work, "q8_0"))
    assert rc == 1 and not report["passed"]
    failing = sorted(t["layer"] for t in report["tensors"] if not t["passed"])
    first = report["first_divergent"]
    assert first is not None and first["layer"] in LAYERS and first["layer"] == failing[0]
    assert all(t["passed"] for t in report["tensors"] if t["layer"] < first["layer"])
    assert first["name"] == f"model.layers.{first['layer']}.self_attn.input"
    assert f"DIVERGED at layer {first['layer']} " in stdout
    assert "different weights format: 'hf' (baseline) vs 'gguf:Q8_0' (target)" in report["notes"]
    rc, lp, _ = compare(work["hf"], llama_dump(work, "q8_0"), logprobs=True)
    assert rc == 1 and max_logprob_err(lp) > 0.05  # measured 0.67


@pytest.mark.engine
def test_f16_kv_cache_is_measurably_noisier_than_f32(work: dict[str, Path]) -> None:
    f16 = llama_dump_here(work, "kv-f16", engine_args=(("kv", "f16"),))
    # an f16 KV cache is a float16 step: judged by the float16 rows (the float32 ones fail its 2.3e-2)
    noisy = compare_dumps(work["hf"], f16, CompareConfig.resolve(model="default@float16"))
    clean = compare_dumps(work["hf"], llama_dump(work, "f32"))
    assert noisy.passed  # f16 K/V rounding stays within the float16 thresholds (measured rel_diff <= 1.7e-6)
    assert max(t.rel_diff for t in noisy.tensors if t.layer) > 100 * max(t.rel_diff for t in clean.tensors)
    lp16, lp32 = noisy.to_json()["logprobs"], clean.to_json()["logprobs"]
    assert max_logprob_err(lp16) > 10 * max_logprob_err(lp32)  # measured 2.3e-2 vs 2.8e-5
    assert json.loads((f16 / "manifest.json").read_text())["environment"]["engine_kv_cache_dtype"] == "f16"


@pytest.mark.engine
def test_chunked_batched_prefill_matches_one_pass(work: dict[str, Path]) -> None:
    chunked = llama_dump_here(work, "chunked", chunk_size=16, batch_size=2)
    manifest = json.loads((chunked / "manifest.json").read_text())
    assert manifest["environment"]["engine_n_batch"] == 32  # two prompts x 16 tokens per decode
    assert len({t["forward_pass"] for t in manifest["tensors"]}) > 2  # several decodes through the KV cache
    for base in (llama_dump(work, "f32"), work["hf"]):
        report = compare_dumps(base, chunked)
        assert report.passed and report.matched == 8 and report.to_json()["logprobs"]["passed"], report.notes


@pytest.mark.engine
def test_unusable_inputs_exit_2_with_one_line(work: dict[str, Path]) -> None:
    model = work["ckpt"] / "config.json"
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        "llama.cpp",
        "--model",
        model,
        "--input-ids",
        "1,2,3",
        "--out",
        work["root"] / "never",
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"{model}: not a GGUF file" in lines[0], r.stderr
    truncated = work["root"] / "truncated.gguf"
    truncated.write_bytes(work["f32"].read_bytes()[:4096])
    cases = [
        (truncated, (), ModelError, f"{truncated}: llama.cpp cannot load"),
        (work["f32"], (), UsageError, "text prompts need --engine-arg hf_dir"),
        (work["f32"], (("kv", "q4_0"),), UsageError, "kv=q4_0: expected one of f32, f16, bf16"),
    ]
    for gguf, args, error, says in cases:
        ids = () if "hf_dir" in says else ((1, 2, 3),)
        cfg = RunConfig(
            out=str(work["root"] / "never"), model=str(gguf), input_ids=ids, engine="llama.cpp", engine_args=args
        )
        with pytest.raises(error) as info:
            run_engine(cfg, engine="llama.cpp")
        assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.engine
def test_a_sketch_of_llama_cpp_passes_against_hf_and_keeps_its_logprobs(work: dict[str, Path]) -> None:
    """``--sketch 16``: llama.cpp's rows projected as they are recorded; the estimates pass against HF's full rows and
    the logprobs are the unsketched run's."""
    full, sketch = llama_dump(work, "f32"), llama_dump(work, "f32", "--sketch", "16")
    manifest = json.loads((sketch / "manifest.json").read_text())
    assert manifest["capture_signature"]["sketch"] == {"kind": "rademacher", "k": 16, "seed": 0}
    hidden = [t for t in manifest["tensors"] if t["point"] == "input"]
    assert hidden and all(t["sketch"]["dtype"] == "F32" and t["shape"][-1] == 16 for t in hidden)
    rc, report, _ = compare(work["hf"], sketch)
    assert rc == 0 and report["passed"] and report["matched"] == 8
    assert report["sketch"]["target"] and not report["sketch"]["baseline"]
    assert all("max_abs_diff" not in t and "cosine" not in t and t["rel_diff"] >= 0 for t in report["tensors"])
    rc, lp, _ = compare(full, sketch, logprobs=True)
    assert rc == 0 and max_logprob_err(lp) == 0.0


@pytest.mark.engine
def test_f32_decode_steps_match_an_hf_prefill_of_the_same_tokens(work: dict[str, Path]) -> None:
    """``--new-tokens``: one ``llama_decode`` of one token per sequence a step, both prompts in one batch; every
    step's rows (labelled with their step) and every generated token's logprob match HF's prefill of those tokens."""
    from dumper.format import load_manifest
    from dumper.format.decode import record_phase

    new = 6
    out = llama_dump(work, "f32", "--new-tokens", str(new), "--batch-size", "2", "--quiet")
    hf = work["root"] / "hf-of-decode"
    r = run_cli(
        "dumper",
        "run",
        "--model",
        work["ckpt"],
        "--tokens-from",
        out,
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--out",
        hf,
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    rc, report, _ = compare(hf, out)
    assert rc == 0 and report["passed"], report["first_divergent"]
    m = load_manifest(out)
    prompts = m.extra["input_ids"]
    assert report["decode"]["steps"] == len(prompts) * (new - 1) and report["matched"] == len(LAYERS) * len(prompts)
    assert report["logprobs"]["compared_positions"] == sum(len(p) - 1 + new for p in prompts)
    steps = {record_phase(t.meta) for t in m.tensors if t.layer == 0 and t.point == "input"}
    assert steps == {("prefill", None), *(("decode", s) for s in range(new - 1))}


@pytest.mark.engine
def test_the_points_inside_a_layer_match_hf_in_f32_decode_steps_included(work: dict[str, Path]) -> None:
    """``--points attn_output,mlp_input,mlp_output`` read the graph's ``attn_out``, ``ffn_norm`` and ``ffn_out``
    nodes (before the residual adds): each matches HF's module at every layer, prompt and decode rows alike."""
    points = "input,attn_output,mlp_input,mlp_output"
    out = llama_dump(work, "f32", "--points", points, "--new-tokens", "3", "--quiet")
    hf = work["root"] / "hf-of-points"
    r = run_cli(
        "dumper",
        "run",
        "--model",
        work["ckpt"],
        "--tokens-from",
        out,
        "--layers",
        "all",
        "--points",
        points,
        "--logprobs",
        "--top-k",
        "5",
        "--out",
        hf,
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    rc, report, _ = compare(hf, out)
    assert rc == 0 and report["passed"], report["first_divergent"]
    assert not report["unmatched_baseline"] and not report["unmatched_target"]
    assert {(t["layer"], t["point"]) for t in report["tensors"]} == {
        (layer, p) for layer in LAYERS for p in points.split(",")
    }
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-9
