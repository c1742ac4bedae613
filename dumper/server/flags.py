"""The flags of a command that talks to a live server (``--server``, ``--api``, ``--served-model``,
``--timeout``, ``--retries``), each defined once here for ``dumper collect``, ``dumper selfcheck
--server`` and ``comparator collect``, and checked as they are parsed, without loading the HTTP
client (:mod:`dumper.server.client`, which checks a client's settings by the same bounds and takes
the same defaults): both CLIs build every subcommand's parser at start-up.

``when`` is the prefix of a flag's help where the flags apply only with another one
(``selfcheck``'s ``"with --server: "``).
"""

from __future__ import annotations

import argparse
from typing import Final

from dumper.errors import UsageError

__all__ = [
    "API_NAMES",
    "MAX_TIMEOUT_S",
    "MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_RETRIES",
    "check_timeout",
    "check_retries",
    "timeout_arg",
    "retries_arg",
    "server_flag",
    "api_flag",
    "served_model_flag",
    "request_flags",
]

API_NAMES: Final = ("vllm", "sglang", "openai")
"""The server APIs ``collect`` speaks (:mod:`comparator.logprobs.sources.collect`)."""
MAX_TIMEOUT_S: Final = 86400.0
"""Longest ``--timeout``: one day per request."""
MAX_RETRIES: Final = 100
"""Most ``--retries``."""
DEFAULT_TIMEOUT_S: Final = 120.0
"""``--timeout`` when not given, and a :class:`~dumper.server.client.ServerClient`'s: two
minutes per request, room for a long prompt's logprobs or a long greedy answer on a busy server."""
DEFAULT_RETRIES: Final = 3
"""``--retries`` when not given, and a client's."""
API_HELP: Final = "vllm (/v1/completions with prompt_logprobs), sglang (/generate), openai (echo + logprobs)"
"""``--api``'s help where the server scores prompts (``comparator collect``)."""


def _shown(value: object) -> str:
    """``value`` for a message about a bad argument: a float as ``%g``, anything else as its repr, cut to 30."""
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def check_timeout(value: float) -> float:
    """``value`` as a per-request timeout: a number of seconds in ``(0, MAX_TIMEOUT_S]``, else a UsageError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise UsageError(
            f"--timeout {_shown(value)}: expected seconds per request, more than 0 and at most "
            f"{MAX_TIMEOUT_S:g} (one day)"
        )
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


def server_flag(p: argparse.ArgumentParser, *, required: bool, help: str) -> None:
    """``--server URL``: the server's base URL; ``help`` says which server and what for."""
    p.add_argument("--server", required=required, default=None, metavar="URL", help=help)


def api_flag(p: argparse.ArgumentParser, *, required: bool, help: str = API_HELP) -> None:
    """``--api vllm|sglang|openai``: which of :data:`API_NAMES` the server speaks."""
    p.add_argument("--api", required=required, default=None, choices=API_NAMES, help=help)


def served_model_flag(p: argparse.ArgumentParser, flag: str = "--served-model", when: str = "") -> None:
    """``--served-model NAME``: the model name requests ask for (``comparator collect`` spells it ``--model``)."""
    p.add_argument(flag, default=None, help=f"{when}model name to request (default: the first one /v1/models lists)")


def request_flags(p: argparse.ArgumentParser, when: str = "") -> None:
    """``--timeout S`` and ``--retries N``: one request's deadline, and how often a failed one is tried again."""
    p.add_argument(
        "--timeout",
        type=timeout_arg,
        default=DEFAULT_TIMEOUT_S,
        help=f"{when}seconds per request: connect, send and the whole answer "
        f"(default {DEFAULT_TIMEOUT_S:g}, at most {MAX_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--retries",
        type=retries_arg,
        default=DEFAULT_RETRIES,
        help=f"{when}retries on connection errors, timeouts, cut answers and HTTP 429/5xx, with backoff "
        f"(default {DEFAULT_RETRIES}, at most {MAX_RETRIES})",
    )
