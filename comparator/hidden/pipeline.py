"""Run a comparison's jobs (one per tensor) a few at a time, their results in order.

A job is Python work around kernel calls: matching its rows, then judging the sums. Run one at
a time, the kernel threads idle through that Python between tensors (a quarter of a comparison
of many 8 MiB tensors). Run ``threads`` at once, each with one kernel thread, one job's Python
overlaps the others' kernels; the last job gets every thread, so a comparison of one tensor
still uses them all. Results come back in job order, and a job's numbers do not depend on its
thread count (:mod:`comparator.hidden.kernels` cuts the same row ranges), so a report, the
progress and a calibration's token sink are the same whatever ``threads``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["in_order"]

T = TypeVar("T")


def in_order(jobs: Sequence[Callable[[int], T]], threads: int) -> Iterator[T]:
    """Each ``job(kernel_threads)``'s result, in job order, with up to ``threads`` jobs running at once.

    A job that raises stops the rest: its error is raised here once the jobs already running end.
    """
    if threads < 2 or len(jobs) < 2:
        for job in jobs:
            yield job(threads)
        return
    pool = ThreadPoolExecutor(threads, "driftscope-compare")
    running: deque[Future[T]] = deque()
    try:
        for i, job in enumerate(jobs):
            running.append(pool.submit(job, threads if i == len(jobs) - 1 else 1))
            if len(running) == threads:
                yield running.popleft().result()
        while running:
            yield running.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
