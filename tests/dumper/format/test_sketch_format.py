"""Sketch dumps' format (dumper.format.sketch): the projection's bits, its statistics, and its trust boundary.

``R`` is never stored, so numpy (the comparator projecting a full side) and torch (the capture)
must build the same bits from the seed. The estimate ``||R(x-y)||^2`` must be unbiased with a
relative spread of about ``sqrt(2/K)``, on random rows and on the per-token rel_diff the
comparator computes from two real sketch dumps. A hand-edited sketch manifest or data file is
one :class:`CorruptDumpError` line naming the field (exit 2), and a bad ``--sketch`` is refused
before anything is written.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dumper
from comparator import compare_dumps
from comparator.cli.main import main as compare_main
from dumper.errors import CorruptDumpError, UsageError
from dumper.format import MANIFEST_NAME, DumpReader, load_manifest
from dumper.format.sketch import NORM_SUFFIX, SketchSpec, project, sign_bits, signs
from dumper.hooks.sketch import Sketcher, sign_matrix
from tests.conftest import run_cli

POINTS = ("input", "residual")
F32_EPS = float(np.finfo(np.float32).eps)


def small_llama(*, hidden: int = 32, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A real HF Llama built from its config with a fixed seed (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=256,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def token_ids(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def capture(model: torch.nn.Module, ids: torch.Tensor, out: Path, **sketch: int) -> Path:
    with torch.inference_mode(), dumper.capture(model, out, layers="all", points=POINTS, **sketch):
        model(input_ids=ids, use_cache=False)
    return out


# -- the projection's bits ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed,k,hidden", [(0, 8, 64), (7, 64, 1000), (123456789, 33, 257), (2**32 - 1, 256, 96), (5, 1, 3)]
)
def test_numpy_and_torch_build_the_same_signs(seed, k, hidden):
    bits = sign_bits(seed, k, hidden)
    assert bits.shape == (k, hidden) and bits.dtype == np.bool_
    spec = SketchSpec(k=k, seed=seed)
    mat = sign_matrix(spec, hidden)
    assert mat.dtype == torch.float32 and tuple(mat.shape) == (k, hidden)
    assert set(np.unique(mat.numpy()).tolist()) <= {-1.0, 1.0}
    np.testing.assert_array_equal(mat.numpy() < 0, bits)
    np.testing.assert_array_equal(signs(spec, hidden), np.where(bits, -1.0, 1.0))
    # and the capture's scaled matrix is those signs times 1/sqrt(K)
    scaled = Sketcher(spec).matrix(hidden, torch.device("cpu")).numpy().T
    np.testing.assert_array_equal(scaled, np.where(bits, -1.0, 1.0).astype(np.float32) * np.float32(spec.scale))


def test_seeds_pick_different_matrices_of_balanced_signs():
    a, b, c = sign_bits(0, 64, 1000), sign_bits(1, 64, 1000), sign_bits(2**32 - 1, 64, 1000)
    for bits in (a, b, c):
        assert 0.45 <= bits.mean() <= 0.55
        # no row is all one sign, and rows are not copies of each other
        assert 0.35 <= bits.mean(axis=1).min() and bits.mean(axis=1).max() <= 0.65
        assert len({row.tobytes() for row in bits}) == 64
    for x, y in ((a, b), (a, c), (b, c)):
        assert 0.45 <= (x != y).mean() <= 0.55  # unrelated, not a flipped or shifted copy
    assert np.array_equal(sign_bits(3, 64, 1000), sign_bits(3, 64, 1000))


@pytest.mark.parametrize("k,hidden", [(32, 512), (64, 1000), (256, 1024)])
def test_estimate_is_unbiased_with_spread_sqrt_2_over_k(k, hidden):
    rng = np.random.default_rng(1000 + k)
    n = 4000
    scale = np.exp(rng.uniform(-3, 3, (n, 1)))  # rows of very different sizes: the ratio must not care
    x = rng.standard_normal((n, hidden)) * scale
    y = x + rng.standard_normal((n, hidden)) * scale * np.exp(rng.uniform(-6, 0, (n, 1)))
    spec = SketchSpec(k=k, seed=11)
    est = np.sum(np.square(project(x, spec) - project(y, spec)), axis=1)
    ratio = est / np.sum(np.square(x - y), axis=1)
    spread = spec.spread
    assert spread == math.sqrt(2 / k)
    assert abs(ratio.mean() - 1) < 4 * ratio.std() / math.sqrt(n), (ratio.mean(), ratio.std())
    assert 0.8 * spread < ratio.std() < 1.2 * spread, (ratio.std(), spread)


def test_capture_sketcher_matches_the_exact_projection_within_float32():
    """What a capture stores (torch, float32) is the comparator's float64 projection of the same rows."""
    rng = np.random.default_rng(3)
    hidden, spec = 300, SketchSpec(k=64, seed=9)
    x = rng.standard_normal((50, hidden)).astype(np.float32)
    proj, sq = Sketcher(spec)(torch.from_numpy(x))
    assert proj.dtype == torch.float32 and sq.dtype == torch.float64
    exact = project(x.astype(np.float64), spec)
    # a float32 dot product of n terms is within n * eps * sum |terms| of the exact one
    bound = hidden * F32_EPS * (np.abs(x.astype(np.float64)) @ np.abs(signs(spec, hidden)).T) * spec.scale
    assert np.all(np.abs(proj.numpy() - exact) <= bound)
    np.testing.assert_allclose(sq.numpy(), np.sum(np.square(x.astype(np.float64)), axis=1), rtol=1e-12)


