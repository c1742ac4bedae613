"""Collect prompt logprobs from a live server into the JSONL that ``comparator logprobs`` reads.

``python -m comparator collect --server URL --api vllm|sglang|openai`` sends each fixed prompt
once, as token ids where the API takes them, with the logprob of every prompt token requested
and nothing generated where the API allows it:

- **vllm**: ``POST /v1/completions`` with ``prompt`` = the ids (or text), ``echo``,
  ``logprobs=K``, ``prompt_logprobs=K``, ``max_tokens=0`` and ``return_token_ids``. The line is
  vLLM's own response (``choices[0].prompt_logprobs`` keyed by token id).
- **sglang**: ``POST /generate`` with ``input_ids`` (or ``text``), ``return_logprob``,
  ``logprob_start_len=0``, ``top_logprobs_num=K`` and ``max_new_tokens=0``. The line is
  SGLang's own response.
- **openai**: ``POST /v1/completions`` with ``echo``, ``logprobs=K`` and ``max_tokens=1``
  (llama-cpp-python reads 0 as "no limit"); the completion's positions
  (``usage.completion_tokens``) are cut from the echoed lists, so the line scores the prompt
  only. Token ids are added as ``prompt_token_ids`` when ids were sent and the echo covers them
  one to one; otherwise the line has token texts only and compares against another text source.

Each line gets ``request_id`` = the prompt's index, numbered as ``python -m dumper run`` numbers
its sequences (texts first, then ids), so a collected file compares with a dump of the same
inputs. Every line is parsed with :func:`comparator.logprobs.sources.engine_json.parse_record` before the file is
written (atomically, once every prompt answered): what ``collect`` writes, ``logprobs`` reads.

Example::

    from comparator.logprobs.sources.collect import Prompt, collect
    from comparator.logprobs.sources.server_http import ServerClient
    collect(ServerClient("http://127.0.0.1:8000"), "vllm", [Prompt("0", ids=(1, 5, 9))], "run.jsonl", top_k=5)
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dumper.errors import UsageError
from dumper.format import atomic_path

from comparator.logprobs.sources.engine_json import parse_record
from comparator.logprobs.types import SequenceLogprobs
from comparator.logprobs.sources.server_flags import API_NAMES
from comparator.logprobs.sources.server_http import ServerClient, ServerError

__all__ = ["API_NAMES", "Prompt", "Scored", "prompts_from", "served_model", "first_choice", "score", "collect"]


@dataclass(frozen=True)
class Prompt:
    """One fixed input: token ``ids`` or ``text`` (exactly one), sent as request ``request``."""

    request: str
    ids: tuple[int, ...] | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.text is None):
            raise UsageError(f"prompt {self.request!r}: give token ids or text, not both or neither")
        if self.ids is not None and not self.ids:
            raise UsageError(f"prompt {self.request!r} is empty")

    @property
    def value(self) -> list[int] | str:
        """What goes in the request's ``prompt`` field."""
        return list(self.ids) if self.ids is not None else str(self.text)


@dataclass(frozen=True)
class Scored:
    """One answered prompt: the JSONL ``record`` written and the ``sequence`` ``comparator logprobs`` reads from it."""

    record: dict[str, Any]
    sequence: SequenceLogprobs


def prompts_from(texts: Sequence[str], ids: Sequence[Sequence[int]]) -> list[Prompt]:
    """Texts, then id lists, as requests ``"0"``, ``"1"``, ... (the order of ``dumper run``'s sequences)."""
    out = [Prompt(str(i), text=t) for i, t in enumerate(texts)]
    return out + [Prompt(str(len(out) + j), ids=tuple(s)) for j, s in enumerate(ids)]


def served_model(client: ServerClient) -> str | None:
    """The first model ``GET /v1/models`` lists, or None where the server has no such route."""
    try:
        listing = client.get("/v1/models")
    except ServerError as e:
        if e.status in (404, 405):
            return None
        raise
    data = listing.get("data") if isinstance(listing, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]["id"]
    return None


# --------------------------------------------------------------------------- per API


def first_choice(url: str, response: Any) -> dict[str, Any]:
    """``choices[0]`` of an OpenAI-style completion from ``url``; a ServerError when there is none."""
    ch = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        raise ServerError(f"{url}: the response has no choices[0]: not an OpenAI-style completion")
    return ch[0]


def _vllm_request(p: Prompt, top_k: int, model: str | None) -> tuple[str, dict[str, Any]]:
    body = {"prompt": p.value, "max_tokens": 0, "echo": True, "logprobs": top_k, "prompt_logprobs": top_k,
            "temperature": 0.0, "return_token_ids": True}
    return "/v1/completions", body | ({"model": model} if model else {})


def _vllm_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    ch = first_choice(url, response)
    if ch.get("prompt_logprobs") is None:
        raise ServerError(f"{url}: the server returned no prompt logprobs (choices[0].prompt_logprobs): it is not "
                          "vLLM or ignores prompt_logprobs; for another OpenAI-compatible server use --api openai")
    if ch.get("prompt_token_ids") is None and p.ids is not None:  # a vLLM without return_token_ids
        ch["prompt_token_ids"] = list(p.ids)
    lp, prompt_ids = ch.get("logprobs"), ch.get("prompt_token_ids")
    if (isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list) and isinstance(prompt_ids, list)
            and len(lp["token_logprobs"]) == len(prompt_ids)):
        ch["token_ids"] = []  # max_tokens=0: vLLM lists the one token it generates anyway, with no logprob
    return response


