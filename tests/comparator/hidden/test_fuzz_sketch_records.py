"""Fuzzing sketch dumps: generated damage to the stored norms, the records' ``sketch`` fields and the manifest's
projection, judged against the full dump of the same forward.

A real Llama (hidden 64, 2 layers) is captured full and sketched (K=16) on one prompt. Each case
copies the sketch, damages it (norm values overwritten in place, ``sketch.hidden``/``sketch.dtype``
and ``capture_signature.sketch`` edited, or a sketch field dropped) and compares it against the
full dump in-process (:func:`tests.fuzzing.check_outcome`). The oracle: a negative norm, a width
the model contradicts, a sketch claim the records do not bear out is exit 2; a NaN or Inf norm
fails (exit 1), never passes; untouched norms of the same forward pass.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dumper
from comparator.cli.main import main as compare_main
from dumper.format import MANIFEST_NAME, load_manifest
from dumper.format.sketch import NORM_SUFFIX
from tests.comparator.hidden.test_sketch_records import HIDDEN, TOKENS, K, _llama
from tests.fuzzing import FUZZ, check_outcome, edit_stored, run_child, run_main

NORM_VALUES = [0.0, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, -1.0, -1e-300, -0.0]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-sketch")
    ids = torch.randint(3, 128, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    for name, sketch in (("full", None), ("sketch", K)):
        model = _llama()
        with torch.inference_mode(), dumper.capture(model, root / name, layers="all", sketch=sketch):
            model(input_ids=ids)
    return {"full": root / "full", "sketch": root / "sketch", "root": root}


_N = itertools.count()


@pytest.mark.slow
@given(data=st.data())
@settings(FUZZ, max_examples=50)
def test_generated_sketch_damage(world: dict[str, Path], data: st.DataObject) -> None:
    case = world["root"] / "cases" / str(next(_N))
    shutil.copytree(world["sketch"], case)
    m = json.loads((case / MANIFEST_NAME).read_text())
    sketched = [i for i, t in enumerate(m["tensors"]) if t.get("sketch")]
    op = data.draw(st.sampled_from(["norm", "norm", "hidden", "dtype", "signature", "drop"]), label="op")
    expect: set[int]
    if op == "norm":
        rec = load_manifest(case).tensors[data.draw(st.sampled_from(sketched))]
        row, value = data.draw(st.integers(0, TOKENS - 1)), data.draw(st.sampled_from(NORM_VALUES))

        def put(norms: np.ndarray) -> None:
            norms[row] = value

        edit_stored(case / rec.file, rec.key + NORM_SUFFIX, np.float64, put)
        expect = {2} if value < 0 else {1} if not math.isfinite(value) else {0, 1}
    else:
        i = data.draw(st.sampled_from(sketched))
        if op == "hidden":
            v = data.draw(st.sampled_from([HIDDEN + 1, HIDDEN - 1, K - 1, 0, -HIDDEN, 2**41, "64", None, 64.0]))
            m["tensors"][i]["sketch"]["hidden"] = v
        elif op == "dtype":
            m["tensors"][i]["sketch"]["dtype"] = data.draw(st.sampled_from(["F64", "BF16", "I64", "f32", "", None]))
        elif op == "signature":
            m["capture_signature"]["sketch"] = data.draw(
                st.sampled_from(
                    [
                        None,
                        {"kind": "rademacher", "k": K, "seed": 1},
                        {"kind": "rademacher", "k": K + 1, "seed": 0},
                        {"kind": "gauss", "k": K, "seed": 0},
                        {"kind": "rademacher", "k": 0, "seed": 0},
                        [],
                        "x",
                    ]
                )
            )
        else:
            del m["tensors"][i]["sketch"]
        (case / MANIFEST_NAME).write_text(json.dumps(m))
        expect = {0, 1, 2} if op in ("dtype", "signature") else {2}
        v = m["tensors"][i].get("sketch", {}).get("hidden")
        if op == "hidden" and type(v) is int and v == HIDDEN:
            expect = {0}  # 64.0 is no int: refused; an int equal to the model's is sound
        if op == "dtype" and m["tensors"][i]["sketch"]["dtype"] in ("BF16", "F64"):
            expect = {0, 1}  # another source dtype: a sound record (the estimate is of the same rows)
        elif op == "dtype":
            expect = {2}
    side = data.draw(st.sampled_from(["target", "baseline"]), label="side")
    o = run_main(
        compare_main, [world["full"], case, "--quiet"] if side == "target" else [case, world["full"], "--quiet"]
    )
    code = check_outcome(o)
    assert code in expect, (op, code, o.out, o.err)


@pytest.mark.slow
def test_a_large_sketch_with_a_negative_norm_at_its_end_in_bounded_memory(tmp_path):
    """200,000 rows of a 4,096-wide hidden state sketched to 64: the negative norm of the last row is refused in
    one line; peak RSS measured in a child."""
    n, width = 200_000, 4096
    with dumper.capture(None, tmp_path / "a", sketch=64) as cap:
        for start in range(0, n, 20_000):
            x = torch.randn(20_000, width, generator=torch.Generator().manual_seed(start))
            cap.record(
                "model.layers.0.input",
                x,
                layer=0,
                point="input",
                positions=range(start, start + 20_000),
                sequence_ids=[0] * 20_000,
            )
            cap.step()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    last = load_manifest(tmp_path / "b").tensors[-1]

    def put(norms: np.ndarray) -> None:
        norms[-1] = -2.0

    edit_stored(tmp_path / "b" / last.file, last.key + NORM_SUFFIX, np.float64, put)
    code, err, peak = run_child("comparator", tmp_path / "a", tmp_path / "b", "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and "row 19999 is -2.0" in err, err
    assert peak < 600 << 20, peak
