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

Request id: ``meta_info.id`` / ``request_id`` / ``id``, else ``line-N`` (a JSON array on one line,
as SGLang's batch ``/generate`` returns, gives ``line-N.k``). A malformed line or a repeated id
raises UsageError ``"<path>:<line>: ..."``.

Example::

    from comparator.engines import read_logprobs_jsonl
    from comparator.logprobs import LogprobThresholds, compare_logprobs
    verdict = compare_logprobs(read_logprobs_jsonl("golden.jsonl"), read_logprobs_jsonl("new.jsonl"),
                               LogprobThresholds.resolve("my-model"))
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dumper.errors import UsageError

from .logprobs import UNKNOWN_TOKEN, SequenceLogprobs, TopK

__all__ = ["EngineFormat", "detect_format", "parse_record", "read_logprobs_jsonl"]

EngineFormat = Literal["sglang", "vllm", "openai", "openai-chat"]


# --------------------------------------------------------------------------- small validators


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise UsageError(f"{what} must be a list, got {type(v).__name__}")
    return v


def _logprob(v: Any, what: str, *, nullable: bool = True) -> float | None:
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{what} must be a number{' or null' if nullable else ''}, got {v!r}")
    return float(v)


def _token_id(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, str) and v.lstrip("-").isdigit():
            return int(v)
        raise UsageError(f"{what} must be an integer token id, got {v!r}")
    return v


def _ids(v: Any, what: str) -> list[int]:
    return [_token_id(t, f"{what}[{i}]") for i, t in enumerate(_list(v, what))]


def _sort_top(entries: list[tuple[int, float]]) -> TopK:
    """Most likely first, ties by token id: engines order equal values differently."""
    return tuple(sorted(entries, key=lambda e: (-e[1] if not math.isnan(e[1]) else math.inf, e[0])))


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
    meta = obj.get("meta_info")
    for v in ((meta or {}).get("id") if isinstance(meta, dict) else None, obj.get("request_id"), obj.get("id")):
        if v is not None and v != "":
            return str(v)
    return default_id


# --------------------------------------------------------------------------- SGLang


def _sglang_triples(v: Any, what: str) -> tuple[list[float | None], list[int]]:
    lps: list[float | None] = []
    ids: list[int] = []
    for i, e in enumerate(_list(v, what)):
        if not isinstance(e, list) or len(e) not in (2, 3):
            raise UsageError(f"{what}[{i}] must be [logprob, token_id, text], got {e!r}")
        lps.append(_logprob(e[0], f"{what}[{i}][0]"))
        ids.append(_token_id(e[1], f"{what}[{i}][1]"))
    return lps, ids


def _sglang_top(v: Any, n: int, what: str) -> list[TopK | None]:
    entries = _list(v, what)
    if len(entries) != n:
        raise UsageError(f"{what} has {len(entries)} entries for {n} tokens")
    out: list[TopK | None] = []
    for i, e in enumerate(entries):
        if e is None:
            out.append(None)
            continue
        lps, ids = _sglang_triples(e, f"{what}[{i}]")
        if any(lp is None for lp in lps):
            raise UsageError(f"{what}[{i}] has a null logprob")
        out.append(_sort_top([(t, float(lp or 0.0)) for t, lp in zip(ids, lps, strict=True)]))
    return out


def _parse_sglang(obj: Mapping[str, Any], rid: str) -> SequenceLogprobs:
    meta = obj["meta_info"]
    if not isinstance(meta, dict):
        raise UsageError("meta_info must be an object")
    if meta.get("input_token_logprobs") is None and meta.get("output_token_logprobs") is None:
        raise UsageError("meta_info has no input_token_logprobs/output_token_logprobs (request with return_logprob=true)")
    in_lps, in_ids = _sglang_triples(meta.get("input_token_logprobs") or [], "meta_info.input_token_logprobs")
    out_lps, out_ids = _sglang_triples(meta.get("output_token_logprobs") or [], "meta_info.output_token_logprobs")

    # logprob_start_len = s > 0: SGLang returns positions s.. only; put them back at absolute positions.
    prompt = _ids(obj["input_ids"], "input_ids") if obj.get("input_ids") is not None else None
    n_prompt: Any = len(prompt) if prompt is not None else meta.get("prompt_tokens", len(in_ids))
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or n_prompt < len(in_ids):
        raise UsageError(f"prompt length {n_prompt!r} is shorter than the {len(in_ids)} input_token_logprobs")
    start = n_prompt - len(in_ids)
    if prompt is not None:
        if prompt[start:] != in_ids:
            raise UsageError(f"input_ids[{start}:] differ from the ids in meta_info.input_token_logprobs")
        prefix = prompt[:start]
    else:
        prefix = [UNKNOWN_TOKEN] * start

    ids = prefix + in_ids + out_ids
    lps = [None] * start + in_lps + out_lps
    top: list[TopK | None] | None = None
    in_top, out_top = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    if in_top or out_top:
        it = _sglang_top(in_top, len(in_ids), "meta_info.input_top_logprobs") if in_top else [None] * len(in_ids)
        ot = _sglang_top(out_top, len(out_ids), "meta_info.output_top_logprobs") if out_top else [None] * len(out_ids)
        top = [None] * start + it + ot
    return SequenceLogprobs(rid, tuple(ids), tuple(lps), None if top is None else tuple(top))


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
        raise UsageError(f"{what} must be an object {{token_id: {{logprob, ...}}}} or null, got {type(entry).__name__}")
    pairs = [(_token_id(k, f"{what} key"), _vllm_value(v, f"{what}[{k!r}]")) for k, v in entry.items()]
    own = [lp for t, lp in pairs if t == token]
    if not own:
        raise UsageError(f"{what} has no entry for its token id {token}")
    return own[0], _sort_top(pairs)


def _parse_vllm(obj: Mapping[str, Any], rid: str) -> SequenceLogprobs:
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

    if ch is None:  # offline RequestOutput: outputs[0].token_ids + outputs[0].logprobs
        outs = obj.get("outputs") or []
        out = _list(outs, "outputs")[0] if outs else None
        if out is not None and out.get("logprobs") is not None:
            oids = _ids(out.get("token_ids"), "outputs[0].token_ids")
            olps = _list(out["logprobs"], "outputs[0].logprobs")
            if len(olps) != len(oids):
                raise UsageError(f"outputs[0].logprobs has {len(olps)} entries for {len(oids)} token_ids")
            for j, (e, t) in enumerate(zip(olps, oids, strict=True)):
                lp, tk = _vllm_position(e, t, f"outputs[0].logprobs[{j}]")
                ids.append(t)
                lps.append(lp)
                top.append(tk)
    else:  # OpenAI server: output ids in choices[0].token_ids, their logprobs OpenAI-style
        oids_raw, olp = ch.get("token_ids"), ch.get("logprobs")
        if oids_raw is not None and isinstance(olp, dict) and olp.get("token_logprobs") is not None:
            oids = _ids(oids_raw, "choices[0].token_ids")
            tl = _list(olp["token_logprobs"], "choices[0].logprobs.token_logprobs")
            if len(tl) == len(ids) + len(oids):  # echo=True: prompt then output
                tl = tl[len(ids):]
            if len(tl) != len(oids):
                raise UsageError(f"choices[0].logprobs.token_logprobs has {len(tl)} entries for {len(oids)} token_ids")
            ids += oids
            lps += [_logprob(v, f"choices[0].logprobs.token_logprobs[{j}]") for j, v in enumerate(tl)]
            top += [None] * len(oids)
    return SequenceLogprobs(rid, tuple(ids), tuple(lps), tuple(top))


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
                     lps: list[float | None]) -> SequenceLogprobs:
    got = _openai_ids(obj, ch, len(texts))
    if got is None:
        return SequenceLogprobs(rid, (), tuple(lps), None, tuple(texts))
    ids, start = got
    return SequenceLogprobs(rid, tuple(ids), tuple([None] * start + lps))


