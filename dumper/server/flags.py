"""The flags of a command that talks to a server (``--api``, ``--timeout``, ``--retries``), checked as they
are parsed, without loading the HTTP client (:mod:`dumper.server.client`, which
checks a client's settings by the same bounds): both CLIs build every subcommand's parser at start-up.
"""

from __future__ import annotations

from typing import Final

from dumper.errors import UsageError

__all__ = ["API_NAMES", "MAX_TIMEOUT_S", "MAX_RETRIES", "check_timeout", "check_retries", "timeout_arg",
           "retries_arg"]

API_NAMES: Final = ("vllm", "sglang", "openai")
"""The server APIs ``collect`` speaks (:mod:`comparator.logprobs.sources.collect`)."""
MAX_TIMEOUT_S: Final = 86400.0
"""Longest ``--timeout``: one day per request."""
MAX_RETRIES: Final = 100
"""Most ``--retries``."""


def _shown(value: object) -> str:
    """``value`` for a message about a bad argument: a float as ``%g``, anything else as its repr, cut to 30."""
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def check_timeout(value: float) -> float:
    """``value`` as a per-request timeout: a number of seconds in ``(0, MAX_TIMEOUT_S]``, else a UsageError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {_shown(value)}: expected seconds per request, more than 0 and at most "
                         f"{MAX_TIMEOUT_S:g} (one day)")
    return float(value)


def check_retries(value: int) -> int:
    """``value`` as a retry count: an integer in ``[0, MAX_RETRIES]``, else a UsageError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRIES:
        raise UsageError(f"--retries {_shown(value)}: expected an integer from 0 to {MAX_RETRIES}")
    return value


def timeout_arg(text: str) -> float:
    """``--timeout`` for argparse: :func:`check_timeout` of the number given."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--timeout {_shown(text)}: expected a number of seconds") from None
    return check_timeout(value)


def retries_arg(text: str) -> int:
    """``--retries`` for argparse: :func:`check_retries` of the integer given."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"--retries {_shown(text)}: expected an integer from 0 to {MAX_RETRIES}") from None
    return check_retries(value)
