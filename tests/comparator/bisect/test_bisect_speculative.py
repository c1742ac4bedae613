"""``python -m comparator bisect`` over speculative dumps, unchanged: the builds' runs are ``--speculative`` decodes.

The ladder's bad builds seed a bug in layer 2 that fires only on the verify rows of draft index 2 and more
(:mod:`tests.bisect_ladder`, ``{"draft": L}``); every run is a real ``python -m dumper run --new-tokens 12
--speculative ngram:k=3`` of the tiny-llama preset, and the baseline is the good build's speculative dump. The
bisection compares kept rows only, as any comparison of a speculative dump does, so the first bad build is named, its
report at layer 3's input, at the first kept row of draft index 2.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from comparator.bisect.search import run_bound
from comparator.hidden.types import FirstDivergence
from dumper.format import load_manifest
from dumper.format.speculative import steps_of
from tests.bisect_ladder import SPEC_PROMPT, dump_command, ladder
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

LAYER = 2
SPEC = "--new-tokens 12 --speculative ngram:k=3 --logprobs --top-k 2"


@pytest.fixture(scope="module")
def gold(tmp_path_factory):
    """The golden baseline: the good build's speculative dump (no build on the path), with drafts kept at index 2."""
    root = tmp_path_factory.mktemp("bisect-spec-gold")
    r = run_cli(
        "dumper",
        "run",
        "--model",
        "tiny-llama",
        "--layers",
        "all",
        "--input-ids",
        SPEC_PROMPT,
        *shlex.split(SPEC),
        "--out",
        root / "gold",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    return root / "gold"


def test_bisect_names_the_first_build_whose_verify_rows_of_draft_index_2_diverge(gold, tmp_path):
    (steps,) = steps_of(load_manifest(gold).extra)
    kept = [i for i, st in enumerate(steps) if st.accepted >= 2]
    assert kept, steps  # else the bug never reaches a kept row
    first_step = kept[0]
    first_row = steps[first_step].position + 2  # the first kept row of draft index 2: the first the bug reaches

    n, bad_from = 6, 3
    builds = ladder(tmp_path / "builds", n, bad_from=bad_from, bug={"draft": LAYER})
    (tmp_path / "builds.txt").write_text("\n".join(builds) + "\n")
    r = run_cli(
        "comparator",
        "bisect",
        gold,
        "--builds",
        tmp_path / "builds.txt",
        "--run",
        dump_command(SPEC, prompt=SPEC_PROMPT),
        "--work",
        tmp_path / "work",
        "--json",
        tmp_path / "out.json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["first_bad"] == builds[bad_from] and result["last_good"] == builds[bad_from - 1], result
    assert result["runs"] <= run_bound(n) and not result["skipped"], result
    tested = {t["index"]: t for t in result["tested"]}
    assert all(t["outcome"] == ("bad" if i >= bad_from else "good") for i, t in tested.items()), tested

    verdict = result["verdict"]
    fd = verdict["first_divergent"]
    assert not verdict["passed"] and fd is not None
    assert (fd["layer"], fd["name"]) == (LAYER + 1, f"model.layers.{LAYER + 1}.self_attn.input"), fd
    assert (fd["token"], fd["phase"]) == (first_row, "decode"), (fd, steps)
    assert (tested[bad_from]["first_divergent"]["layer"], tested[bad_from]["first_divergent"]["token"]) == (
        LAYER + 1,
        first_row,
    )
    if "draft_index" in {f.name for f in dataclasses.fields(FirstDivergence)}:  # the comparator names the draft
        assert (fd["draft_index"], fd["verify_step"]) == (2, first_step), fd