# -- the comparator's per-token estimates from real sketch dumps ----------------------------------
@pytest.fixture(scope="module")
def drifted(tmp_path_factory) -> dict[str, Path]:
    """A clean and a drifted run (layer 0's MLP weights perturbed: every later token differs) of a
    real Llama, each dumped whole and sketched with K=16 and K=64."""
    root = tmp_path_factory.mktemp("drift")
    torch.set_num_threads(2)
    ids = token_ids(4, 48)
    out: dict[str, Path] = {}
    for run in ("clean", "drift"):
        model = small_llama(hidden=128, layers=4)
        if run == "drift":
            with torch.no_grad():
                w = model.model.layers[0].mlp.down_proj.weight
                w.add_(0.02 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(5)))
        out[f"{run}-full"] = capture(model, ids, root / f"{run}-full")
        for k in (16, 64):
            out[f"{run}-k{k}"] = capture(model, ids, root / f"{run}-k{k}", sketch=k, sketch_seed=123)
    return out


def _token_values(base: Path, target: Path) -> dict[tuple[Any, ...], np.ndarray]:
    found: dict[tuple[Any, ...], np.ndarray] = {}

    def sink(t, tokens, decode_rows):
        found[(t.name, t.sequence, t.forward_pass, t.rank)] = np.array(tokens, dtype=np.float64)

    compare_dumps(base, target, token_sink=sink)
    return found


@pytest.mark.parametrize("k", [16, 64])
@pytest.mark.parametrize("sides", ["sketch/sketch", "full/sketch"])
def test_per_token_rel_diff_from_sketches_stays_within_its_spread(drifted, k, sides):
    full = _token_values(drifted["clean-full"], drifted["drift-full"])
    base = drifted[f"clean-k{k}"] if sides == "sketch/sketch" else drifted["clean-full"]
    sketched = _token_values(base, drifted[f"drift-k{k}"])
    assert sketched.keys() == full.keys()
    truth = np.concatenate([full[key] for key in sorted(full, key=str)])
    est = np.concatenate([sketched[key] for key in sorted(full, key=str)])
    assert truth.shape == est.shape
    moved = truth > 0
    assert moved.sum() >= 1000 and (~moved).sum() > 0, moved.sum()
    # layer 0's rows precede the change: identical rows are identical sketches (estimate exactly 0); a full side
    # projected in float64 against the capture's float32 is off by rounding only, far below any real difference
    if sides == "sketch/sketch":
        assert np.all(est[~moved] == 0)
    assert est[~moved].max() < 1e-5 * truth[moved].min(), (est[~moved].max(), truth[moved].min())
    ratio = est[moved] / truth[moved]
    spread = math.sqrt(2 / k)
    within = np.mean(np.abs(ratio - 1) <= 3 * spread)
    assert within >= 0.95, (within, np.quantile(ratio, [0.001, 0.5, 0.999]))
    # unbiased: the median of a chi-square over K sits just below its mean, well inside one spread
    assert abs(np.median(ratio) - 1) < spread / 2, np.median(ratio)


