"""Capture from a live ``vllm serve``: the requests this client sends, recorded where the server runs its model.

A server started with driftscope's tap and a spool directory records, on every rank, exactly the
requests marked with a capture token (:mod:`dumper.engines.vllm.spool`)::

    DRIFTSCOPE_VLLM_SPOOL=/tmp/ds-spool python -m dumper.engines.vllm.serve CKPT --port 8000 \\
        --additional-config '{"driftscope": {"layers": "all"}}'

:func:`collect_dump` sends each prompt as one ``POST /v1/completions`` (the token ids as the
prompt, ``max_tokens=1``, greedy, ``prompt_logprobs`` = top-k with ``--logprobs``, and
``vllm_xargs`` = the marker of a fresh token; with ``--new-tokens N``, ``max_tokens=N`` with
``ignore_eos``, the generated tokens' ``logprobs`` as token ids, and the marker asks for the N-1
decode steps too), records the prompt (and generated) logprobs of the answers, waits
for every rank's part in ``SPOOL/TOKEN`` and joins them into one dump
(:func:`dumper.engines.vllm.parts.join_dump`, the manifest last); ``SPOOL/TOKEN`` is removed
either way. Anyone else's requests (unmarked, or marked with another token) are never in it.

vLLM computes every position of a request that asks ``prompt_logprobs``; without ``--logprobs`` the
server may read a prompt's leading blocks from its prefix cache, computed by earlier requests, and
the dump then has no rows there: ``extra.prefix_cache_hits`` and ``extra.missing_positions`` say so.

Example::

    from dumper.jobs.collect import CollectConfig, collect_dump
    collect_dump(CollectConfig(server="http://127.0.0.1:8000", spool="/tmp/ds-spool", out="dumps/served",
                               model="ckpt", input_ids=((1, 5, 9),)))
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comparator import SequenceLogprobs, TopK, parse_record
from dumper.engines.base import EngineInfo, hf_identity
from dumper.engines.vllm.parts import RankParts, join_dump, new_token, remove_spool, wait_parts
from dumper.engines.vllm.spool import marker
from dumper.engines.vllm.tap import tap_config
from dumper.errors import DumpError, UsageError
from dumper.format import MANIFEST_NAME, Manifest
from dumper.format.decode import GENERATED_IDS, NEW_TOKENS
from dumper.hooks.capture import Capture
from dumper.hooks.layers import ATTN_INPUT
from dumper.modeldir import check_model_dir
from dumper.prefill.logprob_records import LogprobSpec, record_token_logprobs
from dumper.progress import ProgressFn
from dumper.prompts import BUILTIN_PROMPTS
from dumper.server.api import first_choice, served_model
from dumper.server.client import ServerClient, ServerError
from dumper.server.flags import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S
from dumper.settings import VLLM_SPOOL_ENV

__all__ = ["CollectConfig", "collect_dump", "served_sequences", "PART_WAIT_S", "MAX_CONCURRENCY"]

PART_WAIT_S = 60.0
"""Default ``--part-timeout``: seconds to wait for the server's capture parts after the last answer."""
MAX_CONCURRENCY = 256
"""Most requests in flight at once (``--concurrency``)."""
_TAP_CONFIG = json.dumps(tap_config("all"))
"""The ``--additional-config`` a server needs for a capture of every layer."""


