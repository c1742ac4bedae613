"""The result types of a comparison, in one place, and the one way to read a report's JSON back.

The types live where they are computed: the hidden-state ones in :mod:`comparator.hidden.types`
(:class:`Report`, :class:`TensorComparison`, ...), the logprob verdict in :mod:`comparator.logprobs`;
this module re-exports them and imports only downward. Each type's ``to_json`` has a
``from_json`` beside it; :func:`report_from_json` and :func:`load_report` are the entry point
for a report from outside (a file, a pipe, a stored run), turning a malformed one into a
one-line error. Files are written by :mod:`comparator.reports.files`, and the words for an
outcome come from :mod:`comparator.outcome`.

Example::

    from comparator.results import load_report
    report = load_report("report.json")     # what `python -m comparator A B --json report.json` wrote
    print(report.passed, report.first_divergent)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comparator.exports import lazy_exports
from comparator.hidden.types import (
    Report,
)
from dumper.errors import CorruptDumpError, DumpError, UsageError
from dumper.format.files import parse_json, read_regular_file

__all__ = ["LogprobVerdict", "MAX_REPORT_BYTES", "report_from_json", "load_report"]

# the logprob verdict's module (and comparator.logprobs with it) loads on first use, not with every comparison
__getattr__, __dir__ = lazy_exports(__name__, {"LogprobVerdict": "comparator.logprobs.types"}, globals())

MAX_REPORT_BYTES = 1 << 30
"""The largest report file read, by :func:`load_report` and from a run store (``report.json``); its JSON is also
bounded in memory before parsing."""


def report_from_json(d: Mapping[str, Any], where: str = "report") -> Report:
    """:meth:`Report.from_json`, with a malformed report a one-line :class:`CorruptDumpError` naming ``where``."""
    if not isinstance(d, Mapping):
        raise CorruptDumpError(f"{where}: not a comparison report (not a JSON object)")
    try:
        return Report.from_json(dict(d))
    except KeyError as e:
        raise CorruptDumpError(f"{where}: not a comparison report (no {e.args[0]!r})") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CorruptDumpError(f"{where}: malformed comparison report ({' '.join(str(e).split())[:200]})") from None


def load_report(path: str | os.PathLike[str]) -> Report:
    """Read the JSON report at ``path`` (``--json``, ``--format json``); any problem is a one-line
    :class:`UsageError` naming the file. Read as untrusted: a FIFO or a device is refused, and a file
    over :data:`MAX_REPORT_BYTES` before it is read."""
    where = str(path)
    try:
        return report_from_json(
            parse_json(read_regular_file(Path(path), MAX_REPORT_BYTES, "report"), where, "report"), where
        )
    except DumpError as e:
        raise UsageError(str(e)) from None
