"""What a live inference server is asked for prompt logprobs, and its answer as a JSONL record, per API.

- **vllm**: ``POST /v1/completions`` with ``prompt`` = the ids (or text), ``echo``,
  ``logprobs=K``, ``prompt_logprobs=K``, ``max_tokens=0`` and ``return_token_ids``. The record is
  vLLM's own response (``choices[0].prompt_logprobs`` keyed by token id).
- **sglang**: ``POST /generate`` with ``input_ids`` (or ``text``), ``return_logprob``,
  ``logprob_start_len=0``, ``top_logprobs_num=K`` and ``max_new_tokens=0``. The record is
  SGLang's own response.
- **openai**: ``POST /v1/completions`` with ``echo``, ``logprobs=K`` and ``max_tokens=1``
  (llama-cpp-python reads 0 as "no limit"); the completion's positions
  (``usage.completion_tokens``) are cut from the echoed lists, so the record scores the prompt
  only. Token ids are added as ``prompt_token_ids`` when ids were sent and the echo covers them
  one to one; otherwise the record has token texts only and compares against another text source.

It judges nothing: the comparator reads the records (``comparator.logprobs.sources.collect``).

Example::

    from dumper.server.api import Prompt, ask
    from dumper.server.client import ServerClient
    url, record = ask(ServerClient("http://127.0.0.1:8000"), "vllm", Prompt("0", ids=(1, 5, 9)), top_k=5)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dumper.errors import UsageError
from dumper.server.client import ServerClient, ServerError
from dumper.server.flags import API_NAMES

__all__ = ["Prompt", "prompts_from", "served_model", "first_choice", "check_api", "ask"]


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
    body = {
        "prompt": p.value,
        "max_tokens": 0,
        "echo": True,
        "logprobs": top_k,
        "prompt_logprobs": top_k,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    return "/v1/completions", body | ({"model": model} if model else {})


def _vllm_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    ch = first_choice(url, response)
    if ch.get("prompt_logprobs") is None:
        raise ServerError(
            f"{url}: the server returned no prompt logprobs (choices[0].prompt_logprobs): it is not "
            "vLLM or ignores prompt_logprobs; for another OpenAI-compatible server use --api openai"
        )
    if ch.get("prompt_token_ids") is None and p.ids is not None:  # a vLLM without return_token_ids
        ch["prompt_token_ids"] = list(p.ids)
    lp, prompt_ids = ch.get("logprobs"), ch.get("prompt_token_ids")
    if (
        isinstance(lp, dict)
        and isinstance(lp.get("token_logprobs"), list)
        and isinstance(prompt_ids, list)
        and len(lp["token_logprobs"]) == len(prompt_ids)
    ):
        ch["token_ids"] = []  # max_tokens=0: vLLM lists the one token it generates anyway, with no logprob
    return response


def _sglang_request(p: Prompt, top_k: int, model: str | None) -> tuple[str, dict[str, Any]]:
    del model  # SGLang serves one model
    source = {"input_ids": list(p.ids)} if p.ids is not None else {"text": p.text}
    return "/generate", source | {
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top_k,
        "rid": p.request,
    }


def _sglang_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    if isinstance(response, list) and len(response) == 1:
        response = response[0]
    meta = response.get("meta_info") if isinstance(response, dict) else None
    if not isinstance(meta, dict) or not meta.get("input_token_logprobs"):
        raise ServerError(
            f"{url}: the server returned no prompt logprobs (meta_info.input_token_logprobs): "
            "is this SGLang's /generate? (it needs return_logprob and logprob_start_len=0)"
        )
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
        raise ServerError(
            f"{url}: the response gives no usage.completion_tokens, so the prompt's logprobs "
            "cannot be told from the completion's"
        )
    return n


def _openai_record(url: str, p: Prompt, response: Any) -> dict[str, Any]:
    ch = first_choice(url, response)
    lp = ch.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
        raise ServerError(
            f"{url}: the server returned no logprobs for echo=true, logprobs=K (choices[0].logprobs "
            "is empty): it does not score prompts (transformers serve ignores logprob fields)"
        )
    n_out = _completion_tokens(url, response, ch)
    n_echo = len(lp["token_logprobs"]) - n_out
    if n_echo < 1:
        raise ServerError(
            f"{url}: the server echoed no prompt tokens ({len(lp['token_logprobs'])} logprobs for "
            f"{n_out} completion tokens): it ignores echo=true"
        )
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


def check_api(api: str, top_k: int) -> None:
    if api not in _API:
        raise UsageError(f"--api {api!r}: choose one of {', '.join(API_NAMES)}")
    if top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {top_k}")


def ask(
    client: ServerClient, api: str, prompt: Prompt, *, top_k: int = 0, model: str | None = None
) -> tuple[str, dict[str, Any]]:
    """Send one prompt for scoring: the URL asked and the answer as the JSONL record (``request_id`` first).

    Raises :class:`ServerError` when the server is down, refuses the request, or answers without prompt logprobs.
    """
    check_api(api, top_k)
    build, to_record = _API[api]
    path, body = build(prompt, top_k, model)
    url = client.url(path)
    record = to_record(url, prompt, copy.deepcopy(client.post(path, body)))
    if isinstance(record, dict):
        record = {"request_id": prompt.request} | {k: v for k, v in record.items() if k != "request_id"}
    return url, record
