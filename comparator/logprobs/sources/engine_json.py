"""Read inference-engine logprob outputs (JSONL, one response per line) into SequenceLogprobs.

Each response is parsed by :mod:`comparator.logprobs.sources.engine_formats` (SGLang, vLLM,
OpenAI completions and chat completions, detected line by line). Request id: ``meta_info.id`` /
``request_id`` / ``id`` (a string or an integer), else ``line-N`` (a JSON array on one line, as
SGLang's batch ``/generate`` returns, gives ``line-N.k``).

Every line is validated before use, and anything wrong raises UsageError
``"<path>:<line>: request '<id>': <field or position>: <problem>"`` (exit 2): a logprob is a
number, finite or -inf (not a string, bool, NaN or +inf), and null only where an engine has none
to give (the prompt's first token; SGLang's first position at ``logprob_start_len``); a token id
is a JSON integer in ``[0, 2^31)``; lists have the lengths their neighbours imply (one top-k list
per token, all of one length in SGLang); ids are unique. The file is read one line at a time, and
a line is parsed only when its JSON objects fit in
:func:`dumper.format.files.json_memory_budget`; a response holds at most
:data:`~comparator.logprobs.sources.input_caps.MAX_POSITIONS` positions and a file
:data:`~comparator.logprobs.sources.input_caps.MAX_TOTAL_POSITIONS` (SGLang's unscored prefix included). An empty
file, a line that is not an object (or an array of them), invalid UTF-8 and JSON nested too
deeply are errors too.

Example::

    from comparator.logprobs.sources.engine_json import read_logprobs_jsonl
    from comparator.logprobs import LogprobThresholds, compare_logprobs
    verdict = compare_logprobs(read_logprobs_jsonl("golden.jsonl"), read_logprobs_jsonl("new.jsonl"),
                               LogprobThresholds.resolve("my-model"))
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from comparator.logprobs.sources.engine_formats import detect_format, parse_response, request_id, show
from comparator.logprobs.sources.input_caps import MAX_LINE_BYTES, MAX_POSITIONS, MAX_TOTAL_POSITIONS, limit_text
from comparator.logprobs.types import SequenceLogprobs
from dumper.errors import UsageError
from dumper.format.files import check_json_memory

__all__ = ["parse_record", "read_logprobs_jsonl"]


def _check_nulls(seq: SequenceLogprobs, required_from: int) -> None:
    """A null logprob where one must be given is missing data, never a position to skip."""
    for i in range(required_from, len(seq.logprobs)):
        if seq.logprobs[i] is None:
            raise UsageError(
                f"null logprob at position {i}: only the first position the engine reports "
                "may have none (the prompt's first token)"
            )


def parse_record(obj: Any, *, default_id: str = "record", max_positions: int = MAX_POSITIONS) -> SequenceLogprobs:
    """One engine response object -> SequenceLogprobs; UsageError (without a path) if malformed.

    The message names the request (when it has an id) and the field or position at fault. A
    response over ``max_positions`` positions is refused (SGLang's, before its unscored prefix is
    allocated; the other formats' lists hold one JSON entry per position).
    """
    if not isinstance(obj, dict):
        got = "a JSON list" if isinstance(obj, list) else type(obj).__name__
        raise UsageError(f"expected a JSON object, got {got}")
    rid = request_id(obj, default_id)
    try:
        fmt = detect_format(obj)
        seq, required_from = parse_response(obj, fmt, rid, limit=max_positions)
        if len(seq.logprobs) > max_positions:
            raise UsageError(f"{len(seq.logprobs)} positions are over {limit_text(max_positions)}")
        _check_nulls(seq, required_from)
        return seq
    except UsageError as e:
        raise UsageError(f"request {rid!r}: {e}") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a structurally wrong field
        raise UsageError(f"request {rid!r}: malformed {fmt} response: {type(e).__name__}: {show(str(e))}") from None
    except ValueError as e:  # SequenceLogprobs length checks
        raise UsageError(f"request {rid!r}: malformed {fmt} response: {e}") from None


def _lines(p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line, read one at a time; a line over
    :data:`MAX_LINE_BYTES`, too costly to parse or not UTF-8 is a UsageError naming it."""
    try:
        if not stat.S_ISREG(p.stat().st_mode):  # a FIFO or device would block or never end
            raise UsageError(f"{p}: not a regular file")
        f = p.open("rb")
    except OSError as e:
        raise UsageError(f"{p}: cannot read: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise UsageError(f"{p}:{lineno}: line longer than {MAX_LINE_BYTES >> 20} MiB: not one engine response")
            check_json_memory(raw, f"{p}:{lineno}", "a line")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{p}:{lineno}: not UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})") from None
            if lineno == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark
            if text.strip():
                yield lineno, text


def _records(obj: Any, lineno: int, left: int) -> list[SequenceLogprobs]:
    """The responses of one line: an object, or a non-empty array of them (SGLang's batch /generate),
    holding at most ``left`` positions in all."""
    if not isinstance(obj, list):
        return [parse_record(obj, default_id=f"line-{lineno}", max_positions=min(left, MAX_POSITIONS))]
    if not obj:
        raise UsageError("an empty JSON array holds no responses")
    out = []
    for k, o in enumerate(obj):
        try:
            out.append(parse_record(o, default_id=f"line-{lineno}.{k}", max_positions=min(left, MAX_POSITIONS)))
        except UsageError as e:
            raise UsageError(f"array element {k}: {e}") from None
        left -= len(out[-1].logprobs)
    return out


def read_logprobs_jsonl(path: str | os.PathLike[str]) -> list[SequenceLogprobs]:
    """Every response of a JSONL file (blank lines skipped), in file order; ids must be unique.

    The file is read one line at a time. An empty file, a line that is not a JSON object (or an
    array of them), a malformed response or a repeated request id raises UsageError
    ``"<path>:<line>: ..."``.
    """
    p = Path(path)
    out: list[SequenceLogprobs] = []
    first_line: dict[str, int] = {}
    left = MAX_TOTAL_POSITIONS
    for lineno, line in _lines(p):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise UsageError(f"{p}:{lineno}: not valid JSON: {why}") from None
        try:
            seqs = _records(obj, lineno, left)
        except UsageError as e:
            raise UsageError(f"{p}:{lineno}: {e}") from None
        for seq in seqs:
            if seq.request in first_line:
                raise UsageError(
                    f"{p}:{lineno}: duplicate request id {seq.request!r} (first on line {first_line[seq.request]})"
                )
            first_line[seq.request] = lineno
            left -= len(seq.logprobs)
            out.append(seq)
    if not out:
        raise UsageError(f"{p}: holds no engine responses (the file is empty or blank)")
    return out
