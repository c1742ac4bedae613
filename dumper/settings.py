"""Environment variables: every ``DRIFTSCOPE_*`` variable is read here and nowhere else.

| variable                      | meaning                                                   |
|-------------------------------|-----------------------------------------------------------|
| ``DRIFTSCOPE_DUMP_DIR``       | ``dumper.dump()`` records here when no capture is active  |
| ``DRIFTSCOPE_DEBUG``          | ``1``: the CLIs print the traceback of an internal error  |
| ``DRIFTSCOPE_JSON_MEMORY_MIB``| memory one JSON text may take to parse (default 432)      |
| ``DRIFTSCOPE_DIFF_THRESHOLD`` | comparator rel_diff threshold (whole tensor)              |
| ``DRIFTSCOPE_TOKEN_THRESHOLD``| comparator per-token rel_diff threshold                   |
| ``DRIFTSCOPE_LOGPROB_<NAME>`` | logprob threshold ``<name>`` (MSE, MEAN_ABS_ERR, MAX_ABS_ERR, |
|                               | K3_MEAN, KL_MEAN, KL_MAX, TOPK_MAX_ERR; ``off`` disables) |
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dumper.errors import UsageError

__all__ = ["EnvSettings", "env_settings"]

_LOGPROB = "DRIFTSCOPE_LOGPROB_"


@dataclass(frozen=True)
class EnvSettings:
    dump_dir: str | None = None
    debug: bool = False
    json_memory_mib: int | None = None
    diff_threshold: float | None = None
    token_threshold: float | None = None
    logprob_thresholds: dict[str, str] = field(default_factory=dict)
    """Raw ``DRIFTSCOPE_LOGPROB_<NAME>`` values by lower-case name; parsed by comparator.logprobs."""


def _threshold(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name}={raw!r} must be a finite number >= 0")
    return value


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
        diff_threshold=_threshold(env, "DRIFTSCOPE_DIFF_THRESHOLD"),
        token_threshold=_threshold(env, "DRIFTSCOPE_TOKEN_THRESHOLD"),
        logprob_thresholds={k[len(_LOGPROB):].lower(): v.strip() for k, v in env.items()
                            if k.startswith(_LOGPROB) and v.strip()},
    )
