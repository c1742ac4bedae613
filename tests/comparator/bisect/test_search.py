"""The bisection's search, its work directory and its commands, without a model: the oracle here is a list of
outcomes (the search is a pure function of them), the commands are real shell processes.

The end-to-end bisections over real builds and dumps are in ``test_bisect.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.bisect.run import bisect_builds, render, run_command
from comparator.bisect.search import EndpointError, bisect, run_bound
from comparator.bisect.state import Plan, open_work, save_state
from comparator.bisect.types import BAD, GOOD, SKIP, BisectResult, BuildRun
from dumper.errors import UsageError


def _judge(outcomes: list[str], calls: list[int]):
    def judge(i: int) -> BuildRun:
        calls.append(i)
        return BuildRun(i, f"b{i}", outcomes[i], 0 if outcomes[i] != SKIP else 1, 0.0)

    return judge


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 200).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(1, n - 1), st.sets(st.integers(0, n), max_size=n // 3))
    )
)
def test_the_first_bad_build_or_every_candidate_is_found(case):
    n, k, skips = case
    skips = {s for s in skips if 0 < s < n - 1}  # the endpoints run
    outcomes = [SKIP if i in skips else GOOD if i < k else BAD for i in range(n)]
    calls: list[int] = []
    result = bisect([f"b{i}" for i in range(n)], _judge(outcomes, calls))
    assert len(calls) == len(set(calls)) == result.runs  # no build judged twice
    truth = min(i for i in range(k, n) if i not in skips)  # the first build that shows the bug
    if result.first_bad is not None:
        assert result.first_bad == truth and all(i in skips for i in range(k, truth))
    else:
        assert set(result.candidates[:-1]) <= skips and result.candidates[-1] == truth
    if not skips:
        assert result.runs <= run_bound(n) and result.first_bad == k


def test_the_bound_is_met_exactly_and_skips_cost_one_run_each():
    for n in (2, 3, 16, 17, 64, 1000):
        worst = max(
            len(bisect([str(i) for i in range(n)], _judge([GOOD] * k + [BAD] * (n - k), [])).tested)
            for k in range(1, n)
        )
        assert worst <= run_bound(n), (n, worst)
    assert run_bound(16) == 6 and run_bound(64) == 8


@pytest.mark.parametrize(
    "outcomes,words",
    [
        ([BAD, BAD], "the first build 'b0' (line 1) is bad"),
        ([GOOD, GOOD], "the last build 'b1' (line 2) is good"),
        ([SKIP, BAD], "the first build 'b0' (line 1) is skip"),
    ],
)
def test_endpoints_are_judged_first_and_must_hold(outcomes, words):
    calls: list[int] = []
    with pytest.raises(EndpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        bisect(["b0", "b1"], _judge(outcomes, calls))
    assert calls[0] == 0


def test_a_resumed_search_reuses_what_was_judged():
    outcomes = [GOOD] * 20 + [BAD] * 12
    first: list[int] = []
    whole = bisect([f"b{i}" for i in range(32)], _judge(outcomes, first))
    done = {r.index: r for r in whole.tested[:3]}
    again: list[int] = []
    resumed = bisect([f"b{i}" for i in range(32)], _judge(outcomes, again), done=done)
    assert resumed.first_bad == whole.first_bad == 20 and again == first[3:]


def test_the_result_json_round_trips():
    result = bisect([f"b{i}" for i in range(8)], _judge([GOOD] * 3 + [SKIP] + [BAD] * 4, []))
    assert BisectResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_a_work_directory_is_never_overwritten_and_a_foreign_state_is_refused(tmp_path):
    plan = Plan(("a", "b"), "run {build} {out}", "gold")
    assert open_work(tmp_path, plan, resume=False) == ({}, None)
    with pytest.raises(UsageError, match="holds a bisection already"):
        open_work(tmp_path, plan, resume=False)
    save_state(tmp_path, plan, [BuildRun(0, "a", GOOD, 0, 1.0)])
    assert open_work(tmp_path, plan, resume=True)[0][0].outcome == GOOD
    with pytest.raises(UsageError, match="other builds"):
        open_work(tmp_path, Plan(("a", "c"), plan.command, plan.baseline), resume=True)
    with pytest.raises(UsageError, match="no bisection to resume"):
        open_work(tmp_path / "new", plan, resume=True)


@pytest.mark.parametrize(
    "tested,words",
    [
        ('[{"index": 5, "build": "a", "outcome": "good", "seconds": 1}]', "is not build 5"),
        ('[{"index": 0, "build": "a", "outcome": "great", "seconds": 1}]', "does not read"),
        ('{"x": 1}', "not a bisection state"),
    ],
)
def test_a_hostile_state_file_is_one_line(tmp_path, tested, words):
    plan = Plan(("a", "b"), "run {out}", "gold")
    state = {"version": 1, **plan.fields(), "tested": json.loads(tested)}
    (tmp_path / "bisect.json").write_text(json.dumps(state))
    with pytest.raises(UsageError, match=words):
        open_work(tmp_path, plan, resume=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_command_is_quoted_and_a_timeout_kills_the_whole_group(tmp_path):
    assert render("x {build} -o {out}", "a b;rm -rf /", Path("/o u")) == "x 'a b;rm -rf /' -o '/o u'"
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    code, last = run_command(f"echo starting; sleep 60 & echo $! > {pid_file}; wait", tmp_path / "log", timeout=1.0)
    assert code is None and last == "starting" and time.monotonic() - start < 30
    status = Path(f"/proc/{int(pid_file.read_text())}/status")
    time.sleep(0.2)  # the sleep its shell started is gone too (or a zombie no one has reaped yet)
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_builds_that_time_out_or_leave_nothing_are_skips(tmp_path):
    gold = tmp_path / "gold"
    gold.mkdir()
    with pytest.raises(Exception, match="manifest"):  # an unusable baseline stops before any build runs
        bisect_builds(gold, ["a", "b"], "true {out}", tmp_path / "w")
    with pytest.raises(UsageError, match="has no {out}"):
        bisect_builds(gold, ["a", "b"], "true", tmp_path / "w")