@dataclass(frozen=True)
class CollectConfig:
    """What ``python -m dumper collect`` does: prompts sent to ``server``, the dump written to ``out``.

    ``model`` is the checkpoint directory the server serves: the dump's model identity (else the
    one the server's worker reports) and the tokenizer of text prompts (token ids need none).
    ``logprobs`` takes ``top_k`` only (the server's logits are not sent over HTTP).
    """

    server: str
    spool: str
    out: str
    model: str | None = None
    prompts: tuple[str, ...] = ()
    input_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: LogprobSpec | None = None
    served_model: str | None = None
    """The model name requests carry (default: the first one ``/v1/models`` lists)."""
    part_timeout: float = PART_WAIT_S
    request_timeout: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    concurrency: int = 8
    new_tokens: int = 0
    """``--new-tokens N``: N greedy tokens per prompt, their decode steps recorded (:mod:`dumper.format.decode`)."""

    def __post_init__(self) -> None:
        if self.new_tokens < 0:
            raise UsageError(f"--new-tokens must be >= 0, got {self.new_tokens}")
        if not (
            isinstance(self.part_timeout, (int, float)) and math.isfinite(self.part_timeout) and self.part_timeout > 0
        ):
            raise UsageError(f"--part-timeout must be a positive number of seconds, got {self.part_timeout!r}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency must be in 1..{MAX_CONCURRENCY}, got {self.concurrency}")
        spec = self.logprobs
        if spec is not None and (spec.save_logits or spec.start_len):
            raise UsageError(
                "collect records the prompt logprobs the server sends (--logprobs, --top-k); "
                "full logits rows and a logprob start need a local run (python -m dumper run)"
            )
        if spec is not None and spec.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {spec.top_k}")


def _spool_dir(spool: str) -> Path:
    path = Path(spool)
    if not path.is_dir():
        raise UsageError(f"--spool {spool}: not a directory (the one the server's {VLLM_SPOOL_ENV} names)")
    return path


def _checkpoint(model: str | None) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint directory, its HF identity), or (None, None) without ``--model``."""
    if model is None:
        return None, None
    path = Path(model)
    if not path.is_dir() or not os.path.lexists(path / "config.json"):
        raise UsageError(
            f"--model {model}: expected the local HF checkpoint directory the server serves (with config.json)"
        )
    check_model_dir(path)
    return path, hf_identity(path, model)


def served_sequences(cfg: CollectConfig, checkpoint: Path | None, vocab_size: int | None) -> list[list[int]]:
    """``cfg``'s prompts as token ids, numbered as ``dumper run`` numbers them: texts first (by the checkpoint's
    tokenizer; the built-in prompts when none are given), then ``input_ids``."""
    from dumper.tokenizers import load_tokenizer

    seqs = [list(s) for s in cfg.input_ids]
    texts = list(cfg.prompts) or ([] if seqs else list(BUILTIN_PROMPTS))
    if texts:
        tok = load_tokenizer(str(checkpoint)) if checkpoint is not None else None
        if tok is None:
            raise UsageError(
                "text prompts are tokenized as the HF dump tokenizes them: give --model CKPT "
                "(a checkpoint with a tokenizer), or token ids (--input-ids, input_ids lines)"
            )
        seqs = [tok.encode(t) for t in texts] + seqs
    for i, s in enumerate(seqs):
        if not s:
            raise UsageError(f"prompt {i} is empty")
        bad = [t for t in s if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if cfg.logprobs is not None and all(len(s) < 2 for s in seqs):
        raise UsageError("--logprobs: every prompt is one token long, so no position has a logprob to record")
    return seqs


def _server_version(client: ServerClient) -> str:
    """vLLM's version as ``GET /version`` gives it; a ServerError for a server that is not vLLM."""
    try:
        answer = client.get("/version")
    except ServerError as e:
        if e.status in (404, 405):
            raise ServerError(
                f"{client.url('/version')}: HTTP {e.status}: not a vLLM server "
                "(python -m dumper collect talks to vllm serve)",
                status=e.status,
            ) from None
        raise
    version = answer.get("version") if isinstance(answer, dict) else None
    if not isinstance(version, str) or not version:
        raise ServerError(f"{client.url('/version')}: the answer has no version string: not a vLLM server")
    return version[:64]


def _body(
    ids: list[int], model: str | None, token: str, seq: int, count: int, spec: LogprobSpec | None, new: int = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": max(new, 1),
        "temperature": 0.0,
        "return_token_ids": True,
        "vllm_xargs": marker(token, seq, count, max(new, 1)),
    }
    if new:
        body["ignore_eos"] = True
    if spec is not None:
        body["prompt_logprobs"] = spec.top_k
        if new:  # the generated tokens' logprobs, their top-k keyed "token_id:N"
            body.update(logprobs=spec.top_k, return_tokens_as_token_ids=True)
    return body | ({"model": model} if model else {})


