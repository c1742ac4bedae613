"""Inference-engine logprob responses (one JSON object each) as SequenceLogprobs: SGLang, vLLM, OpenAI.

Each response is detected on its own (:func:`detect_format`):

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

Every field is validated before use (:func:`parse_response` raises UsageError naming the field
or position); :mod:`comparator.logprobs.sources.engine_json` reads whole JSONL files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from comparator.logprobs.sources.input_caps import MAX_POSITIONS, TOKEN_ID_LIMIT, limit_text
from comparator.logprobs.types import UNKNOWN_TOKEN, SequenceLogprobs, TopK
from dumper.errors import UsageError

__all__ = ["EngineFormat", "Parsed", "detect_format", "request_id", "parse_response", "show"]

EngineFormat = Literal["sglang", "vllm", "openai", "openai-chat"]


# --------------------------------------------------------------------------- small validators


def show(v: Any) -> str:
    """``v`` for an error message: a short repr of a scalar, the type of a container (one line,
    bounded, and no recursion into a deeply nested value)."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'list'}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise UsageError(f"{what} must be a list, got {show(v)}")
    return v


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise UsageError(f"{what} must be an object, got {show(v)}")
    return v


def _logprob(v: Any, what: str, *, nullable: bool = True) -> float | None:
    """A logprob: a finite number or -inf (JSON ``-Infinity``); never a string, bool, NaN or +inf."""
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{what} must be a number{' or null' if nullable else ''}, got {show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond float range
        f = math.inf
    if math.isnan(f) or f == math.inf:
        raise UsageError(f"{what} must be a finite number or -inf, got {show(v)}")
    return f


def _in_range(t: int, what: str) -> int:
    if not 0 <= t < TOKEN_ID_LIMIT:
        raise UsageError(f"{what}: token id {show(t)} is out of range [0, 2^31)")
    return t


def _token_id(v: Any, what: str) -> int:
    """A token id: a JSON integer (not a bool, float or string) in ``[0, TOKEN_ID_LIMIT)``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{what} must be an integer token id, got {show(v)}")
    return _in_range(v, what)


def _token_key(k: str, what: str) -> int:
    """A token id written as an object key (vLLM's ``{"<token_id>": ...}``): decimal digits only."""
    if not _DIGITS.fullmatch(k):
        raise UsageError(f"{what}: key {show(k)} is not a token id")
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


def request_id(obj: Mapping[str, Any], default_id: str) -> str:
    """``meta_info.id`` / ``request_id`` / ``id`` (a string or an integer), else ``default_id``."""
    meta = obj.get("meta_info")
    for key, v in (
        ("meta_info.id", meta.get("id") if isinstance(meta, dict) else None),
        ("request_id", obj.get("request_id")),
        ("id", obj.get("id")),
    ):
        if v is None or v == "":
            continue
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise UsageError(f"{key} must be a string or an integer, got {show(v)}")
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
            raise UsageError(f"{what}[{i}] must be [logprob, token_id, text], got {show(e)}")
        if len(e) == 3 and e[2] is not None and not isinstance(e[2], str):
            raise UsageError(f"{what}[{i}][2] must be the token text or null, got {show(e[2])}")
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


def _sglang_prompt(
    obj: Mapping[str, Any], meta: Mapping[str, Any], in_ids: list[int], n_out: int, limit: int
) -> tuple[int, list[int]]:
    """(start, token ids of positions 0..start-1) for ``logprob_start_len = start``: SGLang returns
    positions ``start..`` only; the start comes from ``input_ids`` or ``meta_info.prompt_tokens``.
    A prompt and ``n_out`` output tokens over ``limit`` positions are refused before the unscored
    prefix is allocated."""
    prompt = _ids(obj["input_ids"], "input_ids") if obj.get("input_ids") is not None else None
    n_prompt: Any = len(prompt) if prompt is not None else meta.get("prompt_tokens", len(in_ids))
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or n_prompt < len(in_ids):
        raise UsageError(
            f"prompt length {show(n_prompt)} is not an integer or shorter than the {len(in_ids)} input_token_logprobs"
        )
    if n_prompt + n_out > limit:
        raise UsageError(f"prompt length {n_prompt} and {n_out} output tokens are over {limit_text(limit)}")
    start = n_prompt - len(in_ids)
    if prompt is None:
        return start, [UNKNOWN_TOKEN] * start
    if prompt[start:] != in_ids:
        raise UsageError(f"input_ids[{start}:] differ from the ids in meta_info.input_token_logprobs")
    return start, prompt[:start]


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
        it = (
            _sglang_top(in_top, len(in_ids), "meta_info.input_top_logprobs", first_may_be_null=True)
            if in_top
            else [None] * len(in_ids)
        )
        ot = (
            _sglang_top(out_top, len(out_ids), "meta_info.output_top_logprobs", first_may_be_null=not in_ids)
            if out_top
            else [None] * len(out_ids)
        )
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
        raise UsageError(f"{what} must be an object {{token_id: {{logprob, ...}}}} or null, got {show(entry)}")
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
    return [
        (t, *_vllm_position(e, t, f"outputs[0].logprobs[{j}]")) for j, (e, t) in enumerate(zip(olps, oids, strict=True))
    ]


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
    return [
        (t, _logprob(tl[skip + j], f"choices[0].logprobs.token_logprobs[{skip + j}]"), None) for j, t in enumerate(oids)
    ]


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
    raise UsageError(
        f"token ids (prompt_token_ids: {None if prompt is None else len(prompt)}, token_ids: "
        f"{None if toks is None else len(toks)}) do not cover the {n} logprob tokens"
    )


def _openai_sequence(
    obj: Mapping[str, Any], ch: Mapping[str, Any], rid: str, texts: list[str], lps: list[float | None], *, echo: bool
) -> Parsed:
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
            raise UsageError(f"choices[0].logprobs.content[{i}] must be {{token, logprob, ...}}, got {show(e)}")
        texts.append(e["token"])
        lps.append(_logprob(e.get("logprob"), f"choices[0].logprobs.content[{i}].logprob"))
    return _openai_sequence(obj, ch, rid, texts, lps, echo=False)


# --------------------------------------------------------------------------- entry points

_PARSERS: Final = {"vllm": _parse_vllm, "openai": _parse_openai, "openai-chat": _parse_openai_chat}


def parse_response(obj: Mapping[str, Any], fmt: EngineFormat, rid: str, *, limit: int = MAX_POSITIONS) -> Parsed:
    """Request ``rid``'s response ``obj`` in format ``fmt`` (:func:`detect_format`); an SGLang
    response claiming over ``limit`` positions is refused before its unscored prefix is allocated."""
    if fmt == "sglang":
        return _parse_sglang(obj, rid, limit)
    return _PARSERS[fmt](obj, rid)