# -- hostile manifests and data files --------------------------------------------------------------
@pytest.fixture(scope="module")
def sketched(tmp_path_factory) -> dict[str, Path]:
    """A real K=8 sketch dump and a full dump of a hidden-32 Llama (16 tokens)."""
    root = tmp_path_factory.mktemp("sketched")
    torch.set_num_threads(2)
    model, ids = small_llama(), token_ids(1, 16)
    return {
        "sketch": capture(model, ids, root / "sketch", sketch=8, sketch_seed=42),
        "full": capture(model, ids, root / "full"),
    }


def edited(src: Path, dst: Path, edit: Callable[[dict], Any]) -> Path:
    """A copy of a dump whose manifest JSON went through ``edit`` (written plainly, as a hand edit would)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST_NAME).read_text())
    edit(m)
    (dst / MANIFEST_NAME).write_text(json.dumps(m))
    return dst


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def sig(m: dict) -> dict:
    return m["capture_signature"]["sketch"]


def rec0(m: dict) -> dict:
    return m["tensors"][0]


def _without(d: dict, key: str) -> None:
    del d[key]


SPEC_FIELD = "capture_signature.sketch: expected an object of kind, k and seed"


@pytest.mark.parametrize(
    "edit,field",
    [
        pytest.param(lambda m: sig(m).update(k=0), "capture_signature.sketch.k: expected an integer in 1..", id="k-0"),
        pytest.param(lambda m: sig(m).update(k="8"), "capture_signature.sketch.k: expected an integer", id="k-str"),
        pytest.param(lambda m: sig(m).update(k=True), "capture_signature.sketch.k: expected an integer", id="k-bool"),
        pytest.param(lambda m: sig(m).update(k=8.0), "capture_signature.sketch.k: expected an integer", id="k-float"),
        pytest.param(
            lambda m: sig(m).update(k=2**62), "capture_signature.sketch.k: expected an integer in 1..", id="k-huge"
        ),
        # a K wider than the rows it claims to project: the records say their hidden is 32
        pytest.param(
            lambda m: sig(m).update(k=64), "tensors[0].sketch.hidden: expected an integer >= K=64", id="k-above-hidden"
        ),
        # a K the records' shapes do not have
        pytest.param(lambda m: sig(m).update(k=4), "tensors[0].sketch: a sketch is F32 [..., 4]", id="k-not-shape"),
        pytest.param(
            lambda m: sig(m).update(seed=1.5),
            "capture_signature.sketch.seed: expected an integer in 0..",
            id="seed-float",
        ),
        pytest.param(
            lambda m: sig(m).update(seed="x"),
            "capture_signature.sketch.seed: expected an integer in 0..",
            id="seed-str",
        ),
        pytest.param(
            lambda m: sig(m).update(seed=-1),
            "capture_signature.sketch.seed: expected an integer in 0..",
            id="seed-negative",
        ),
        pytest.param(
            lambda m: sig(m).update(seed=2**40),
            "capture_signature.sketch.seed: expected an integer in 0..",
            id="seed-2**40",
        ),
        pytest.param(
            lambda m: sig(m).update(kind="gaussian"), "capture_signature.sketch.kind: expected one of", id="kind"
        ),
        pytest.param(
            lambda m: sig(m).update(kind=["rademacher"]),
            "capture_signature.sketch.kind: expected one of",
            id="kind-list",
        ),
        pytest.param(lambda m: _without(sig(m), "seed"), SPEC_FIELD, id="missing-key"),
        pytest.param(lambda m: sig(m).update(scale=0.125), SPEC_FIELD, id="extra-key"),
        pytest.param(lambda m: m["capture_signature"].update(sketch=[8, 42]), SPEC_FIELD, id="not-object"),
        pytest.param(
            lambda m: _without(m["capture_signature"], "sketch"),
            "tensors[0].sketch: a sketched record in a dump whose capture_signature has no sketch",
            id="record-sketch-without-signature",
        ),
        pytest.param(
            lambda m: m["capture_signature"].update(sketch=None),
            "tensors[0].sketch: a sketched record in a dump whose capture_signature has no sketch",
            id="signature-sketch-null",
        ),
        pytest.param(
            lambda m: rec0(m)["sketch"].update(hidden=4),
            "tensors[0].sketch.hidden: expected an integer >= K=8",
            id="record-hidden-below-k",
        ),
        pytest.param(
            lambda m: rec0(m)["sketch"].update(hidden="32"),
            "tensors[0].sketch.hidden: expected an integer",
            id="record-hidden-str",
        ),
        pytest.param(
            lambda m: rec0(m)["sketch"].update(dtype="I64"),
            "tensors[0].sketch.dtype: expected one of",
            id="record-source-dtype-int",
        ),
        pytest.param(
            lambda m: _without(rec0(m)["sketch"], "dtype"),
            "tensors[0].sketch: expected an object of hidden and dtype",
            id="record-sketch-missing-key",
        ),
        pytest.param(
            lambda m: rec0(m).update(sketch=8),
            "tensors[0].sketch: expected an object of hidden and dtype",
            id="record-sketch-int",
        ),
        pytest.param(
            lambda m: rec0(m).update(dtype="F16"),
            "tensors[0].sketch: a sketch is F32 [..., 8], the record is F16",
            id="record-dtype-f16",
        ),
        # the norms' key is another record's key
        pytest.param(
            lambda m: m["tensors"][1].update(key=rec0(m)["key"] + NORM_SUFFIX, file=rec0(m)["file"]),
            "tensors[1]: (file, key)",
            id="record-key-is-norms",
        ),
    ],
)
def test_hostile_sketch_manifest_is_one_corrupt_line(sketched, tmp_path, capsys, edit, field):
    bad = edited(sketched["sketch"], tmp_path / "bad", edit)
    prefix = f"{bad / MANIFEST_NAME}: {field}"
    with pytest.raises(CorruptDumpError) as e:
        load_manifest(bad)
    assert str(e.value).startswith(prefix) and "\n" not in str(e.value), str(e.value)
    assert compare_main([str(sketched["sketch"]), str(bad), "--quiet"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"error: {prefix}")


def _rewrite_file(dump: Path, name: str, edit: Callable[[dict[str, tuple[str, list[int], bytes]]], None]) -> None:
    """Rewrite data file ``name`` from its tensors after ``edit`` (key -> (dtype, shape, bytes)), as a consistent
    safetensors file, and record its new size in the manifest: only the tensors themselves are wrong."""
    raw = (dump / name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    meta = header.pop("__metadata__", None)
    tensors = {
        k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    }
    edit(tensors)
    new_header: dict[str, Any] = {} if meta is None else {"__metadata__": meta}
    blobs, offset = [], 0
    for k, (dtype, shape, blob) in tensors.items():
        new_header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(new_header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    (dump / name).write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    m = json.loads((dump / MANIFEST_NAME).read_text())
    m["files"][name] = (dump / name).stat().st_size
    (dump / MANIFEST_NAME).write_text(json.dumps(m))


def _norms_as_f32(tensors: dict[str, tuple[str, list[int], bytes]], key: str) -> None:
    dtype, shape, blob = tensors[key]
    tensors[key] = ("F32", shape, np.frombuffer(blob, dtype=np.float64).astype(np.float32).tobytes())


@pytest.mark.parametrize(
    "damage,what",
    [
        pytest.param(lambda t, key: t.pop(key), "missing from the file", id="norms-missing"),
        pytest.param(_norms_as_f32, "F32", id="norms-f32"),
        pytest.param(
            lambda t, key: t.update({key: ("F64", [t[key][1][0] - 1], t[key][2][8:])}), "F64", id="norms-short"
        ),
    ],
)
def test_damaged_norms_tensor_is_one_corrupt_line_when_read(sketched, tmp_path, damage, what):
    bad = tmp_path / "bad"
    shutil.copytree(sketched["sketch"], bad)
    rec = load_manifest(bad).tensors[0]
    assert rec.sketch == {"hidden": 32, "dtype": "F32"}
    _rewrite_file(bad, rec.file, lambda t: damage(t, rec.norm_key))
    load_manifest(bad)  # the manifest itself is intact: the damage shows when the norms are read
    with pytest.raises(CorruptDumpError) as e:
        DumpReader(bad).sq_norms(rec)
    assert str(bad / rec.file) in str(e.value) and rec.norm_key in str(e.value) and what in str(e.value), e.value
    with pytest.raises(CorruptDumpError) as e:
        compare_dumps(sketched["sketch"], bad)
    assert "\n" not in str(e.value) and rec.norm_key in str(e.value), e.value
    r = run_cli("comparator", sketched["sketch"], bad)
    assert r.returncode == 2 and not r.stdout.strip(), (r.returncode, r.stdout)
    line = one_line(r.stderr)
    assert str(bad / rec.file) in line and rec.norm_key in line, line


def test_sketch_fields_round_trip_and_a_full_dump_has_none(sketched):
    full_raw = json.loads((sketched["full"] / MANIFEST_NAME).read_text())
    assert "sketch" not in full_raw["capture_signature"]
    assert full_raw["tensors"] and all("sketch" not in t for t in full_raw["tensors"])
    full = load_manifest(sketched["full"])
    assert all(t.sketch is None and "sketch" not in t.to_json() for t in full.tensors)
    assert "sketch" not in full.to_json()["capture_signature"]

    sk = load_manifest(sketched["sketch"])
    assert sk.capture_signature["sketch"] == {"kind": "rademacher", "k": 8, "seed": 42}
    assert len(sk.tensors) == len(full.tensors)
    reader = DumpReader(sketched["sketch"], sk)
    for t, f in zip(sk.tensors, full.tensors, strict=True):
        assert t.name == f.name and t.point in POINTS
        assert t.sketch == {"hidden": 32, "dtype": "F32"} and t.to_json()["sketch"] == t.sketch
        assert t.dtype == "F32" and t.shape == (*f.shape[:-1], 8) and t.norm_key == t.key + NORM_SUFFIX
        assert reader.sq_norms(t).shape == (t.rows,)


# -- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sketch": 0}, r"\(--sketch\) must be an integer >= 1, got 0$"),
        ({"sketch": -8}, r"\(--sketch\) must be an integer >= 1, got -8$"),
        ({"sketch": True}, r"\(--sketch\) must be an integer >= 1, got True$"),
        ({"sketch": 8.0}, r"\(--sketch\) must be an integer >= 1, got 8.0$"),
        ({"sketch": 8, "sketch_seed": -1}, r"\(--sketch-seed\) must be an integer in 0..4294967295, got -1$"),
        (
            {"sketch": 8, "sketch_seed": 2**32},
            r"\(--sketch-seed\) must be an integer in 0..4294967295, got 4294967296$",
        ),
        ({"sketch": 8, "sketch_seed": 1.0}, r"\(--sketch-seed\) must be an integer in 0..4294967295, got 1.0$"),
        ({"sketch_seed": 3}, r"^capture\(sketch_seed=...\) needs sketch=K$"),
    ],
)
def test_capture_refuses_bad_sketch_arguments_before_writing(tmp_path, kwargs, match):
    model = small_llama()
    with pytest.raises(UsageError, match=match) as e:
        dumper.capture(model, tmp_path / "d", layers="all", points=POINTS, **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "d").exists()


def test_capture_refuses_k_wider_than_the_rows_and_writes_no_manifest(tmp_path):
    model = small_llama(hidden=32)
    with pytest.raises(UsageError, match=r"--sketch 64: .* has rows of 32 values; K must be at most that"):
        capture(model, token_ids(1, 8), tmp_path / "d", sketch=64)
    assert not (tmp_path / "d").exists()  # the directory the capture made, left empty, is removed


@pytest.mark.slow
def test_cli_refuses_bad_sketch_flags(tmp_path):
    runs = {"zero": ("--sketch", "0"), "wide": ("--sketch", "128"), "seed-alone": ("--sketch-seed", "3")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(
            zip(
                runs,
                pool.map(lambda name: run_cli("dumper", "run", "--out", tmp_path / name, "--quiet", *runs[name]), runs),
                strict=True,
            )
        )
    for name, r in done.items():
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert not (tmp_path / name).exists()
    assert "(--sketch) must be an integer >= 1, got 0" in one_line(done["zero"].stderr)
    # tiny-llama's rows are 64 wide
    assert "--sketch 128" in one_line(done["wide"].stderr) and "rows of 64 values" in done["wide"].stderr
    assert "--sketch-seed needs --sketch K" in one_line(done["seed-alone"].stderr)
