"""Collect prompt logprobs from a live server into the JSONL that ``comparator logprobs`` reads.

``python -m comparator collect --server URL --api vllm|sglang|openai`` sends each fixed prompt
once, as token ids where the API takes them, with the logprob of every prompt token requested
and nothing generated where the API allows it (the requests and records per API:
:mod:`dumper.server.api`).

Each line gets ``request_id`` = the prompt's index, numbered as ``python -m dumper run`` numbers
its sequences (texts first, then ids), so a collected file compares with a dump of the same
inputs. Every line is parsed with :func:`comparator.logprobs.sources.engine_json.parse_record` before the file is
written (atomically, once every prompt answered): what ``collect`` writes, ``logprobs`` reads.

Example::

    from comparator.logprobs.sources.collect import Prompt, collect
    from dumper.server.client import ServerClient
    collect(ServerClient("http://127.0.0.1:8000"), "vllm", [Prompt("0", ids=(1, 5, 9))], "run.jsonl", top_k=5)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from comparator.logprobs.sources.engine_json import parse_record
from comparator.logprobs.types import SequenceLogprobs
from dumper.errors import UsageError
from dumper.format import atomic_path
from dumper.server.api import Prompt, ask, check_api, served_model
from dumper.server.client import ServerClient, ServerError

__all__ = ["Scored", "score_prompt", "collect"]


@dataclass(frozen=True)
class Scored:
    """One answered prompt: the JSONL ``record`` written and the ``sequence`` ``comparator logprobs`` reads from it."""

    record: dict[str, Any]
    sequence: SequenceLogprobs


def score_prompt(client: ServerClient, api: str, prompt: Prompt, *, top_k: int = 0, model: str | None = None) -> Scored:
    """Send one prompt for scoring and return its JSONL record and the sequence read back from it.

    Raises :class:`ServerError` when the server is down, refuses the request, or answers
    without prompt logprobs or with other tokens than were sent.
    """
    url, record = ask(client, api, prompt, top_k=top_k, model=model)
    try:
        seq = parse_record(record, default_id=prompt.request)
    except UsageError as e:
        raise ServerError(
            f"{url}: prompt {prompt.request}: the response is not one comparator logprobs reads: {e}"
        ) from None
    if prompt.ids is not None and seq.token_ids and tuple(seq.token_ids) != prompt.ids:
        raise ServerError(
            f"{url}: prompt {prompt.request}: the server scored {len(seq.token_ids)} tokens that differ "
            f"from the {len(prompt.ids)} sent (it added or dropped tokens)"
        )
    return Scored(record, seq)


def collect(
    client: ServerClient,
    api: str,
    prompts: Sequence[Prompt],
    out: str | os.PathLike[str],
    *,
    top_k: int = 0,
    model: str | None = None,
) -> list[Scored]:
    """Score every prompt on the server and write one JSONL line per prompt to ``out`` (atomically).

    ``model`` is the served model's name; by default the first one ``/v1/models`` lists (SGLang
    needs none). Nothing is written unless every prompt was answered.
    """
    check_api(api, top_k)
    if not prompts:
        raise UsageError("no prompts to send")
    if model is None and api != "sglang":
        model = served_model(client)
    results = [score_prompt(client, api, p, top_k=top_k, model=model) for p in prompts]
    try:
        with atomic_path(out) as tmp:  # -inf logprobs stay JSON's -Infinity, which the reader takes
            tmp.write_text("".join(json.dumps(r.record) + "\n" for r in results), encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{out}: cannot write ({e.strerror or e})") from None
    return results
