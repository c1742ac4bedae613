"""Decode <-> prefill self-consistency of a live server: :mod:`dumper.jobs.selfcheck` over HTTP.

For each prompt the server generates ``new_tokens`` tokens greedily (temperature 0, EOS
ignored where the API allows) and reports the logprob of each as it decodes it; then it
re-scores prompt + output in one pure prefill, and the two logprobs of every output token are
compared by k3 = (e^d - 1) - d, d = log q_decode - log p_prefill (:func:`comparator.logprobs.metrics.k3_summary`).
The tokens are greedy, not samples, so mean k3 is a biased estimate of KL (the result's
``k3_tokens`` and ``k3_note`` say so, as for :mod:`dumper.jobs.selfcheck`).
What "pure" means per API:

- **vllm**: the re-score asks for ``prompt_logprobs``, and vLLM never reads its prefix cache for
  such a request, so nothing the decode wrote is reused.
- **sglang**: ``POST /flush_cache`` before each step empties the radix cache.
- **openai**: the output comes back as text, so the prompt must be text too and the re-score
  sends prompt + output text; a server that re-tokenizes it differently is reported (exit 2).
  The server decides what it reuses: llama-cpp-python's keeps the last request's tokens and
  reuses their common prefix, so a one-token request of another text goes first to replace them.

Example::

    from dumper.server.api import Prompt
    from dumper.server.client import ServerClient
    from dumper.jobs.server_selfcheck import server_selfcheck
    r = server_selfcheck(ServerClient("http://127.0.0.1:8000"), "vllm", Prompt("0", ids=(1, 5, 9)), new_tokens=8)
    r.passed, r.k3
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from comparator import k3_summary, parse_record, score_prompt
from dumper.errors import UsageError
from dumper.format.jsonfloat import from_json_float, to_json_float
from dumper.jobs.k3_json import k3_from_json, k3_to_json
from dumper.server.api import Prompt, first_choice
from dumper.server.client import ServerClient, ServerError

__all__ = ["ServerSelfCheck", "Generation", "generate", "server_selfcheck"]


@dataclass(frozen=True)
class Generation:
    """A greedy continuation: the prompt's ids (None when only text is known), the output's ids
    (None for the openai API) and token texts, its decode-time logprobs, and the generated text."""

    prompt_ids: tuple[int, ...] | None
    output_ids: tuple[int, ...] | None
    output_texts: tuple[str, ...] | None
    logprobs: tuple[float, ...]
    text: str = ""


@dataclass(frozen=True)
class ServerSelfCheck:
    """One prompt's verdict: the decode-path vs prefill-path logprob of every output token.

    ``positions`` are the output tokens' positions in the re-scored sequence; ``k3`` holds one
    value per output token, in order.
    """

    request: str
    positions: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_texts: tuple[str, ...] | None
    decode_logprobs: tuple[float, ...]
    prefill_logprobs: tuple[float, ...]
    k3: tuple[float, ...]
    k3_mean: float
    k3_max: float
    k3_max_position: int
    max_abs_err: float
    threshold: float
    passed: bool
    k3_tokens: str = "greedy"
    """How the scored tokens were chosen: greedy (temperature 0), so mean k3 is not an unbiased KL estimate."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["k3"] = [to_json_float(v) for v in self.k3]
        return k3_to_json(d)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ServerSelfCheck:
        """Inverse of :meth:`to_json`; a null k3 or error reads back infinite (a NaN one too: it never passes)."""
        texts = d.get("output_texts")
        return cls(
            request=str(d["request"]),
            positions=tuple(int(p) for p in d["positions"]),
            output_ids=tuple(int(t) for t in d["output_ids"]),
            output_texts=None if texts is None else tuple(str(t) for t in texts),
            decode_logprobs=tuple(float(v) for v in d["decode_logprobs"]),
            prefill_logprobs=tuple(float(v) for v in d["prefill_logprobs"]),
            k3=tuple(from_json_float(v) for v in d["k3"]),
            **k3_from_json(d),
        )


def _numbers(url: str, values: Any, n: int, what: str) -> tuple[float, ...]:
    if (
        not isinstance(values, list)
        or len(values) != n
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    ):
        raise ServerError(f"{url}: {what} must be {n} numbers, got {str(values)[:80]}")
    return tuple(float(v) for v in values)


def _generate_vllm(client: ServerClient, p: Prompt, n: int, model: str | None) -> Generation:
    body = {
        "prompt": p.value,
        "max_tokens": n,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    } | ({"model": model} if model else {})
    url = client.url("/v1/completions")
    ch = first_choice(url, client.post("/v1/completions", body))
    out, prompt_ids = ch.get("token_ids"), ch.get("prompt_token_ids")
    if not isinstance(out, list) or not isinstance(prompt_ids, list):
        raise ServerError(
            f"{url}: the server returned no token ids (return_token_ids): it is not vLLM, or an "
            "older one; use --api openai with --prompt"
        )
    lp = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else {}
    return Generation(
        tuple(prompt_ids),
        tuple(out),
        None,
        _numbers(url, lp.get("token_logprobs"), len(out), "choices[0].logprobs.token_logprobs"),
    )


