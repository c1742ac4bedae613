"""ONNX Runtime GenAI adapter: real builder-made models of a tiny random Llama, judged against its HF fp32 dump.

The module builds one HF checkpoint, converts it with ONNX Runtime GenAI's own model builder
(fp32 and int8, CPU), dumps HF and ORT through the real CLIs and compares them with the real
comparator: fp32 passes; int8 is the same model with quantized projections, so it departs
from HF at layer 1 (layer 0's input is the float embedding, normalized) once the thresholds
are tight enough to see it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dumper.errors import ModelError, UsageError
from dumper.prefill.run import RunConfig
from tests.conftest import run_cli
from tests.engine_models import build_checkpoint, engine_missing

ENGINE = "onnxruntime-genai"
IDS = "1,469,474,416,470,12,33,300,301,7,8,9,10,11"


def need(name: str) -> None:
    """Skip when the engine is absent on a developer machine; fail in CI, where it must be installed."""
    why = engine_missing(name)
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


def build_ort(hf_dir: Path, out: Path, precision: str) -> subprocess.Popen[str]:
    """Start ONNX Runtime GenAI's model builder on ``hf_dir`` (CPU), offline."""
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(out),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(out.parent / f"cache-{precision}"),
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF checkpoint, its fp32 and int8 ONNX builds, and the HF reference dump (all layers, top-5 logprobs)."""
    need(ENGINE)
    root = tmp_path_factory.mktemp("ort")
    ckpt = build_checkpoint(root / "hf")
    builds = {p: build_ort(ckpt, root / f"ort-{p}", p) for p in ("fp32", "int8")}
    hf = run_cli(
        "dumper",
        "run",
        "--model",
        ckpt,
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--out",
        root / "dump-hf",
        "--quiet",
    )
    assert hf.returncode == 0, hf.stderr
    for p, proc in builds.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-2000:]
        assert (root / f"ort-{p}" / "genai_config.json").is_file()
    return {"hf": ckpt, "fp32": root / "ort-fp32", "int8": root / "ort-int8", "dump_hf": root / "dump-hf", "root": root}


def ort_dump(models: dict[str, Path], precision: str, out: str, *extra: str) -> Path:
    dump = models["root"] / out
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        ENGINE,
        "--model",
        models[precision],
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--out",
        dump,
        "--quiet",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return dump


def _tree_digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.engine
def test_fp32_passes_hidden_states_and_logprobs(models: dict[str, Path]) -> None:
    before = _tree_digest(models["fp32"])
    dump = ort_dump(models, "fp32", "dump-fp32", "--engine-arg", f"hf_dir={models['hf']}")
    assert _tree_digest(models["fp32"]) == before  # the user's model directory is read, never written
    r = run_cli("comparator", models["dump_hf"], dump, "--json", models["root"] / "fp32.json", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((models["root"] / "fp32.json").read_text())
    assert sorted({t["layer"] for t in report["tensors"]}) == [0, 1, 2, 3]
    assert report["matched"] == 8  # 4 layers x 2 built-in prompts
    assert max(t["rel_diff"] for t in report["tensors"]) < 1e-9
    assert report["logprobs"]["max_abs_err"]["value"] < 1e-4
    assert any("onnx:fp32" in n for n in report["notes"])
    lp = run_cli("comparator", "logprobs", models["dump_hf"], dump)
    assert lp.returncode == 0, lp.stdout + lp.stderr
    manifest = json.loads((dump / "manifest.json").read_text())
    assert (
        manifest["model"]["config_hash"]
        == json.loads((models["dump_hf"] / "manifest.json").read_text())["model"]["config_hash"]
    )
    assert manifest["model"]["weights_format"] == "onnx:fp32"


@pytest.mark.engine
def test_int8_departs_at_layer_1_where_fp32_does_not(models: dict[str, Path]) -> None:
    """At thresholds of 1e-6 (fp32's rel_diff is < 1e-9, see above) int8 diverges, first at layer 1."""
    dump = ort_dump(models, "int8", "dump-int8", "--engine-arg", f"hf_dir={models['hf']}")
    r = run_cli(
        "comparator",
        models["dump_hf"],
        dump,
        "--threshold",
        "1e-6",
        "--token-threshold",
        "1e-6",
        "--quiet",
        "--json",
        models["root"] / "int8.json",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads((models["root"] / "int8.json").read_text())
    assert report["first_divergent"]["layer"] == 1
    per_layer: dict[int, list[float]] = {}
    for t in report["tensors"]:
        per_layer.setdefault(t["layer"], []).append(t["rel_diff"])
    assert max(per_layer[0]) < 1e-9  # the float embedding, normalized: no quantized matmul before it
    assert min(min(per_layer[i]) for i in (1, 2, 3)) > 1e-6
    assert 1e-4 < report["logprobs"]["max_abs_err"]["value"] < 1.0
    assert json.loads((dump / "manifest.json").read_text())["model"]["weights_format"] == "onnx:int8"


@pytest.mark.engine
def test_chunked_without_hf_dir_uses_the_builders_tokenizer(models: dict[str, Path]) -> None:
    dump = ort_dump(models, "fp32", "dump-chunked", "--chunk-size", "5")
    r = run_cli("comparator", models["dump_hf"], dump, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["model"]["config_hash"] is None
    assert len({t["forward_pass"] for t in manifest["tensors"]}) > 2  # one pass per chunk, not per prompt


@pytest.mark.engine
def test_not_a_genai_dir_exits_2_in_one_line(models: dict[str, Path]) -> None:
    r = run_cli(
        "dumper",
        "run",
        "--engine",
        ENGINE,
        "--model",
        models["hf"],
        "--input-ids",
        IDS,
        "--out",
        models["root"] / "bad",
        "--quiet",
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert "genai_config.json" in r.stderr and str(models["hf"]) in r.stderr


@pytest.mark.engine
@pytest.mark.parametrize(
    "change, words",
    [
        ({"dtype": "bfloat16"}, "computes in float32"),
        ({"batch_size": 2}, "one prompt per generator"),
        ({"engine_args": (("kv", "f16"),)}, "hf_dir"),
    ],
)
def test_options_it_cannot_honour_are_refused(models: dict[str, Path], change: dict, words: str) -> None:
    from dumper.engines.onnxruntime_genai import run_dump

    cfg = RunConfig(
        out=str(models["root"] / "refused"), model=str(models["fp32"]), input_ids=((1, 2, 3),), engine=ENGINE, **change
    )
    with pytest.raises(UsageError, match=words):
        run_dump(cfg)
    assert not (models["root"] / "refused").exists()


@pytest.mark.engine
def test_a_graph_without_a_layers_norm_names_layer_and_file(models: dict[str, Path], tmp_path: Path) -> None:
    import onnx

    from dumper.engines.onnxruntime_genai import run_dump

    broken = tmp_path / "ort"
    shutil.copytree(models["fp32"], broken)
    graph = onnx.load(str(broken / "model.onnx"), load_external_data=False)
    for node in graph.graph.node:
        node.name = node.name.replace("/model/layers.2/input_layernorm/", "/model/layers.2/norm_renamed/")
    onnx.save(graph, str(broken / "model.onnx"))
    cfg = RunConfig(out=str(tmp_path / "d"), model=str(broken), input_ids=((1, 2, 3),), engine=ENGINE, layers="all")
    with pytest.raises(ModelError, match=r"model\.onnx: no input_layernorm node for layer 2"):
        run_dump(cfg)
    assert not (tmp_path / "d").exists()  # refused before any output is written
    cfg_last = RunConfig(out=str(tmp_path / "d1"), model=str(broken), input_ids=((1, 2, 3),), engine=ENGINE, layers="1")
    assert len(run_dump(cfg_last).tensors) == 1  # only the layers asked for need their node


@pytest.mark.engine
def test_an_unreadable_graph_is_a_model_error(models: dict[str, Path], tmp_path: Path) -> None:
    from dumper.engines.onnxruntime_genai import run_dump

    broken = tmp_path / "ort"
    shutil.copytree(models["fp32"], broken)
    (broken / "model.onnx").write_bytes(b"not a protobuf")
    cfg = RunConfig(out=str(tmp_path / "d"), model=str(broken), input_ids=((1, 2, 3),), engine=ENGINE)
    with pytest.raises(ModelError, match=r"model\.onnx: cannot read the ONNX graph") as err:
        run_dump(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.engine
def test_hidden_states_come_from_the_graph_that_gives_the_logprobs(models: dict[str, Path]) -> None:
    """The plain-onnxruntime run that exposes hidden states computes the same logits as ORT GenAI."""
    import onnxruntime_genai as og

    from dumper.engines.onnxruntime_genai_graph import HiddenRunner, read_ort_model

    ids = [int(t) for t in IDS.split(",")]
    model = read_ort_model(models["int8"])
    hidden, logits, past = HiddenRunner(model, [0, 3]).run(ids, 0, None)
    gen_model = og.Model(str(models["int8"]))
    params = og.GeneratorParams(gen_model)
    params.set_search_options(max_length=len(ids))
    gen = og.Generator(gen_model, params)
    gen.append_tokens(np.asarray([ids], dtype=np.int32))
    np.testing.assert_allclose(logits, gen.get_output("logits")[0], rtol=0, atol=1e-5)
    assert set(hidden) == {0, 3} and hidden[3].shape == (len(ids), 128)
    assert all(v.shape[2] == len(ids) for v in past.values())  # the KV a next chunk continues from


def _genai_dir(root: Path, config: object | bytes) -> Path:
    """A model directory holding ``config`` as genai_config.json and an (empty) ``model.onnx`` beside it."""
    root.mkdir()
    (root / "genai_config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    (root / "model.onnx").write_bytes(b"")
    return root


GOOD_GENAI = {"model": {"vocab_size": 512, "decoder": {"num_hidden_layers": 4, "filename": "model.onnx"}}}


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c["model"].update(vocab_size=float("inf")), "model.vocab_size"),
        (lambda c: c["model"]["decoder"].update(num_hidden_layers="4"), "a count"),
        (lambda c: c["model"]["decoder"].update(num_hidden_layers=True), "a count"),
        (lambda c: c["model"]["decoder"].update(filename="../outside/model.onnx"), "model.decoder.filename"),
        (lambda c: c["model"]["decoder"].update(filename="/etc/passwd"), "model.decoder.filename"),
        (lambda c: c["model"].update(decoder=[]), "not a decoder genai config"),
    ],
)
def test_a_hostile_genai_config_is_one_line_before_any_graph_is_read(tmp_path: Path, edit, words: str) -> None:
    """genai_config.json is read like any untrusted file, and the graph it names must be inside the directory."""
    need(ENGINE)
    from dumper.engines.onnxruntime_genai_graph import read_ort_model

    cfg = json.loads(json.dumps(GOOD_GENAI))
    edit(cfg)
    with pytest.raises(UsageError) as e:
        read_ort_model(_genai_dir(tmp_path / "m", json.dumps(cfg, allow_nan=True).encode()))
    text = str(e.value)
    assert words in text and "\n" not in text, text


def test_a_fifo_or_huge_genai_config_is_refused_unread(tmp_path: Path) -> None:
    need(ENGINE)
    from dumper.engines.onnxruntime_genai_graph import read_ort_model

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "genai_config.json")  # a blocking read would hang here: the open is non-blocking
    with pytest.raises(UsageError, match="a FIFO, not a regular file"):
        read_ort_model(fifo)
    big = _genai_dir(tmp_path / "big", b"")
    with open(big / "genai_config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: refused by its size, never read
    with pytest.raises(UsageError, match="exceeds the 16 MiB limit"):
        read_ort_model(big)
