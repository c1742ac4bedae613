"""NOISE.json on disk: the one place a noise file (and its row-noise side file) is read and written.

A noise file with row noise (:mod:`comparator.judging.row_noise`) has a side file beside it,
``NOISE.rows.safetensors`` for ``NOISE.json``, that the JSON names with its SHA-256: it is written
first and the JSON last (each atomically), so a JSON never names a side file that is not there,
and read only from the JSON's own directory (a plain name; a symlink out of it is refused).

Reading is untrusted (:func:`~dumper.format.files.read_regular_file`): a FIFO or a device is
refused without blocking, a file over :data:`MAX_NOISE_BYTES` before it is read; the content is
then checked by :meth:`comparator.judging.noise.NoiseModel.from_json`. Writing is atomic (temp
file + rename). Any problem is a one-line :class:`~dumper.errors.UsageError` naming the file.

Example::

    from comparator.noise.file import load_noise, save_noise
    noise = load_noise("NOISE.json")
    save_noise(noise, "copy.json")
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Final

from comparator.judging.noise import NoiseModel
from comparator.judging.row_noise import ROWS_SUFFIX, RowsRef, rows_from_bytes, rows_to_bytes
from dumper.errors import DumpError, UsageError
from dumper.format import write_json_atomic
from dumper.format.atomic import atomic_path
from dumper.format.files import parse_json, read_regular_file, regular_file_in

__all__ = ["MAX_NOISE_BYTES", "MAX_ROWS_BYTES", "BASELINE_NOISE", "load_noise", "save_noise", "rows_file_name"]

BASELINE_NOISE: Final = "NOISE.json"
"""The noise file a calibrated baseline holds in its own directory (``python -m dumper run --calibrate``), its row
noise beside it; ``python -m comparator BASELINE TARGET`` judges by it without ``--noise``."""

MAX_NOISE_BYTES: Final = 64 << 20
"""Largest noise file read (``--noise`` and the run store's ``noise.json``); a few KiB per tensor when sound."""
MAX_ROWS_BYTES: Final = 4 << 30
"""Largest row-noise side file read: 4 bytes per row and tensor (a million rows of a thousand tensors)."""


def rows_file_name(path: str | os.PathLike[str]) -> str:
    """The side file's name for the noise file ``path``: ``NOISE.json`` -> ``NOISE.rows.safetensors``."""
    name = Path(path).name
    return (name[:-5] if name.endswith(".json") else name) + ROWS_SUFFIX


def load_noise(path: str | os.PathLike[str]) -> NoiseModel:
    """Read and validate the noise file ``path``."""
    where = str(path)
    try:  # the bytes go straight to the parser, which drops them once decoded
        d = parse_json(read_regular_file(Path(path), MAX_NOISE_BYTES, "noise file"), where, "noise file")
    except DumpError as e:  # the reader's one-line message, as a usage error
        raise UsageError(str(e)) from None
    noise = NoiseModel.from_json(d, where)
    ref = noise.rows_ref
    if ref is None:
        return noise
    side = Path(path).parent / ref.file
    try:
        regular_file_in(Path(path).parent, ref.file, missing="the row-noise file the noise file names is missing")
        data = read_regular_file(side, MAX_ROWS_BYTES, "row-noise file")
    except DumpError as e:
        raise UsageError(str(e)) from None
    return dataclasses.replace(noise, rows=rows_from_bytes(data, ref, str(side)))


def save_noise(noise: NoiseModel, path: str | os.PathLike[str]) -> None:
    """Write ``noise`` to ``path`` atomically, its row noise (if any) to the side file first."""
    try:
        if noise.rows is not None:
            data = rows_to_bytes(noise.rows)
            name = rows_file_name(path)
            with atomic_path(Path(path).parent / name) as tmp:
                tmp.write_bytes(data)
            ref = RowsRef(name, hashlib.sha256(data).hexdigest(), dict(noise.rows.tables), noise.rows.holdout)
            noise = dataclasses.replace(noise, rows_ref=ref)
        else:
            noise = dataclasses.replace(noise, rows_ref=None)
        write_json_atomic(path, noise.to_json())
    except OSError as e:
        raise UsageError(f"{path}: cannot write the noise file ({e.strerror})") from None
