"""The search: binary search over builds ordered oldest first, with skips, as ``git bisect`` does it.

Both endpoints are judged first: the first build must be good and the last bad (else
:class:`EndpointError`, exit 2, naming which). Then the build nearest the middle of the builds
between the last good and the first bad one is judged, and the interval halves. A build that
cannot be judged is a skip: it is never counted good or bad, and the next nearest untested build
is tried instead. When only skipped builds remain between the last good and the first bad build,
the answer is every build that may be the first bad one (the skipped ones and that first bad one).

Without skips, N builds take at most ceil(log2(N)) + 2 runs (:func:`run_bound`). The judge is any
callable ``index -> BuildRun``; builds already judged (``done``, from an interrupted bisection's
state) are not judged again.

Example::

    from comparator.bisect.search import bisect
    result = bisect(["v1", "v2", "v3", "v4"], judge)   # judge(i) runs and judges build i
    result.first_bad, [r.build for r in result.tested]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from comparator.bisect.types import BAD, GOOD, SKIP, BisectResult, BuildRun
from dumper.errors import DriftscopeError, UsageError

__all__ = ["EndpointError", "run_bound", "runs_left", "bisect"]


class EndpointError(DriftscopeError):
    """The first build is not good, or the last one not bad: there is nothing to bisect (exit 2)."""


def run_bound(n: int) -> int:
    """The most runs a bisection of ``n`` builds takes without skips: ceil(log2(n)) + 2 (both endpoints first)."""
    return math.ceil(math.log2(n)) + 2 if n > 1 else n


def runs_left(untested: int) -> int:
    """The most runs a binary search still takes over ``untested`` builds between the last good and first bad one."""
    return math.ceil(math.log2(untested + 1)) if untested > 0 else 0


def _endpoint(builds: Sequence[str], run: BuildRun, want: str) -> None:
    which = "first" if run.index == 0 else "last"
    if run.outcome == want:
        return
    why = f" ({run.headline})" if run.headline else ""
    raise EndpointError(
        f"the {which} build {builds[run.index]!r} (line {run.index + 1}) is {run.outcome}{why}; the "
        f"{which} build must be {want}: list the builds oldest first, from a known good one to a "
        "known bad one"
    )


def _untested(known: Mapping[int, BuildRun], lo: int, hi: int) -> list[int]:
    return [i for i in range(lo + 1, hi) if i not in known]


def _middle(candidates: list[int], lo: int, hi: int) -> int:
    """The candidate nearest the middle of (lo, hi), the lower one on a tie."""
    mid = (lo + hi) / 2
    return min(candidates, key=lambda i: (abs(i - mid), i))


def bisect(
    builds: Sequence[str],
    judge: Callable[[int], BuildRun],
    *,
    done: Mapping[int, BuildRun] | None = None,
    on_run: Callable[[BuildRun, int], None] | None = None,
) -> BisectResult:
    """Find the first bad build among ``builds`` (oldest first) with ``judge``.

    ``done``: builds judged before (by index), reused as they are. ``on_run(run, left)`` is called
    after each new run with the most runs still to go. Raises :class:`EndpointError` when the first
    build is not good or the last not bad.
    """
    if len(builds) < 2:
        raise UsageError(f"bisect needs at least 2 builds (a good one, then a bad one); got {len(builds)}")
    known: dict[int, BuildRun] = dict(done or {})
    tested: list[BuildRun] = list(known.values())
    n = len(builds)
    lo, hi = 0, n - 1

    def get(i: int) -> BuildRun:
        nonlocal lo, hi
        if i not in known:
            known[i] = run = judge(i)
            tested.append(run)
            if 0 < i < n - 1 and run.outcome != SKIP:
                lo, hi = (i, hi) if run.outcome == GOOD else (lo, i)
            if on_run is not None:
                ends = sum(e not in known for e in (0, n - 1))
                on_run(run, ends + runs_left(len(_untested(known, lo, hi))))
        return known[i]

    _endpoint(builds, get(0), GOOD)
    _endpoint(builds, get(n - 1), BAD)
    # a resumed bisection: every good build it judged lies before every bad one (it never left the interval)
    lo = max(i for i, r in known.items() if r.outcome == GOOD)
    hi = min(i for i, r in known.items() if r.outcome == BAD)
    while candidates := _untested(known, lo, hi):
        get(_middle(candidates, lo, hi))
    skipped = tuple(i for i in range(lo + 1, hi) if known[i].outcome == SKIP)
    notes = (
        ()
        if not skipped
        else (
            f"{len(skipped)} skipped build{'s' * (len(skipped) > 1)} between the last good and "
            f"the first bad one hide which of the {len(skipped) + 1} candidates broke it",
        )
    )
    return BisectResult(
        builds=tuple(builds),
        tested=tuple(tested),
        last_good=lo,
        first_bad=None if skipped else hi,
        candidates=(*skipped, hi),
        bound=run_bound(n),
        notes=notes,
    )
