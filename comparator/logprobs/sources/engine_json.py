"""Read inference-engine logprob outputs (JSONL, one response per line) into SequenceLogprobs.

Each line is detected on its own:

- **SGLang** ``/generate`` response (``meta_info`` present): ``input_token_logprobs`` then
  ``output_token_logprobs`` (``[logprob | null, token_id, text | null]`` triples) form one
  sequence, positions continuing from the prompt into the output; ``input_top_logprobs`` /
  ``output_top_logprobs`` become ``top``. With ``logprob_start_len = s > 0`` SGLang returns only
  positions ``s..``: the start is recovered from ``meta_info.prompt_tokens`` (or a top-level
  ``input_ids`` list, which also supplies the skipped token ids; otherwise they are
  ``UNKNOWN_TOKEN``), so positions stay absolute.
- **vLLM** ``prompt_logprobs`` (top level as in an offline ``RequestOutput``, or in
  ``choices[0]`` as in the OpenAI server with ``prompt_logprobs=k``): entry ``i`` is
  ``{"<token_id>": {"logprob", "rank", "decoded_token"}, ...}`` holding the actual token
  ``prompt_token_ids[i]`` plus the top-k; ``outputs[0]`` (``token_ids`` + ``logprobs`` dicts) is
  appended as output positions. ``top`` keeps every entry of the dict (the actual token included).
- **OpenAI** completions (``choices[0].logprobs.tokens/token_logprobs``) or chat completions
  (``choices[0].logprobs.content``): token strings only. Ids come from optional ``token_ids`` /
  ``prompt_token_ids`` fields (choice or top level; vLLM's ``return_token_ids``); without them
  the sequence carries ``token_texts`` and ``token_ids = ()``, and agreement is checked on text.
  Top logprobs there are keyed by text, so ``top`` is None.

Request id: ``meta_info.id`` / ``request_id`` / ``id`` (a string or an integer), else ``line-N``
(a JSON array on one line, as SGLang's batch ``/generate`` returns, gives ``line-N.k``).

Every line is validated before use, and anything wrong raises UsageError
``"<path>:<line>: request '<id>': <field or position>: <problem>"`` (exit 2): a logprob is a
number, finite or -inf (not a string, bool, NaN or +inf), and null only where an engine has none
to give (the prompt's first token; SGLang's first position at ``logprob_start_len``); a token id is a JSON integer in ``[0, 2^31)``; lists have the lengths their
neighbours imply (one top-k list per token, all of one length in SGLang); ids are unique. The file
is read one line at a time, and a line is parsed only when its JSON objects fit in
:func:`dumper.format.validate.json_memory_budget`; a response holds at most :data:`MAX_POSITIONS`
positions and a file :data:`MAX_TOTAL_POSITIONS` (SGLang's unscored prefix included). An empty
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
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

from dumper.errors import UsageError
from dumper.format.validate import check_json_memory

from comparator.logprobs import UNKNOWN_TOKEN, SequenceLogprobs, TopK

__all__ = ["EngineFormat", "detect_format", "parse_record", "read_logprobs_jsonl", "TOKEN_ID_LIMIT", "MAX_POSITIONS",
           "MAX_TOTAL_POSITIONS", "MAX_LINE_BYTES"]

EngineFormat = Literal["sglang", "vllm", "openai", "openai-chat"]


# --------------------------------------------------------------------------- small validators

TOKEN_ID_LIMIT: Final = 1 << 31
"""Token ids must lie in ``[0, TOKEN_ID_LIMIT)``: engines store them as int32, so anything else
(negative, or absurdly large) is a corrupt line, never a token."""
MAX_POSITIONS: Final = 1 << 22
"""Most positions one response may claim (SGLang's ``prompt_tokens``), checked before allocating."""
MAX_TOTAL_POSITIONS: Final = 1 << 22
"""Most positions all the sequences of one source (a JSONL file, a dump) may hold together, the
unscored prefix slots included, checked before allocating them: one longest response fits. An
unscored slot costs ~16 bytes kept (token id and logprob tuple slots) and ~40 while its sequence
is built; measured, comparing two sources at this limit peaks at 340 MiB RSS (2x the limit: 470)."""
MAX_LINE_BYTES: Final = 128 << 20
"""Longest JSONL line (one response) read; a longer one is refused before it is parsed (and a
shorter one too when building its JSON objects would take over
:func:`dumper.format.validate.json_memory_budget`)."""


def _show(v: Any) -> str:
    """``v`` for an error message: a short repr of a scalar, the type of a container (one line,
    bounded, and no recursion into a deeply nested value)."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'list'}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise UsageError(f"{what} must be a list, got {_show(v)}")
    return v


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise UsageError(f"{what} must be an object, got {_show(v)}")
    return v


def _logprob(v: Any, what: str, *, nullable: bool = True) -> float | None:
    """A logprob: a finite number or -inf (JSON ``-Infinity``); never a string, bool, NaN or +inf."""
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{what} must be a number{' or null' if nullable else ''}, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond float range
        f = math.inf
    if math.isnan(f) or f == math.inf:
        raise UsageError(f"{what} must be a finite number or -inf, got {_show(v)}")
    return f


def _in_range(t: int, what: str) -> int:
    if not 0 <= t < TOKEN_ID_LIMIT:
        raise UsageError(f"{what}: token id {_show(t)} is out of range [0, 2^31)")
    return t


def _token_id(v: Any, what: str) -> int:
    """A token id: a JSON integer (not a bool, float or string) in ``[0, TOKEN_ID_LIMIT)``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{what} must be an integer token id, got {_show(v)}")
    return _in_range(v, what)


def _token_key(k: str, what: str) -> int:
    """A token id written as an object key (vLLM's ``{"<token_id>": ...}``): decimal digits only."""
    if not _DIGITS.fullmatch(k):
        raise UsageError(f"{what}: key {_show(k)} is not a token id")
    return _in_range(int(k), what)


_DIGITS: Final = re.compile(r"[0-9]{1,12}")


def _ids(v: Any, what: str) -> list[int]:
    return [_token_id(t, f"{what}[{i}]") for i, t in enumerate(_list(v, what))]


def _sort_top(entries: list[tuple[int, float]], what: str) -> TopK:
    """Most likely first, ties by token id (engines order equal values differently); an id twice is corrupt."""
    if len({t for t, _ in entries}) != len(entries):
        raise UsageError(f"{what} lists a token id twice")
    return tuple(sorted(entries, key=lambda e: (-e[1], e[0])))


# --------------------------------------------------------------------------- detection


def _choice0(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    ch = obj.get("choices")
    if isinstance(ch, list) and ch and isinstance(ch[0], dict):
        return ch[0]
    return None


def detect_format(obj: Mapping[str, Any]) -> EngineFormat:
    """Which engine wrote this response object (see the module docstring)."""
    if "meta_info" in obj:
        return "sglang"
    if "prompt_logprobs" in obj:
        return "vllm"
    ch = _choice0(obj)
    if ch is not None:
        if ch.get("prompt_logprobs") is not None:
            return "vllm"
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and "content" in lp:
            return "openai-chat"
        if isinstance(lp, dict):
            return "openai"
        raise UsageError("choices[0] has no logprobs (request them with logprobs=k or prompt_logprobs=k)")
    raise UsageError("unrecognized response: expected SGLang 'meta_info', vLLM 'prompt_logprobs' or OpenAI 'choices'")


def _request_id(obj: Mapping[str, Any], default_id: str) -> str:
    """``meta_info.id`` / ``request_id`` / ``id`` (a string or an integer), else ``default_id``."""
    meta = obj.get("meta_info")
    for key, v in (("meta_info.id", meta.get("id") if isinstance(meta, dict) else None),
                   ("request_id", obj.get("request_id")), ("id", obj.get("id"))):
        if v is None or v == "":
            continue
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise UsageError(f"{key} must be a string or an integer, got {_show(v)}")
        return str(v)
    return default_id


# --------------------------------------------------------------------------- SGLang

Parsed = tuple[SequenceLogprobs, int]
"""A parsed response and the first position from which every logprob must be given: before it
lie the positions the engine did not report and the first one it did, which predicts nothing
when it is the prompt's first (or SGLang's ``logprob_start_len``) token."""


def _sglang_triples(v: Any, what: str, *, nullable: bool = True) -> tuple[list[float | None], list[int]]:
    lps: list[float | None] = []
    ids: list[int] = []
    for i, e in enumerate(_list(v, what)):
        if not isinstance(e, list) or len(e) not in (2, 3):
            raise UsageError(f"{what}[{i}] must be [logprob, token_id, text], got {_show(e)}")
        if len(e) == 3 and e[2] is not None and not isinstance(e[2], str):
            raise UsageError(f"{what}[{i}][2] must be the token text or null, got {_show(e[2])}")
        lps.append(_logprob(e[0], f"{what}[{i}][0]", nullable=nullable))
        ids.append(_token_id(e[1], f"{what}[{i}][1]"))
    return lps, ids


def _sglang_top(v: Any, n: int, what: str, *, first_may_be_null: bool) -> list[TopK | None]:
    """One top-k list per token; null only for the first reported position (it predicts nothing)."""
    entries = _list(v, what)
    if len(entries) != n:
        raise UsageError(f"{what} has {len(entries)} entries for {n} tokens")
    out: list[TopK | None] = []
    for i, e in enumerate(entries):
        if e is None:
            if i > 0 or not first_may_be_null:
                raise UsageError(f"{what}[{i}] is null: only the first position may have no top logprobs")
            out.append(None)
            continue
        lps, ids = _sglang_triples(e, f"{what}[{i}]", nullable=False)
        out.append(_sort_top([(t, float(lp or 0.0)) for t, lp in zip(ids, lps, strict=True)], f"{what}[{i}]"))
    return out


def _sglang_prompt(obj: Mapping[str, Any], meta: Mapping[str, Any], in_ids: list[int], n_out: int,
                   limit: int) -> tuple[int, list[int]]:
    """(start, token ids of positions 0..start-1) for ``logprob_start_len = start``: SGLang returns
    positions ``start..`` only; the start comes from ``input_ids`` or ``meta_info.prompt_tokens``.
    A prompt and ``n_out`` output tokens over ``limit`` positions are refused before the unscored
    prefix is allocated."""
    prompt = _ids(obj["input_ids"], "input_ids") if obj.get("input_ids") is not None else None
    n_prompt: Any = len(prompt) if prompt is not None else meta.get("prompt_tokens", len(in_ids))
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or n_prompt < len(in_ids):
        raise UsageError(f"prompt length {_show(n_prompt)} is not an integer or shorter than the "
                         f"{len(in_ids)} input_token_logprobs")
    if n_prompt + n_out > limit:
        raise UsageError(f"prompt length {n_prompt} and {n_out} output tokens are over {_limit_text(limit)}")
    start = n_prompt - len(in_ids)
    if prompt is None:
        return start, [UNKNOWN_TOKEN] * start
    if prompt[start:] != in_ids:
        raise UsageError(f"input_ids[{start}:] differ from the ids in meta_info.input_token_logprobs")
    return start, prompt[:start]


def _limit_text(limit: int) -> str:
    return (f"the limit: {limit} positions left for this response (at most {MAX_POSITIONS} per response "
            f"and {MAX_TOTAL_POSITIONS} in all of a file's responses)")


def _parse_sglang(obj: Mapping[str, Any], rid: str, limit: int = MAX_POSITIONS) -> Parsed:
    meta = _obj(obj["meta_info"], "meta_info")
    if "input_token_logprobs" not in meta:  # SGLang always sends it with return_logprob (maybe empty)
        raise UsageError("meta_info has no input_token_logprobs (request with return_logprob=true)")
    in_lps, in_ids = _sglang_triples(meta["input_token_logprobs"], "meta_info.input_token_logprobs")
    out_lps, out_ids = _sglang_triples(meta.get("output_token_logprobs", []), "meta_info.output_token_logprobs")
    start, prefix = _sglang_prompt(obj, meta, in_ids, len(out_ids), limit)

    ids = prefix + in_ids + out_ids
    lps = [None] * start + in_lps + out_lps
    top: list[TopK | None] | None = None
    in_top, out_top = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    if in_top or out_top:
        it = (_sglang_top(in_top, len(in_ids), "meta_info.input_top_logprobs", first_may_be_null=True)
              if in_top else [None] * len(in_ids))
        ot = (_sglang_top(out_top, len(out_ids), "meta_info.output_top_logprobs", first_may_be_null=not in_ids)
              if out_top else [None] * len(out_ids))
        top = [None] * start + it + ot
        if len({len(t) for t in top if t is not None}) > 1:
            raise UsageError("top logprobs lists differ in length: each position must list top_logprobs_num tokens")
    return SequenceLogprobs(rid, tuple(ids), tuple(lps), None if top is None else tuple(top)), start + bool(in_ids)


# --------------------------------------------------------------------------- vLLM


def _vllm_value(v: Any, what: str) -> float:
    if isinstance(v, dict):
        if "logprob" not in v:
            raise UsageError(f"{what} has no 'logprob'")
        v = v["logprob"]
    lp = _logprob(v, what, nullable=False)
    assert lp is not None
    return lp


def _vllm_position(entry: Any, token: int, what: str) -> tuple[float | None, TopK | None]:
    """(logprob of ``token``, all entries as top) of one vLLM logprobs dict; (None, None) for null."""
    if entry is None:
        return None, None
    if not isinstance(entry, dict):
        raise UsageError(f"{what} must be an object {{token_id: {{logprob, ...}}}} or null, got {_show(entry)}")
    pairs = [(_token_key(k, what), _vllm_value(v, f"{what}[{k!r}]")) for k, v in entry.items()]
    own = [lp for t, lp in pairs if t == token]
    if not own:
        raise UsageError(f"{what} has no entry for its token id {token}")
    return own[0], _sort_top(pairs, what)


def _vllm_outputs(obj: Mapping[str, Any]) -> list[tuple[int, float | None, TopK | None]]:
    """(token, logprob, top) of each position of an offline RequestOutput's ``outputs[0]``."""
    outs = obj.get("outputs")
    if outs is None or outs == []:
        return []
    out = _obj(_list(outs, "outputs")[0], "outputs[0]")
    if out.get("logprobs") is None:
        return []
    oids = _ids(out.get("token_ids"), "outputs[0].token_ids")
    olps = _list(out["logprobs"], "outputs[0].logprobs")
    if len(olps) != len(oids):
        raise UsageError(f"outputs[0].logprobs has {len(olps)} entries for {len(oids)} token_ids")
    return [(t, *_vllm_position(e, t, f"outputs[0].logprobs[{j}]"))
            for j, (e, t) in enumerate(zip(olps, oids, strict=True))]


def _vllm_server_outputs(ch: Mapping[str, Any], n_prompt: int) -> list[tuple[int, float | None, TopK | None]]:
    """(token, logprob, None) of the OpenAI server's output positions: ids in ``choices[0].token_ids``."""
    oids_raw, olp = ch.get("token_ids"), ch.get("logprobs")
    if oids_raw is None or not isinstance(olp, dict) or olp.get("token_logprobs") is None:
        return []
    oids = _ids(oids_raw, "choices[0].token_ids")
    tl = _list(olp["token_logprobs"], "choices[0].logprobs.token_logprobs")
    if len(tl) == n_prompt:  # echo=True with max_tokens=0: vLLM lists an internal token it never scored
        return []
    skip = n_prompt if len(tl) == n_prompt + len(oids) else 0  # echo=True: prompt then output
    if len(tl) - skip != len(oids):
        raise UsageError(f"choices[0].logprobs.token_logprobs has {len(tl)} entries for {len(oids)} token_ids")
    return [(t, _logprob(tl[skip + j], f"choices[0].logprobs.token_logprobs[{skip + j}]"), None)
            for j, t in enumerate(oids)]


def _parse_vllm(obj: Mapping[str, Any], rid: str) -> Parsed:
    ch = _choice0(obj) if "prompt_logprobs" not in obj else None
    src: Mapping[str, Any] = ch if ch is not None else obj
    pre = "choices[0]." if ch is not None else ""
    raw_ids = src.get("prompt_token_ids", obj.get("prompt_token_ids"))
    if raw_ids is None:
        raise UsageError(f"vLLM prompt_logprobs without {pre}prompt_token_ids")
    ids = _ids(raw_ids, f"{pre}prompt_token_ids")
    entries = _list(src["prompt_logprobs"], f"{pre}prompt_logprobs")
    if len(entries) != len(ids):
        raise UsageError(f"{pre}prompt_logprobs has {len(entries)} entries for {len(ids)} prompt_token_ids")
    lps: list[float | None] = []
    top: list[TopK | None] = []
    for i, (e, t) in enumerate(zip(entries, ids, strict=True)):
        lp, tk = _vllm_position(e, t, f"{pre}prompt_logprobs[{i}]")
        lps.append(lp)
        top.append(tk)
    for t, lp, tk in _vllm_outputs(obj) if ch is None else _vllm_server_outputs(ch, len(ids)):
        ids.append(t)
        lps.append(lp)
        top.append(tk)
    return SequenceLogprobs(rid, tuple(ids), tuple(lps), tuple(top)), 1


# --------------------------------------------------------------------------- OpenAI


def _openai_ids(obj: Mapping[str, Any], ch: Mapping[str, Any], n: int) -> tuple[list[int], int] | None:
    """(token ids, number of prompt positions before the logprob tokens), or None if no ids given."""
    def get(key: str) -> list[int] | None:
        v = ch.get(key, obj.get(key))
        return None if v is None else _ids(v, key)

    prompt, toks = get("prompt_token_ids"), get("token_ids")
    if prompt is not None and toks is not None and len(prompt) + len(toks) == n:
        return prompt + toks, 0  # echo=True with a completion
    if prompt is not None and len(prompt) == n:
        return prompt, 0  # echo=True, max_tokens=0
    if toks is not None and len(toks) == n:
        return (prompt or []) + toks, len(prompt or [])  # completion only: it starts after the prompt
    if prompt is None and toks is None:
        return None
    raise UsageError(f"token ids (prompt_token_ids: {None if prompt is None else len(prompt)}, token_ids: "
                     f"{None if toks is None else len(toks)}) do not cover the {n} logprob tokens")


def _openai_sequence(obj: Mapping[str, Any], ch: Mapping[str, Any], rid: str, texts: list[str],
                     lps: list[float | None], *, echo: bool) -> Parsed:
    """``echo``: the list may start with the prompt (completions), whose first token has no logprob."""
    got = _openai_ids(obj, ch, len(texts))
    if got is None:
        return SequenceLogprobs(rid, (), tuple(lps), None, tuple(texts)), int(echo)
    ids, start = got
    return SequenceLogprobs(rid, tuple(ids), tuple([None] * start + lps)), start or int(echo)


def _parse_openai(obj: Mapping[str, Any], rid: str) -> Parsed:
    ch = _choice0(obj)
    assert ch is not None
    lp = ch["logprobs"]
    texts = _list(lp.get("tokens"), "choices[0].logprobs.tokens")
    vals = _list(lp.get("token_logprobs"), "choices[0].logprobs.token_logprobs")
    if len(texts) != len(vals):
        raise UsageError(f"choices[0].logprobs has {len(texts)} tokens but {len(vals)} token_logprobs")
    if not all(isinstance(t, str) for t in texts):
        raise UsageError("choices[0].logprobs.tokens must be strings")
    lps = [_logprob(v, f"choices[0].logprobs.token_logprobs[{i}]") for i, v in enumerate(vals)]
    return _openai_sequence(obj, ch, rid, texts, lps, echo=True)


def _parse_openai_chat(obj: Mapping[str, Any], rid: str) -> Parsed:
    ch = _choice0(obj)
    assert ch is not None
    content = _list(ch["logprobs"]["content"], "choices[0].logprobs.content")
    texts: list[str] = []
    lps: list[float | None] = []
    for i, e in enumerate(content):
        if not isinstance(e, dict) or not isinstance(e.get("token"), str):
            raise UsageError(f"choices[0].logprobs.content[{i}] must be {{token, logprob, ...}}, got {_show(e)}")
        texts.append(e["token"])
        lps.append(_logprob(e.get("logprob"), f"choices[0].logprobs.content[{i}].logprob"))
    return _openai_sequence(obj, ch, rid, texts, lps, echo=False)


# --------------------------------------------------------------------------- entry points

_PARSERS = {"sglang": _parse_sglang, "vllm": _parse_vllm, "openai": _parse_openai, "openai-chat": _parse_openai_chat}


def _check_nulls(seq: SequenceLogprobs, required_from: int) -> None:
    """A null logprob where one must be given is missing data, never a position to skip."""
    for i in range(required_from, len(seq.logprobs)):
        if seq.logprobs[i] is None:
            raise UsageError(f"null logprob at position {i}: only the first position the engine reports "
                             "may have none (the prompt's first token)")


def parse_record(obj: Any, *, default_id: str = "record", max_positions: int = MAX_POSITIONS) -> SequenceLogprobs:
    """One engine response object -> SequenceLogprobs; UsageError (without a path) if malformed.

    The message names the request (when it has an id) and the field or position at fault. A
    response over ``max_positions`` positions is refused (SGLang's, before its unscored prefix is
    allocated; the other formats' lists hold one JSON entry per position).
    """
    if not isinstance(obj, dict):
        got = "a JSON list" if isinstance(obj, list) else type(obj).__name__
        raise UsageError(f"expected a JSON object, got {got}")
    rid = _request_id(obj, default_id)
    try:
        fmt = detect_format(obj)
        parse = partial(_parse_sglang, limit=max_positions) if fmt == "sglang" else _PARSERS[fmt]
        seq, required_from = parse(obj, rid)
        if len(seq.logprobs) > max_positions:
            raise UsageError(f"{len(seq.logprobs)} positions are over {_limit_text(max_positions)}")
        _check_nulls(seq, required_from)
        return seq
    except UsageError as e:
        raise UsageError(f"request {rid!r}: {e}") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a structurally wrong field
        raise UsageError(f"request {rid!r}: malformed {fmt} response: {type(e).__name__}: {_show(str(e))}") from None
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
                raise UsageError(f"{p}:{lineno}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
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
                raise UsageError(f"{p}:{lineno}: duplicate request id {seq.request!r} "
                                 f"(first on line {first_line[seq.request]})")
            first_line[seq.request] = lineno
            left -= len(seq.logprobs)
            out.append(seq)
    if not out:
        raise UsageError(f"{p}: holds no engine responses (the file is empty or blank)")
    return out