def _generated(url: str, seqs: list[list[int]], answers: list[Any], new: int) -> list[list[int]]:
    """Each answer's ``new`` generated token ids (``choices[0].token_ids``), checked for their count."""
    out = []
    for i, a in enumerate(answers):
        ids = first_choice(url, a).get("token_ids")
        if type(ids) is not list or len(ids) != new or not all(type(t) is int and t >= 0 for t in ids):
            raise ServerError(
                f"{url}: the answer to prompt {i} has no {new} generated token ids "
                "(choices[0].token_ids; the server is not vLLM, or stopped early)"
            )
        out.append(ids)
    return out


def _token_id(key: Any, url: str, i: int) -> int:
    text = key if isinstance(key, str) else ""
    if not text.startswith("token_id:") or not text[9:].isdigit():
        raise ServerError(
            f"{url}: prompt {i}: a generated token's top logprob is keyed {key!r}, not token_id:N "
            "(the server ignores return_tokens_as_token_ids)"
        )
    return int(text[9:])


def _record_generated(
    cap: Capture, url: str, seqs: list[list[int]], answers: list[Any], generated: list[list[int]], top_k: int
) -> None:
    """Record each generated token's logprob (and top ``top_k``) at its own position, as the vLLM engine's dump does."""
    for i, (prompt, a, gen) in enumerate(zip(seqs, answers, generated, strict=True)):
        lp = first_choice(url, a).get("logprobs") or {}
        values, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
        if (
            not isinstance(values, list)
            or len(values) != len(gen)
            or not all(isinstance(v, (int, float)) for v in values)
        ):
            raise ServerError(f"{url}: the answer to prompt {i} has no logprob for each of its {len(gen)} tokens")
        top = None
        if top_k:
            if not isinstance(tops, list) or len(tops) != len(gen) or not all(isinstance(t, dict) for t in tops):
                raise ServerError(f"{url}: the answer to prompt {i} has no top logprobs for each generated token")
            ranked = [
                sorted(((_token_id(k, url, i), float(v)) for k, v in t.items()), key=lambda e: -e[1]) for t in tops
            ]
            top = [_top(tuple(r), g, top_k) for r, g in zip(ranked, gen, strict=True)]
            if any(len(t) != top_k for t in top):
                raise ServerError(f"prompt {i}: the server sent fewer than --top-k {top_k} generated-token logprobs")
        record_token_logprobs(
            cap,
            [len(prompt) + s for s in range(len(gen))],
            [i] * len(gen),
            gen,
            [float(v) for v in values],
            None if top is None else [[t for t, _ in r] for r in top],
            None if top is None else [[v for _, v in r] for r in top],
        )


def _send(
    client: ServerClient, bodies: list[dict[str, Any]], concurrency: int, progress: ProgressFn | None
) -> list[Any]:
    """Every answer, in the order of ``bodies``; up to ``concurrency`` requests in flight (vLLM batches them)."""
    answers: list[Any] = [None] * len(bodies)
    total, done = sum(len(b["prompt"]) for b in bodies), 0
    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(bodies)), thread_name_prefix="driftscope-collect")
    try:
        futures = {pool.submit(client.post, "/v1/completions", b): i for i, b in enumerate(bodies)}
        for future in as_completed(futures):
            i = futures[future]
            answers[i] = future.result()
            done += len(bodies[i]["prompt"])
            if progress is not None:
                progress(done, total)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return answers


