"""Which build broke it: bisection over builds (or engine settings) with a dump comparison as the oracle.

:mod:`.search` is the binary search with skips; :mod:`.run` runs each build's command and judges
its dump; :mod:`.state` keeps the work directory that ``--resume`` goes on from; :mod:`.types` the
results. The command line is ``python -m comparator bisect`` (:mod:`comparator.cli.bisect`).
"""

from comparator.bisect.run import bisect_builds
from comparator.bisect.search import EndpointError, run_bound
from comparator.bisect.types import BAD, GOOD, SKIP, BisectResult, BuildRun

__all__ = ["bisect_builds", "run_bound", "EndpointError", "BisectResult", "BuildRun", "GOOD", "BAD", "SKIP"]
