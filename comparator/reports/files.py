"""The report as data files: JSON (the public contract), and the per-tensor table as CSV or Parquet.

Every file is written atomically (temp file, fsync, rename): a reader never sees half a report.
The report carries no renderer: these functions take it (its JSON is :meth:`Report.to_json
<comparator.hidden.types.Report.to_json>`, read back by :func:`comparator.results.load_report`).

Example::

    from comparator import compare_dumps
    from comparator.reports.files import json_text, write_csv, write_json, write_parquet
    report = compare_dumps("dumps/eager", "dumps/sdpa")
    write_json(report, "report.json")
    print(json_text(report))                  # the same JSON, as text (``--format json``)
    write_csv(report, "tensors.csv")          # one row per tensor, each metric a column
    write_parquet(report, "tensors.parquet")  # the same table (needs pyarrow)
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any

from dumper.errors import UsageError
from dumper.format import atomic_path, write_json_atomic

if TYPE_CHECKING:
    from comparator.hidden.types import Report

__all__ = ["json_text", "write_json", "tensor_frame", "write_csv", "write_parquet", "need_pyarrow"]


def json_text(report: Report) -> str:
    """:meth:`Report.to_json <comparator.hidden.types.Report.to_json>` as text, the bytes :func:`write_json` writes."""
    return json.dumps(report.to_json(), indent=1, allow_nan=False)


def write_json(report: Report, path: str | os.PathLike[str]) -> None:
    """:meth:`Report.to_json <comparator.hidden.types.Report.to_json>` written to ``path`` (non-finite values as
    null)."""
    write_json_atomic(path, report.to_json())


def tensor_frame(report: Report) -> Any:
    """The per-tensor table as a pandas DataFrame: one row per tensor, the columns of ``--csv``."""
    import pandas as pd

    return pd.DataFrame([t.to_row() for t in report.tensors])


def write_csv(report: Report, path: str | os.PathLike[str]) -> None:
    """:func:`tensor_frame` as CSV."""
    with atomic_path(path) as tmp:
        tensor_frame(report).to_csv(tmp, index=False)


def need_pyarrow() -> None:
    """Raise UsageError naming the fix when pyarrow (for ``--parquet``) is not installed."""
    if importlib.util.find_spec("pyarrow") is None:
        raise UsageError("--parquet needs pyarrow: pip install pyarrow")


def write_parquet(report: Report, path: str | os.PathLike[str]) -> None:
    """:func:`tensor_frame` as Parquet via pandas + pyarrow (``shape`` as a list column).

    Raises UsageError when pyarrow is not installed.
    """
    need_pyarrow()
    df = tensor_frame(report)
    if "shape" in df:
        df["shape"] = df["shape"].map(list)
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False, engine="pyarrow")
