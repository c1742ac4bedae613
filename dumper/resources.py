"""Data files shipped with driftscope (the ``configs/`` directory), found the same way in every install.

``configs/`` sits at the root of the source tree; a wheel carries it as ``dumper/configs``
(``pyproject.toml`` maps it there). :func:`config_path` looks in the installed location first,
then in the source tree, so a checkout on ``PYTHONPATH``, an editable install and a wheel all
find the same files. Importing this module does not import torch (the comparator uses it).

Example::

    from dumper.resources import config_path
    config_path("tiny-llama.json")   # .../configs/tiny-llama.json
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_DIRS", "config_path"]

_HERE = Path(__file__).resolve().parent
CONFIG_DIRS: tuple[Path, ...] = (_HERE / "configs", _HERE.parent / "configs")
"""Where ``configs/`` may be, in lookup order: inside the installed package, then the source root."""


def config_path(name: str) -> Path:
    """The path of the shipped config file ``name`` (e.g. ``"tiny-llama.json"``).

    The first of :data:`CONFIG_DIRS` that holds it; when none does, the installed location, so
    that the reader's error names a path (this function never raises: the comparator calls it
    at import time).
    """
    for directory in CONFIG_DIRS:
        path = directory / name
        if path.is_file():
            return path
    return CONFIG_DIRS[0] / name