def _prompt_logprobs(url: str, i: int, ids: list[int], answer: Any) -> SequenceLogprobs:
    """The prompt logprobs of answer ``i`` (vLLM's ``choices[0].prompt_logprobs``), checked against ``ids``."""
    choice = dict(first_choice(url, answer))
    if choice.get("prompt_logprobs") is None:
        raise ServerError(
            f"{url}: the answer to prompt {i} has no choices[0].prompt_logprobs: the server is not "
            "vLLM, or ignores prompt_logprobs"
        )
    choice.setdefault("prompt_token_ids", ids)
    choice.pop("logprobs", None)  # the generated token's: not a prompt position
    try:
        seq = parse_record({"choices": [choice]}, default_id=str(i))
    except UsageError as e:
        raise ServerError(f"{url}: prompt {i}: an answer that is not vLLM's prompt_logprobs: {e}") from None
    if list(seq.token_ids) != ids:
        raise ServerError(
            f"{url}: prompt {i}: the server scored {len(seq.token_ids)} tokens that differ from the "
            f"{len(ids)} sent (it added or dropped tokens)"
        )
    return seq


def _scored(url: str, seqs: list[list[int]], answers: list[Any], *, logprobs: bool) -> list[SequenceLogprobs]:
    """Each answer's prompt logprobs with ``logprobs``; else just a check that each answer is a completion."""
    if logprobs:
        return [_prompt_logprobs(url, i, s, a) for i, (s, a) in enumerate(zip(seqs, answers, strict=True))]
    for a in answers:
        first_choice(url, a)
    return []


def _top(entries: TopK, token: int, k: int) -> TopK:
    """The top ``k`` of one position: vLLM lists them and, when it is not among them, the position's own token."""
    if len(entries) > k:
        entries = tuple(e for e in entries if e[0] != token)
    return entries[:k]


def _record(cap: Capture, scored: Sequence[SequenceLogprobs], top_k: int) -> None:
    """Record each prompt's logprobs (positions 1..len-1) and top ``top_k``, as the vLLM engine's dump holds them."""
    for s, seq in enumerate(scored):
        keep = [j for j in range(1, len(seq)) if seq.logprobs[j] is not None]
        if not keep:
            continue
        top = [_top(seq.top[j] or (), seq.token_ids[j], top_k) for j in keep] if top_k and seq.top else None
        if top is not None and any(len(t) != top_k for t in top):
            raise ServerError(f"prompt {s}: the server sent fewer than --top-k {top_k} prompt logprobs")
        record_token_logprobs(
            cap,
            keep,
            [s] * len(keep),
            [seq.token_ids[j] for j in keep],
            [seq.logprobs[j] for j in keep],
            None if top is None else [[t for t, _ in r] for r in top],
            None if top is None else [[v for _, v in r] for r in top],
        )


