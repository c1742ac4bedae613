"""``python -m dumper sweep --engine vllm``: invariance cells on real vLLM (CPU build) against one HF fp32 baseline.

Every cell is a real vLLM engine in its default multiprocess mode, started by the sweep's own
CLI in a subprocess. The engines run eager (``--engine-arg enforce_eager=true``): what a sweep
checks is invariance to scheduling and caching, and compiled engine starts would cost
minutes here; the compiled capture is tested in ``tests/dumper/engines``.

- Every cell of chunk size x prefix caching passes in fp32 with both prompts batched
  (``max_num_seqs=4``; the chunk-boundary sweep below runs one request at a time), and the
  prefix-caching cells were judged on rows computed on top of reused KV blocks (hits > 0).
- A bug seeded in vLLM's CPU attention at chunk boundaries (``tests/vllm_seed/chunk_bug.py``:
  rows of a request that continues from an earlier engine step) fails exactly the cells that
  chunk the prompts, each at the first boundary, in the layer after the bug.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import need, shared_checkpoint

_rng = np.random.default_rng(11)
PROMPTS = [[1] + _rng.integers(3, 300, 299).tolist(), [1] + _rng.integers(3, 300, 199).tolist()]  # > 1 KV block
BUG_LAYER = 1
"""The seeded bug perturbs this layer's attention output, so the first input it reaches is the next layer's."""
SEED_DIR = ROOT / "tests" / "vllm_seed"
EAGER = ("--engine-arg", "enforce_eager=true")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(checkpoint, root): the HF fp32 baseline of :data:`PROMPTS`, every layer, with logprobs."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-sweep")
    ckpt = shared_checkpoint()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    r = run_cli(
        "dumper",
        "run",
        "--model",
        ckpt,
        "--prompts",
        prompts,
        "--layers",
        "all",
        "--logprobs",
        "--top-k",
        "5",
        "--out",
        root / "hf",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    return ckpt, root


def _sweep(base, out, *grid: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> tuple[int, dict]:
    ckpt, root = base
    r = run_cli(
        "dumper",
        "sweep",
        "--engine",
        "vllm",
        "--model",
        ckpt,
        "--baseline",
        root / "hf",
        *EAGER,
        *args,
        *(a for g in grid for a in ("--grid", g)),
        "--out",
        out,
        "--json",
        out.parent / f"{out.name}.json",
        env=env,
    )
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    return r.returncode, json.loads((out.parent / f"{out.name}.json").read_text())


@pytest.mark.engine
def test_every_cell_of_chunk_size_and_prefix_caching_passes_in_fp32(base, tmp_path):
    rc, result = _sweep(
        base,
        tmp_path / "clean",
        "chunk_size=none,64",
        "enable_prefix_caching=false,true",
        args=("--engine-arg", "max_num_seqs=4", "--logprobs", "--top-k", "5"),
    )
    cells = result["cells"]
    assert rc == 0 and result["passed"] and len(cells) == 4, [(c["settings"], c["reasons"]) for c in cells]
    for c in cells:
        report = json.loads(open(c["report"]).read())
        assert c["passed"] and report["passed"] and report["matched"] > 0
        if c["settings"]["enable_prefix_caching"]:
            # warmed: every prompt read its full KV blocks from the cache; only the rows above them were judged
            hits = c["cache_hits_by_sequence"]
            assert c["cache_hits"] == sum(hits) and all(h >= 128 and h % 128 == 0 for h in hits), hits
            for s, p in enumerate(PROMPTS):
                assert {t["shape"][0] for t in report["tensors"] if t["sequence"] == s} == {len(p) - hits[s]}
        else:
            assert c["cache_hits"] in (None, 0) and c["logprobs"]["passed"]
            assert c["logprobs"]["compared_positions"] == sum(len(p) - 1 for p in PROMPTS)


@pytest.mark.engine
def test_a_chunk_boundary_bug_fails_exactly_the_chunked_cells_at_the_first_boundary(base, tmp_path):
    env = {
        "PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))),
        "DRIFTSCOPE_TEST_SEED": json.dumps({"chunk_layer": BUG_LAYER, "add": 0.5}),
    }
    rc, result = _sweep(
        base, tmp_path / "bug", "chunk_size=none,64,128", env=env, args=("--engine-arg", "max_num_seqs=1")
    )  # one request at a time: every prompt chunks alike
    cells = {c["settings"]["chunk_size"]: c for c in result["cells"]}
    assert rc == 1 and not result["passed"] and set(cells) == {None, 64, 128}
    assert cells[None]["passed"], cells[None]["reasons"]  # one step per prompt: no boundary, no bug
    for chunk in (64, 128):
        c = cells[chunk]
        fd = c["first_divergent"]
        assert not c["passed"] and fd["layer"] == BUG_LAYER + 1, (chunk, fd)
        assert fd["token"] == chunk, (chunk, fd)  # the first row computed after the first boundary
        report = json.loads(open(c["report"]).read())
        earlier = [t for t in report["tensors"] if t["layer"] is not None and t["layer"] <= BUG_LAYER]
        assert earlier and all(t["passed"] for t in earlier)  # nothing before the bug's layer moved
