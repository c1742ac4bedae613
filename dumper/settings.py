"""The dumper's environment variables, and the ones both CLIs share: each is read here.

| variable                      | meaning                                                   |
|-------------------------------|-----------------------------------------------------------|
| ``DRIFTSCOPE_DUMP_DIR``       | ``dumper.dump()`` records here when no capture is active  |
| ``DRIFTSCOPE_DEBUG``          | ``1``/``true``/``yes``/``on``: the CLIs print the         |
|                               | traceback of an internal error (anything else: off)       |
| ``DRIFTSCOPE_JSON_MEMORY_MIB``| memory one JSON text may take to parse, a whole number of |
|                               | MiB >= 1 (default 432)                                    |
| ``DRIFTSCOPE_VLLM_SPOOL``     | where vLLM's processes record the requests driftscope     |
|                               | marks (:mod:`dumper.engines.vllm.spool`)                  |

An empty variable counts as unset; a bad value is a one-line :class:`~dumper.errors.UsageError`
naming the variable. The comparator's thresholds (``DRIFTSCOPE_DIFF_THRESHOLD``,
``DRIFTSCOPE_TOKEN_THRESHOLD``, ``DRIFTSCOPE_LOGPROB_<NAME>``) are read by :mod:`comparator.settings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dumper.errors import UsageError

__all__ = ["EnvSettings", "env_settings", "VLLM_SPOOL_ENV"]

VLLM_SPOOL_ENV = "DRIFTSCOPE_VLLM_SPOOL"
"""Set in the environment vLLM's processes inherit: the directory they record marked requests into."""


@dataclass(frozen=True)
class EnvSettings:
    """The dumper's and the shared environment variables, parsed (the table above)."""

    dump_dir: str | None = None
    debug: bool = False
    json_memory_mib: int | None = None
    vllm_spool: str | None = None


def _mib(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{name}={raw!r} must be a whole number of MiB >= 1")
    return int(raw)


def env_settings(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Read all driftscope environment variables (from ``os.environ`` by default)."""
    env = os.environ if env is None else env
    return EnvSettings(
        dump_dir=env.get("DRIFTSCOPE_DUMP_DIR") or None,
        debug=env.get("DRIFTSCOPE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"),
        json_memory_mib=_mib(env, "DRIFTSCOPE_JSON_MEMORY_MIB"),
        vllm_spool=env.get(VLLM_SPOOL_ENV) or None,
    )