def _parse_openai(obj: Mapping[str, Any], rid: str) -> SequenceLogprobs:
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
    return _openai_sequence(obj, ch, rid, texts, lps)


def _parse_openai_chat(obj: Mapping[str, Any], rid: str) -> SequenceLogprobs:
    ch = _choice0(obj)
    assert ch is not None
    content = _list(ch["logprobs"]["content"], "choices[0].logprobs.content")
    texts: list[str] = []
    lps: list[float | None] = []
    for i, e in enumerate(content):
        if not isinstance(e, dict) or not isinstance(e.get("token"), str):
            raise UsageError(f"choices[0].logprobs.content[{i}] must be {{token, logprob, ...}}")
        texts.append(e["token"])
        lps.append(_logprob(e.get("logprob"), f"choices[0].logprobs.content[{i}].logprob"))
    return _openai_sequence(obj, ch, rid, texts, lps)


# --------------------------------------------------------------------------- entry points

_PARSERS = {"sglang": _parse_sglang, "vllm": _parse_vllm, "openai": _parse_openai, "openai-chat": _parse_openai_chat}


def parse_record(obj: Any, *, default_id: str = "record") -> SequenceLogprobs:
    """One engine response object -> SequenceLogprobs; UsageError (without a path) if malformed."""
    if not isinstance(obj, dict):
        raise UsageError(f"expected a JSON object, got {type(obj).__name__}")
    fmt = detect_format(obj)
    try:
        return _PARSERS[fmt](obj, _request_id(obj, default_id))
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a structurally wrong field
        raise UsageError(f"malformed {fmt} response: {type(e).__name__}: {e}") from None
    except ValueError as e:  # SequenceLogprobs length checks
        raise UsageError(f"malformed {fmt} response: {e}") from None


def read_logprobs_jsonl(path: str | os.PathLike[str]) -> list[SequenceLogprobs]:
    """Every response of a JSONL file (blank lines skipped), in file order; ids must be unique."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: cannot read: {e}") from None
    out: list[SequenceLogprobs] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{p}:{lineno}: not valid JSON: {e}") from None
        items: Sequence[tuple[Any, str]] = (
            [(o, f"line-{lineno}.{k}") for k, o in enumerate(obj)] if isinstance(obj, list) else [(obj, f"line-{lineno}")])
        for o, default_id in items:
            try:
                seq = parse_record(o, default_id=default_id)
            except UsageError as e:
                raise UsageError(f"{p}:{lineno}: {e}") from None
            if seq.request in first_line:
                raise UsageError(f"{p}:{lineno}: duplicate request id {seq.request!r} (first on line {first_line[seq.request]})")
            first_line[seq.request] = lineno
            out.append(seq)
    return out