def _sglang_request(p: Prompt, top_k: int, model: str | None) -> tuple[str, dict[str, Any]]:
    del model  # SGLang serves one model
    source = {"input_ids": list(p.ids)} if p.ids is not None else {"text": p.text}
    return "/generate", source | {"sampling_params": {"temperature": 0.0, "max_new_tokens": 0},
                                  "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top_k,
                                  "rid": p.request}


def _sglang_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    if isinstance(response, list) and len(response) == 1:
        response = response[0]
    meta = response.get("meta_info") if isinstance(response, dict) else None
    if not isinstance(meta, dict) or not meta.get("input_token_logprobs"):
        raise ServerError(f"{url}: the server returned no prompt logprobs (meta_info.input_token_logprobs): "
                          "is this SGLang's /generate? (it needs return_logprob and logprob_start_len=0)")
    meta["id"] = p.request  # the prompt's index, as in a dump (SGLang echoes rid here too)
    return response


def _openai_request(p: Prompt, top_k: int, model: str | None) -> tuple[str, dict[str, Any]]:
    body = {"prompt": p.value, "max_tokens": 1, "echo": True, "logprobs": top_k, "temperature": 0.0}
    return "/v1/completions", body | ({"model": model} if model else {})


def _completion_tokens(url: str, response: dict[str, Any], ch: dict[str, Any]) -> int:
    usage = response.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if n is None and isinstance(ch.get("token_ids"), list):
        n = len(ch["token_ids"])
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ServerError(f"{url}: the response gives no usage.completion_tokens, so the prompt's logprobs "
                          "cannot be told from the completion's")
    return n


def _openai_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    ch = first_choice(url, response)
    lp = ch.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise ServerError(f"{url}: the server returned no logprobs for echo=true, logprobs=K (choices[0].logprobs "
                          "is empty): it does not score prompts (transformers serve ignores logprob fields)")
    n_out = _completion_tokens(url, response, ch)
    n_echo = len(lp["token_logprobs"]) - n_out
    if n_echo < 1:
        raise ServerError(f"{url}: the server echoed no prompt tokens ({len(lp['token_logprobs'])} logprobs for "
                          f"{n_out} completion tokens): it ignores echo=true")
    for key, v in list(lp.items()):  # tokens, token_logprobs, top_logprobs, text_offset: prompt part only
        if isinstance(v, list) and len(v) == n_echo + n_out:
            lp[key] = v[:n_echo]
    ch.pop("token_ids", None)  # the completion's ids, cut with it
    ch.pop("prompt_logprobs", None)  # vLLM adds its own view with echo; this API is the OpenAI one
    if p.ids is not None and n_echo == len(p.ids) and ch.get("prompt_token_ids") is None:
        ch["prompt_token_ids"] = list(p.ids)
    return response


_API: Final[dict[str, tuple[Callable[..., tuple[str, dict[str, Any]]], Callable[..., dict[str, Any]]]]] = {
    "vllm": (_vllm_request, _vllm_record),
    "sglang": (_sglang_request, _sglang_record),
    "openai": (_openai_request, _openai_record),
}
"""API name -> (request builder, response -> JSONL record)."""


# --------------------------------------------------------------------------- entry points


def _check_api(api: str, top_k: int) -> None:
    if api not in _API:
        raise UsageError(f"--api {api!r}: choose one of {', '.join(API_NAMES)}")
    if top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {top_k}")


def score(client: ServerClient, api: str, prompt: Prompt, *, top_k: int = 0, model: str | None = None) -> Scored:
    """Send one prompt for scoring and return its JSONL record and the sequence read back from it.

    Raises :class:`ServerError` when the server is down, refuses the request, or answers
    without prompt logprobs or with other tokens than were sent.
    """
    _check_api(api, top_k)
    build, to_record = _API[api]
    path, body = build(prompt, top_k, model)
    url = client.url(path)
    record = to_record(url, prompt, copy.deepcopy(client.post(path, body)))
    if isinstance(record, dict):
        record = {"request_id": prompt.request} | {k: v for k, v in record.items() if k != "request_id"}
    try:
        seq = parse_record(record, default_id=prompt.request)
    except UsageError as e:
        raise ServerError(f"{url}: prompt {prompt.request}: the response is not one comparator logprobs reads: {e}") \
            from None
    if prompt.ids is not None and seq.token_ids and tuple(seq.token_ids) != prompt.ids:
        raise ServerError(f"{url}: prompt {prompt.request}: the server scored {len(seq.token_ids)} tokens that differ "
                          f"from the {len(prompt.ids)} sent (it added or dropped tokens)")
    return Scored(record, seq)


def collect(client: ServerClient, api: str, prompts: Sequence[Prompt], out: str | os.PathLike[str], *,
            top_k: int = 0, model: str | None = None) -> list[Scored]:
    """Score every prompt on the server and write one JSONL line per prompt to ``out`` (atomically).

    ``model`` is the served model's name; by default the first one ``/v1/models`` lists (SGLang
    needs none). Nothing is written unless every prompt was answered.
    """
    _check_api(api, top_k)
    if not prompts:
        raise UsageError("no prompts to send")
    if model is None and api != "sglang":
        model = served_model(client)
    results = [score(client, api, p, top_k=top_k, model=model) for p in prompts]
    try:
        with atomic_path(out) as tmp:  # -inf logprobs stay JSON's -Infinity, which the reader takes
            tmp.write_text("".join(json.dumps(r.record) + "\n" for r in results), encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{out}: cannot write ({e.strerror or e})") from None
    return results
