"""Which failing tensor is "the first divergence": lowest layer, then earliest token, then a fixed tie order."""

from __future__ import annotations

from comparator.hidden.localize import first_divergence
from comparator.hidden.types import TensorComparison


def tc(
    name: str,
    layer: int | None,
    *,
    token: int | None = None,
    passed: bool = False,
    rel: float = 1e-2,
    max_token: float = 1e-2,
    worst: int | None = None,
    sequence: int | None = 0,
    forward_pass: int = 0,
    rank: int = 0,
) -> TensorComparison:
    """A comparison result; ``token`` its first failing token (None: failed by the whole-tensor rel_diff only)."""
    return TensorComparison(
        name=name,
        layer=layer,
        forward_pass=forward_pass,
        rank=rank,
        shape=(8, 4),
        metrics={
            "rel_diff": rel,
            "max_token_rel_diff": max_token,
            "max_abs_diff": 0.1,
            "mean_abs_diff": 0.01,
            "cosine": 0.99,
        },
        nan_baseline=0,
        inf_baseline=0,
        nan_target=0,
        inf_target=0,
        nonfinite_mismatches=0,
        failing_tokens=0 if token is None else 1,
        first_failing_token=token,
        first_failing_row=token,
        first_failing_sequence=None if token is None else sequence,
        worst_token=worst,
        worst_row=worst,
        passed=passed,
        sequence=sequence,
        failing_ranges=[] if token is None else [[token, token]],
    )


def test_nothing_failed():
    assert first_divergence([tc("a", 0, passed=True), tc("b", None, passed=True)]) is None
    assert first_divergence([]) is None


def test_the_lowest_failing_layer_wins_over_an_earlier_token_higher_up():
    found = first_divergence([tc("l5", 5, token=0), tc("l2", 2, token=40), tc("l1", 1, passed=True)])
    assert found is not None
    fd, first = found
    assert (fd.layer, fd.name, fd.token, first.name) == (2, "l2", 40, "l2")


def test_within_the_layer_the_earliest_token_wins_and_the_layer_is_summarized():
    ts = [
        tc("q", 3, token=9, rel=0.5, max_token=0.2, worst=9, sequence=1),
        tc("k", 3, token=4, rel=0.1, max_token=0.9, worst=6, sequence=0),
        tc("v", 3, token=None, rel=0.3, max_token=0.1, worst=2),
    ]  # failed without a failing token
    fd, first = first_divergence(ts)
    assert (fd.name, fd.token, fd.sequence) == ("k", 4, 0)
    assert fd.rel_diff == 0.5  # the largest of the layer
    assert fd.worst_token == 6  # from the tensor with the largest per-token rel_diff
    assert fd.failing_sequences == [0, 1] and fd.failing_ranges == [[4, 4]] and first is ts[1]


def test_a_tensor_without_a_failing_token_comes_after_every_one_with_one():
    fd, _ = first_divergence([tc("a", 0, token=None), tc("b", 0, token=70)])
    assert (fd.name, fd.token) == ("b", 70)
    fd, _ = first_divergence([tc("a", 0, token=None)])
    assert (fd.name, fd.token) == ("a", None)


def test_ties_go_to_the_lower_sequence_then_pass_then_rank_then_name():
    same = dict(token=5)
    assert first_divergence([tc("x", 1, sequence=2, **same), tc("y", 1, sequence=1, **same)])[0].name == "y"
    assert first_divergence([tc("x", 1, forward_pass=3, **same), tc("y", 1, forward_pass=2, **same)])[0].name == "y"
    assert first_divergence([tc("x", 1, rank=1, **same), tc("y", 1, rank=0, **same)])[0].rank == 0
    assert first_divergence([tc("b", 1, **same), tc("a", 1, **same)])[0].name == "a"
    # a tensor without a sequence (not aligned by rows) sorts before sequence 0
    assert first_divergence([tc("x", 1, sequence=0, **same), tc("y", 1, sequence=None, **same)])[0].name == "y"


def test_tensors_without_a_layer_count_only_when_no_layered_tensor_failed():
    fd, _ = first_divergence([tc("logits", None, token=0), tc("l7", 7, token=30)])
    assert (fd.name, fd.layer) == ("l7", 7)
    fd, _ = first_divergence([tc("logits", None, token=3), tc("extra", None, token=1), tc("l7", 7, passed=True)])
    assert (fd.name, fd.layer, fd.token) == ("extra", None, 1)
