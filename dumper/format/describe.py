"""What a dump holds, in words: the one summary ``python -m dumper ls`` and ``python -m comparator store show`` print.

:func:`describe` turns a validated :class:`~dumper.format.manifest.Manifest` into labelled facts
(size, format, model, capture signature, environment, layers, passes, ranks, tensor names);
:func:`describe_lines` renders them as ``label: text`` lines, with one more line per tensor on
request. Every value is made printable (control characters escaped), so a hostile manifest
cannot drive the terminal. A new fact is one more pair in :func:`describe`; both commands show it.

Example::

    from dumper.format import load_manifest
    from dumper.format.describe import describe_lines
    print("\\n".join(describe_lines(load_manifest("dumps/a"), tensors=True)))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from dumper.format.files import printable
from dumper.format.manifest import Manifest, TensorRecord

__all__ = ["describe", "describe_lines", "tensor_line"]

NAMES_SHOWN = 12
"""Distinct tensor names listed on the ``names`` line before it ends in ``...``."""


def describe(manifest: Manifest) -> list[tuple[str, str]]:
    """The facts of a dump as ``(label, text)`` pairs, in the order they are printed.

    ``dump`` counts tensors, data files and their bytes on disk (the sizes the manifest lists);
    the descriptive objects are shown whole, as the manifest holds them.
    """
    ts = manifest.tensors
    size = sum(manifest.files.values())
    names = Counter(t.name for t in ts)
    shown = ", ".join(f"{n} (x{c})" for n, c in sorted(names.items())[:NAMES_SHOWN])
    return [
        (
            "dump",
            f"{len(ts)} tensors in {len(manifest.files)} files ({size / 2**20:.1f} MiB), "
            f"format {manifest.format_version}, created {printable(manifest.created_at)}",
        ),
        ("model", printable(repr(manifest.model))),
        ("capture_signature", printable(repr(manifest.capture_signature))),
        ("environment", printable(repr(manifest.environment))),
        ("layers", str(sorted({t.layer for t in ts if t.layer is not None}))),
        ("forward passes", str(len({t.forward_pass for t in ts}))),
        ("ranks", str(sorted({t.rank for t in ts}))),
        ("names", shown + (" ..." if len(names) > NAMES_SHOWN else "")),
    ]


def tensor_line(rec: TensorRecord) -> str:
    """One tensor: name, pass, rank, layer, dtype and shape, the token positions it spans, and its file."""
    pos = rec.row_positions()
    span = f"tokens {pos.min()}..{pos.max()}" if pos is not None and pos.size else "no positions"
    return (
        f"  {rec.name}  pass={rec.forward_pass} rank={rec.rank} layer={rec.layer} "
        f"{rec.dtype}{list(rec.shape)} {span}  [{printable(rec.file)}]"
    )


def describe_lines(manifest: Manifest, *, tensors: bool = False) -> Iterator[str]:
    """:func:`describe` as ``label: text`` lines, then (``tensors=True``) one :func:`tensor_line` per tensor."""
    for label, text in describe(manifest):
        yield f"{label}: {text}"
    if tensors:
        for rec in manifest.tensors:
            yield tensor_line(rec)
