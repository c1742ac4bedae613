"""NOISE.json on disk: the one place a noise file is read and written.

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

import os
from pathlib import Path
from typing import Final

from dumper.errors import DumpError, UsageError
from dumper.format import write_json_atomic
from dumper.format.files import parse_json, read_regular_file

from comparator.judging.noise import NoiseModel

__all__ = ["MAX_NOISE_BYTES", "load_noise", "save_noise"]

MAX_NOISE_BYTES: Final = 64 << 20
"""Largest noise file read (``--noise`` and the run store's ``noise.json``); a few KiB per tensor when sound."""


def load_noise(path: str | os.PathLike[str]) -> NoiseModel:
    """Read and validate the noise file ``path``."""
    where = str(path)
    try:  # the bytes go straight to the parser, which drops them once decoded
        d = parse_json(read_regular_file(Path(path), MAX_NOISE_BYTES, "noise file"), where, "noise file")
    except DumpError as e:  # the reader's one-line message, as a usage error
        raise UsageError(str(e)) from None
    return NoiseModel.from_json(d, where)


def save_noise(noise: NoiseModel, path: str | os.PathLike[str]) -> None:
    """Write ``noise`` to ``path`` atomically."""
    try:
        write_json_atomic(path, noise.to_json())
    except OSError as e:
        raise UsageError(f"{path}: cannot write the noise file ({e.strerror})") from None