def _coverage(parts: RankParts, seqs: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(prefix-cache hit, positions without rows) per prompt, read from rank 0's rows of its lowest tapped layer.

    A prompt's first computed row is its hit; rows copied from an earlier prompt of the same
    capture (``meta.shared_prefix``) fill a hit's positions, a hit on blocks computed outside it does not.
    """
    recs = [r for r in parts.records.get(0, ()) if r.point == ATTN_INPUT and r.layer is not None]
    if not recs:
        return [0] * len(seqs), [0] * len(seqs)
    lowest = min(r.layer for r in recs if r.layer is not None)
    first = [len(s) for s in seqs]
    seen: list[set[int]] = [set() for _ in seqs]
    for r in recs:
        pos, sid = r.row_positions(), r.row_sequence_ids()
        if r.layer != lowest or pos is None or sid is None:
            continue
        for p, s in zip(pos.tolist(), sid.tolist(), strict=True):
            if 0 <= s < len(seqs):
                seen[s].add(p)
                if not r.meta.get("shared_prefix"):
                    first[s] = min(first[s], p)
    return first, [len(s) - len(seen[i] & set(range(len(s)))) for i, s in enumerate(seqs)]


def _wait(directory: Path, spool: Path, cfg: CollectConfig) -> RankParts:
    try:
        return wait_parts(directory, timeout_s=cfg.part_timeout)
    except DumpError:
        if directory.exists():
            raise  # a rank said why it dropped the capture, or some ranks wrote theirs
        raise DumpError(
            f"--spool {spool}: no capture part of the {cfg.server} requests appeared within "
            f"{cfg.part_timeout:g} s (--part-timeout): the server runs without the driftscope tap or records "
            f"into another spool; start it as {VLLM_SPOOL_ENV}={spool} python -m dumper.engines.vllm.serve "
            f"CKPT --additional-config '{_TAP_CONFIG}' (or vllm serve, the same flags)"
        ) from None


def collect_dump(cfg: CollectConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Send ``cfg``'s prompts to the server marked for capture, and join what its ranks recorded into ``cfg.out``."""
    spool = _spool_dir(cfg.spool)
    if (Path(cfg.out) / MANIFEST_NAME).exists():
        raise DumpError(f"{cfg.out}: already holds a complete dump; choose another directory")
    checkpoint, identity = _checkpoint(cfg.model)
    vocab = int(identity.get("vocab_size") or 0) if identity is not None else 0
    seqs = served_sequences(cfg, checkpoint, vocab or None)
    client = ServerClient(cfg.server, timeout=cfg.request_timeout, retries=cfg.retries)
    version = _server_version(client)
    name = cfg.served_model or served_model(client)
    directory = spool / new_token()
    try:
        bodies = [
            _body(s, name, directory.name, i, len(seqs), cfg.logprobs, cfg.new_tokens) for i, s in enumerate(seqs)
        ]
        answers = _send(client, bodies, cfg.concurrency, progress)
        url = client.url("/v1/completions")
        scored = _scored(url, seqs, answers, logprobs=cfg.logprobs is not None)
        generated = _generated(url, seqs, answers, cfg.new_tokens) if cfg.new_tokens else []
        parts = _wait(directory, spool, cfg)
        return _join(cfg, client.base_url, version, name, seqs, parts, identity, scored, (url, answers, generated))
    finally:
        remove_spool(directory)


def _join(
    cfg: CollectConfig,
    url: str,
    version: str,
    name: str | None,
    seqs: list[list[int]],
    parts: RankParts,
    identity: dict[str, Any] | None,
    scored: list[SequenceLogprobs],
    decoded: tuple[str, list[Any], list[list[int]]],
) -> Manifest:
    """Write the dump: the parts, the answers' prompt (and generated) logprobs, and a manifest that says it came from
    ``url``; ``decoded`` is (completions URL, answers, generated ids) of a ``--new-tokens`` collect."""
    dtype = (parts.info.get("signature") or {}).get("dtype")
    engine = EngineInfo("vllm", version, str(cfg.model or name or url), {"dtype": dtype, **parts.engine_settings})
    hits, missing = _coverage(parts, seqs)
    spec = cfg.logprobs
    job: dict[str, Any] = {
        "job": "prefill",
        "input_ids": seqs,
        "dtype": dtype,
        "server": url,
        "served_model": name,
        "logprobs": None if spec is None else vars(spec),
        "prefix_cache_hits": hits,
        "missing_positions": missing,
    }
    if any(missing):
        job["note"] = missing_note(missing)
    if cfg.new_tokens:
        job.update({"job": "decode", NEW_TOKENS: cfg.new_tokens, GENERATED_IDS: decoded[2]})
    identity = identity or dict(parts.info.get("identity") or {})

    def record(cap: Capture) -> None:
        if spec is not None:
            _record(cap, scored, spec.top_k)
            if cfg.new_tokens:
                _record_generated(cap, decoded[0], seqs, decoded[1], decoded[2], spec.top_k)

    return join_dump(
        cfg.out, parts, model_name=cfg.model or name, identity=identity, engine=engine, job_extra=job, record=record
    )


def missing_note(missing: Sequence[int]) -> str:
    """What a dump lacks when the server read prompts' leading blocks from its prefix cache (one line)."""
    count = sum(1 for m in missing if m)
    return (
        f"{sum(missing)} leading positions of {count} prompt(s) have no hidden states: the server read them from "
        "its prefix cache, computed by requests outside this capture (collect with --logprobs, which vLLM "
        "computes in full, or serve with --no-enable-prefix-caching)"
    )
