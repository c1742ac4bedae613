"""``extra.speculative`` (:mod:`dumper.format.speculative`): steps derived from recorded rows, checked on load, and
matched against an engine's own per-step counts; ``--speculative`` parsing and the sweep axis."""

from __future__ import annotations

import pytest

from dumper.engines.vllm.engine import check_engine_steps
from dumper.errors import CorruptDumpError, InternalError, UsageError
from dumper.format.speculative import Step, check_speculative_extra, derive_steps, speculative_extra, step_at
from dumper.jobs.sweep.grid import Axis, _axis_values
from dumper.prefill.speculative import parse_speculative

PROMPT = 10


def _rows(passes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(pass, sequence 0, position) of each pass's rows: ``(pass, first position, rows)``."""
    return [(f, 0, p) for f, first, n in passes for p in range(first, first + n)]


def test_steps_are_derived_from_the_passes_rows_each_next_pass_starting_after_the_kept_ones():
    # pass 1: 10 + 3 drafts, 1 kept (next at 12); pass 2: 12 + 2 drafts, both kept (next at 15); pass 3: 15 alone
    rows = [(0, 0, p) for p in range(PROMPT)] + _rows([(1, 10, 4), (2, 12, 3), (3, 15, 1)])
    steps = derive_steps(rows, [PROMPT])
    assert steps == [[Step(1, 10, 3, 1), Step(2, 12, 2, 2), Step(3, 15, 0, 0)]]
    extra = {"input_ids": [list(range(PROMPT))], "new_tokens": 7}
    extra["speculative"] = speculative_extra("ngram:k=3", {"method": "ngram", "num_speculative_tokens": 3}, steps)
    assert extra["speculative"]["rejected"] == [[[1, 12, 2]]]
    check_speculative_extra(extra, "dump")  # consistent: passes
    assert step_at(steps[0], 11) == (0, steps[0][0]) and step_at(steps[0], 12) == (1, steps[0][1])
    assert step_at(steps[0], 9) is None and step_at(steps[0], 16) is None


def _extra(steps: list, rejected: list, new: int = 7) -> dict:
    return {
        "input_ids": [list(range(PROMPT))],
        "new_tokens": new,
        "speculative": {"setting": "ngram:k=3", "num_speculative_tokens": 3, "steps": [steps], "rejected": [rejected]},
    }


@pytest.mark.parametrize(
    ("steps", "rejected", "field", "words"),
    [
        ([[1, 10, 3, 4], [2, 15, 0, 0]], [], "steps[0][0]", "accepted count at most the proposed count 3"),
        ([[1, 10, 3, 1], [2, 13, 2, 2]], [[1, 12, 2]], "steps[0][1]", "position 12"),
        ([[1, 10, 3, 1], [2, 12, 2, 2], [3, 15, 0, 0]], [[1, 11, 3]], "rejected[0][0]", "both kept and rejected"),
        ([[1, 10, 3, 1], [2, 12, 2, 2], [3, 15, 0, 0]], [], "rejected[0]", "rejected rows of pass 1"),
        ([[1, 10, 5, 1], [2, 12, 2, 2], [3, 15, 0, 0]], [[1, 12, 4]], "steps[0][0]", "num_speculative_tokens 3"),
        ([[2, 10, 3, 1], [1, 12, 2, 2], [3, 15, 0, 0]], [[2, 12, 2]], "steps[0][1]", "a forward pass after 2"),
        ([[1, 10, 3, 1], [2, 12, 2, 2]], [[1, 12, 2]], "steps[0]", "keep 6 fed tokens"),
    ],
)
def test_counts_that_do_not_add_up_name_the_field(steps, rejected, field, words):
    with pytest.raises(CorruptDumpError, match="extra.speculative.") as e:
        check_speculative_extra(_extra(steps, rejected), "dump")
    assert f"extra.speculative.{field}:" in str(e.value) and words in str(e.value), str(e.value)


def test_the_engines_own_counts_must_match_the_recorded_steps_but_the_drafts_past_the_output():
    end = 17  # prompt 10 + 8 tokens: fed positions 10..16
    mine = [[Step(1, 10, 3, 1), Step(2, 12, 3, 3), Step(3, 16, 0, 0)]]
    check_engine_steps(mine, [{"drafted": [3, 3, 3], "accepted": [1, 3, 2]}], [end])  # last: all past the output
    check_engine_steps(mine, [{"drafted": [3, 3], "accepted": [1, 3]}], [end])  # last proposed nothing
    near = [[Step(1, 10, 3, 3), Step(2, 14, 2, 1), Step(3, 16, 0, 0)]]  # pass 2's third draft past the output
    check_engine_steps(near, [{"drafted": [3, 3], "accepted": [3, 1]}], [end])
    with pytest.raises(InternalError, match="vLLM counted"):
        check_engine_steps(mine, [{"drafted": [3, 3], "accepted": [2, 3]}], [end])
    with pytest.raises(InternalError, match="vLLM counted"):
        check_engine_steps(mine, [{"drafted": [3, 3, 3, 1], "accepted": [1, 3, 0, 0]}], [end])


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("eagle:k=3", "unknown method 'eagle'"),
        ("ngram", "say how many drafts per step"),
        ("ngram:k=x", "k must be an integer"),
        ("ngram:k=3,depth=2", "'depth=2' is not one of"),
        ("ngram:k=3,min=4", "min=4 is more than max=3"),
        ("ngram:k=0", "k must be in 1..64"),
    ],
)
def test_a_bad_speculative_setting_is_one_line(text, words):
    with pytest.raises(UsageError, match=words):
        parse_speculative(text)


def test_the_sweep_axis_takes_off_and_settings_with_their_keys_joined_by_semicolons():
    assert _axis_values(Axis("speculative", ("off", "ngram:k=3;max=2")), {}, "vllm", None) == ["off", "ngram:k=3;max=2"]
    spec = parse_speculative("ngram:k=3;max=2")
    assert (spec.k, spec.lookup_max, spec.vllm_config()["prompt_lookup_max"]) == (3, 2, 2)
    with pytest.raises(UsageError, match="unknown method"):
        _axis_values(Axis("speculative", ("off", "medusa:k=2")), {}, "vllm", None)