def _generate_sglang(client: ServerClient, p: Prompt, n: int) -> Generation:
    source = {"input_ids": list(p.ids)} if p.ids is not None else {"text": p.text}
    body = source | {
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "rid": f"{p.request}-decode",
    }
    url = client.url("/generate")
    client.post_text("/flush_cache")
    response = client.post("/generate", body)
    response = response[0] if isinstance(response, list) and len(response) == 1 else response
    meta = response.get("meta_info") if isinstance(response, dict) else None
    if not isinstance(meta, dict) or not meta.get("output_token_logprobs"):
        raise ServerError(
            f"{url}: the server returned no output logprobs (meta_info.output_token_logprobs): "
            "is this SGLang's /generate?"
        )
    try:
        seq = parse_record(response, default_id=p.request)
    except UsageError as e:
        raise ServerError(f"{url}: the response is not an SGLang /generate answer: {e}") from None
    m = len(meta["output_token_logprobs"])
    lps = seq.logprobs[-m:]
    if any(v is None for v in lps):
        raise ServerError(f"{url}: meta_info.output_token_logprobs holds a null logprob")
    return Generation(tuple(seq.token_ids[:-m]), tuple(seq.token_ids[-m:]), None, tuple(float(v) for v in lps))


def _generate_openai(client: ServerClient, p: Prompt, n: int, model: str | None) -> Generation:
    if p.text is None:
        raise UsageError(
            "--api openai re-scores text (the API returns the output as text, not ids): "
            "pass --prompt instead of --input-ids"
        )
    # repeat_penalty: llama-cpp-python's server penalizes repeats by default, which is not greedy
    body = {"prompt": p.text, "max_tokens": n, "temperature": 0.0, "logprobs": 0, "repeat_penalty": 1.0} | (
        {"model": model} if model else {}
    )
    url = client.url("/v1/completions")
    ch = first_choice(url, client.post("/v1/completions", body))
    lp = ch.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list) or not lp["tokens"]:
        raise ServerError(f"{url}: the server returned no logprobs for the generated tokens (logprobs=0)")
    texts = tuple(str(t) for t in lp["tokens"])
    return Generation(
        None,
        None,
        texts,
        _numbers(url, lp.get("token_logprobs"), len(texts), "choices[0].logprobs.token_logprobs"),
        str(ch.get("text", "")),
    )


def generate(
    client: ServerClient, api: str, prompt: Prompt, new_tokens: int, *, model: str | None = None
) -> Generation:
    """Greedy ``new_tokens`` tokens after ``prompt`` with their decode-time logprobs (see the module doc)."""
    if api == "vllm":
        return _generate_vllm(client, prompt, new_tokens, model)
    if api == "sglang":
        return _generate_sglang(client, prompt, new_tokens)
    if api == "openai":
        return _generate_openai(client, prompt, new_tokens, model)
    raise UsageError(f"--api {api!r}: choose one of vllm, sglang, openai")


def _prefill(
    client: ServerClient, api: str, prompt: Prompt, gen: Generation, model: str | None
) -> tuple[list[float | None], int]:
    """Prefill logprobs of the output tokens and the position of the first one, re-scoring prompt + output."""
    rid = f"{prompt.request}-prefill"
    if gen.output_ids is not None and gen.prompt_ids is not None:
        if api == "sglang":
            client.post_text("/flush_cache")
        seq = score_prompt(client, api, Prompt(rid, ids=gen.prompt_ids + gen.output_ids), model=model).sequence
        return list(seq.logprobs[-len(gen.output_ids) :]), len(gen.prompt_ids)
    text = f"{prompt.text}{gen.text}"
    other = "\n" if not text.startswith("\n") else "."
    client.post(
        "/v1/completions", {"prompt": other, "max_tokens": 1, "temperature": 0.0} | ({"model": model} if model else {})
    )  # evicts a single-slot cache (see the module doc)
    seq = score_prompt(client, api, Prompt(rid, text=text), model=model).sequence
    n = len(gen.logprobs)
    texts = seq.token_texts or ()
    if len(texts) < n or tuple(texts[-n:]) != gen.output_texts:
        raise ServerError(
            f"{client.base_url}: prompt {prompt.request}: re-scoring prompt + output text gives other "
            f"tokens than were generated ({list(texts[-n:])[:4]} vs {list(gen.output_texts or ())[:4]}): "
            "the server's text round trip does not preserve the tokens; use --api vllm or sglang with ids"
        )
    return list(seq.logprobs[-n:]), len(texts) - n


def server_selfcheck(
    client: ServerClient,
    api: str,
    prompt: Prompt,
    *,
    new_tokens: int = 16,
    threshold: float | None = None,
    model: str | None = None,
) -> ServerSelfCheck:
    """Generate, re-score and compare one prompt (see the module doc); ``threshold`` on mean k3
    defaults to :data:`dumper.jobs.selfcheck.DEFAULT_K3_THRESHOLD`."""
    if threshold is None:
        from dumper.jobs.selfcheck import DEFAULT_K3_THRESHOLD

        threshold = DEFAULT_K3_THRESHOLD
    if new_tokens < 1:
        raise UsageError(f"--new-tokens must be >= 1, got {new_tokens}")
    gen = generate(client, api, prompt, new_tokens, model=model)
    prefill, start = _prefill(client, api, prompt, gen, model)
    if any(v is None for v in prefill):
        raise ServerError(
            f"{client.base_url}: prompt {prompt.request}: the prefill gave no logprob for an output token"
        )
    k3 = k3_summary(prefill, gen.logprobs)
    return ServerSelfCheck(
        request=prompt.request,
        positions=tuple(range(start, start + len(gen.logprobs))),
        output_ids=gen.output_ids or (),
        output_texts=gen.output_texts,
        decode_logprobs=gen.logprobs,
        prefill_logprobs=tuple(float(v) for v in prefill),
        k3=tuple(k3.values.tolist()),
        k3_mean=k3.mean,
        k3_max=k3.max,
        k3_max_position=start + k3.argmax,
        max_abs_err=k3.max_abs_err,
        threshold=threshold,
        passed=bool(k3.mean <= threshold),
    )
