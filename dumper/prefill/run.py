"""The main job: a teacher-forced prefill of each prompt through a model with capture on.

Example::

    from dumper.prefill.run import RunConfig, run_dump
    manifest = run_dump(RunConfig(out="dumps/a", model="tiny-llama", attn="sdpa"))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dumper.errors import UsageError
from dumper.format import Manifest, load_manifest
from dumper.format.decode import GENERATED_IDS, NEW_TOKENS, NEXT_IDS, PROMPT_LENGTHS, TOKENS_FROM
from dumper.format.points import CACHE_POINTS, SUBLAYER_POINTS
from dumper.format.sketch import SketchSpec
from dumper.format.speculative import SPECULATIVE_KEY, derive_steps, hidden_rows, speculative_extra
from dumper.hooks.capture import Capture
from dumper.hooks.layers import ATTN_INPUT, ROUTER, parse_points
from dumper.hooks.tap import install_tap, remove_tap, tap_of
from dumper.prefill.decode import LastLogits, greedy_steps
from dumper.prefill.forward import pad_batch, prefill
from dumper.prefill.logprob_records import LogprobSpec, record_logprobs, record_next_logprobs
from dumper.prefill.observer import LogprobSink, ObserverCheck, mark_observer
from dumper.prefill.presets import load_model
from dumper.prefill.prompt_lookup import hf_speculative_config, prompt_lookup_decode
from dumper.prefill.speculative import SpeculativeSpec
from dumper.progress import ProgressFn
from dumper.prompts import BUILTIN_PROMPTS, parse_input_ids, read_prompts_file  # noqa: F401 - re-exported

__all__ = [
    "RunConfig",
    "run_dump",
    "dump_sequences",
    "reference_sequences",
    "prompt_token_ids",
    "check_scored_positions",
    "tokens_from",
]

OBSERVER_ENGINES = ("transformers", "vllm")
"""Engines whose capture runs in this process, so that ``--observer-check`` can tell what it changes."""
ENGINE_POINTS = {
    "vllm": (ATTN_INPUT, *CACHE_POINTS, *SUBLAYER_POINTS, ROUTER),
    "llama.cpp": (ATTN_INPUT, *SUBLAYER_POINTS, ROUTER),
}
"""The capture points an engine other than transformers (which records every point) records; absent: input only."""

DECODE_ENGINES = ("transformers", "vllm", "llama.cpp")
"""Engines whose decode steps ``--new-tokens`` records."""
SPECULATIVE_ENGINES = ("transformers", "vllm")
"""Engines whose verify passes ``--speculative`` records."""

MAX_SEED = (1 << 63) - 1
"""Largest ``--seed``: :func:`torch.manual_seed` takes 64 bits, and the manifest keeps integers within int64."""


@dataclass(frozen=True)
class RunConfig:
    """What ``python -m dumper run`` does; defaults give the no-network tiny-preset job."""

    out: str
    model: str = "tiny-llama"
    prompts: tuple[str, ...] = ()
    input_ids: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    attn: str = "eager"
    layers: str | None = None
    modules: str | None = None
    points: tuple[str, ...] = (ATTN_INPUT,)
    """Capture points (:data:`dumper.hooks.layers.POINTS`): ``input`` (default), ``residual``, or both."""
    device: str = "cpu"
    seed: int = 0
    chunk_size: int | None = None
    batch_size: int = 1
    padding_side: str = "right"
    logprobs: LogprobSpec | None = None
    extra: dict = field(default_factory=dict)
    engine: str = "transformers"
    engine_args: tuple[tuple[str, str], ...] = ()
    """Engine-specific settings (``--engine-arg KEY=VALUE``); each adapter in :mod:`dumper.engines` names its keys."""
    compile: bool = False
    """``--compile``: run the HF model under ``torch.compile``, captured through the tap (:mod:`dumper.hooks.tap`)."""
    observer_check: bool = False
    """``--observer-check``: run the job again without capture and compare its logprobs bit for bit."""
    warm_prefix_cache: bool = False
    """Run the prompts once unrecorded before the recorded run, so that it reads the prefix cache (vLLM)."""
    sketch: SketchSpec | None = None
    """``--sketch K``: hidden-state rows stored as projections (:mod:`dumper.format.sketch`)."""
    new_tokens: int = 0
    """``--new-tokens N``: greedy-decode N tokens per prompt after its prompt pass, recording every decode step
    (:mod:`dumper.prefill.decode`)."""
    next_ids: tuple[int, ...] = ()
    """Per prompt, a token after it whose logprob ``--logprobs`` records too (``--tokens-from``: the decode dump's
    last generated token, chosen but never fed)."""
    speculative: SpeculativeSpec | None = None
    """``--speculative SPEC``: decode with the engine's speculative decoding, recording every verify pass
    (:mod:`dumper.format.speculative`)."""

    def engine_arg(self, key: str, default: str | None = None) -> str | None:
        """The ``--engine-arg`` value of ``key`` (the last one given), else ``default``."""
        return next((v for k, v in reversed(self.engine_args) if k == key), default)

    def _check_speculative(self) -> None:
        """``--speculative`` needs a decode of 2 tokens or more on an engine that records its verify passes (with
        transformers: one prompt at a time, eager, no cache points); ``points`` are parsed."""
        setting = self.speculative.setting if self.speculative else ""
        if self.engine == "llama.cpp":
            raise UsageError(
                f"--speculative {setting}: not recorded for llama.cpp yet: llama-cpp-python runs its prompt-lookup "
                "drafts inside Llama.generate, and driftscope's llama.cpp path drives llama_decode itself; "
                "use --engine vllm or transformers"
            )
        if self.engine not in SPECULATIVE_ENGINES:
            raise UsageError(f"--speculative: engine {self.engine} has no speculative decoding here; use --engine vllm")
        if self.new_tokens < 2:
            raise UsageError(f"--speculative {setting}: add --new-tokens N (N >= 2): verify passes are decode steps")
        if self.engine == "transformers" and (self.batch_size != 1 or self.chunk_size is not None or self.compile):
            raise UsageError(
                f"--speculative {setting}: transformers' prompt lookup decodes one prompt at a time, eager, "
                "its prompt in one pass; drop --batch-size, --chunk-size and --compile"
            )
        if self.engine == "transformers" and self.speculative is not None and self.speculative.lookup_min != 1:
            raise UsageError(
                f"--speculative {setting}: transformers' prompt lookup matches n-grams down to one token and takes "
                "no min=; drop it (min= is vLLM's prompt_lookup_min)"
            )
        if self.engine == "transformers" and set(self.points) & set(CACHE_POINTS):
            raise UsageError(
                f"--speculative {setting}: --points k_cache/v_cache are not recorded with "
                "transformers' prompt lookup yet (it crops its cache after each verify pass, which the read-back "
                "check does not follow)"
            )

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < 1:
            raise UsageError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.new_tokens < 0:
            raise UsageError(f"--new-tokens must be >= 0, got {self.new_tokens}")
        if self.new_tokens and self.engine not in DECODE_ENGINES:
            raise UsageError(
                f"--new-tokens: engine {self.engine} records prompt passes only so far; the decode "
                f"path is recorded with --engine {' or '.join(DECODE_ENGINES)} (docs/decode.md)"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be in 0..{MAX_SEED} (a torch.manual_seed int64), got {self.seed}")
        if self.padding_side not in ("left", "right"):
            raise UsageError(f"--padding-side must be left or right, got {self.padding_side!r}")
        object.__setattr__(self, "points", parse_points(self.points))
        if self.speculative is not None:
            self._check_speculative()
        allowed = ENGINE_POINTS.get(self.engine, (ATTN_INPUT,))
        if self.engine == "llama.cpp" and set(self.points) & set(CACHE_POINTS):
            raise UsageError(
                f"--points {','.join(self.points)}: llama.cpp's KV cache is not reachable through llama-cpp-python "
                "(it exposes neither the KV tensors nor a documented layout of its state); the cache points need "
                "--engine vllm or transformers"
            )
        if self.engine != "transformers" and not set(self.points) <= set(allowed):
            raise UsageError(
                f"--points {','.join(self.points)}: engine {self.engine} records the "
                f"{' and '.join(map(repr, allowed))} point{'s' if len(allowed) > 1 else ''} only; "
                "the others need --engine transformers"
            )
        if self.compile and self.engine != "transformers":
            raise UsageError(
                f"--compile: --engine {self.engine} runs its own default mode (vLLM: compiled; "
                "--engine-arg enforce_eager=true for eager); --compile is for --engine transformers"
            )
        if self.observer_check and self.logprobs is None:
            raise UsageError("--observer-check compares the logprobs of a run with and without capture; add --logprobs")
        if self.observer_check and self.engine not in OBSERVER_ENGINES:
            raise UsageError(
                f"--observer-check: engine {self.engine} runs outside this process, where capture adds "
                f"nothing to check; it is for --engine {' or '.join(OBSERVER_ENGINES)}"
            )


def prompt_token_ids(cfg: RunConfig, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """``cfg``'s prompts as token ids: texts (default: the built-in ones) by ``tokenizer``, then ``--input-ids``.

    Every id must lie in ``[0, vocab_size)``; a text prompt needs a tokenizer (``None``: pass ids).
    """
    seqs: list[list[int]] = [list(s) for s in cfg.input_ids]
    texts = list(cfg.prompts)
    if not seqs and not texts:
        texts = list(BUILTIN_PROMPTS)
    if texts:
        if tokenizer is None:
            raise UsageError(f"{cfg.model}: the model directory has no tokenizer; pass --input-ids instead of text")
        seqs = [tokenizer.encode(t) for t in texts] + seqs
    for i, s in enumerate(seqs):
        if not s:
            raise UsageError(f"prompt {i} is empty")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return seqs


def _record_pass_logprobs(
    cap: LogprobSink,
    ids: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: Sequence[int],
    spec: LogprobSpec,
    logits: torch.Tensor,
    start: int,
    positions: torch.Tensor,
) -> None:
    record_logprobs(cap, logits, ids, mask, positions, start, seq_ids, spec)


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Load the model and prefill every prompt under capture; return the manifest.

    Prompts go ``batch_size`` at a time (padded on ``padding_side``), each batch in one forward
    pass or in chunks of ``chunk_size`` tokens through the KV cache. Sequence ids are the
    prompts' indices, so dumps of different layouts align by (sequence, position).
    ``progress(done_tokens, total_tokens)`` is called after each batch.
    """
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn, device=cfg.device, seed=cfg.seed)
    vocab = int(model.get_input_embeddings().num_embeddings)
    return dump_sequences(model, prompt_token_ids(cfg, tokenizer, vocab), cfg, progress=progress)


def check_scored_positions(cfg: RunConfig, seqs: Sequence[Sequence[int]]) -> None:
    """With ``--logprobs``, refuse prompts of which none has a position past ``--logprob-start-len`` to score."""
    if cfg.logprobs is not None and all(len(s) - 1 <= cfg.logprobs.start_len for s in seqs):
        raise UsageError(
            f"--logprobs: no prompt has a position to score (the longest has {max(map(len, seqs))} "
            f"tokens; --logprob-start-len {cfg.logprobs.start_len} leaves none, scored positions are "
            "start_len+1 .. len-1)"
        )


def compiled_model(model: torch.nn.Module, cfg: RunConfig, seqs: Sequence[Sequence[int]]) -> torch.nn.Module:
    """``torch.compile(model)`` with the tap installed first, sized for the job's largest forward pass."""
    rows = min(cfg.batch_size, len(seqs)) * (cfg.chunk_size or max(map(len, seqs)))
    if tap_of(model) is None:
        install_tap(model, layers=cfg.layers, modules=cfg.modules, points=cfg.points, max_tokens=rows)
    return torch.compile(model)


def dump_sequences(
    model: torch.nn.Module, seqs: list[list[int]], cfg: RunConfig, *, progress: ProgressFn | None = None
) -> Manifest:
    """:func:`run_dump` with a model already in hand (say, one with a bug injected) and token ids.

    ``cfg`` gives the output, layout, layers and logprob settings; ``cfg.model`` only names the
    model in the manifest. With ``cfg.observer_check`` the job runs again without capture
    (:func:`reference_sequences`) and the manifest returned carries ``extra["observer"]``
    (:mod:`dumper.prefill.observer`).
    """
    check_scored_positions(cfg, seqs)
    if cfg.next_ids and len(cfg.next_ids) != len(seqs):
        raise UsageError(f"next_ids: {len(cfg.next_ids)} tokens for {len(seqs)} prompts")
    extra = {
        "job": "decode" if cfg.new_tokens else "prefill",
        "input_ids": seqs,
        "dtype": cfg.dtype,
        "attn": cfg.attn,
        "seed": cfg.seed,
        "compiled": cfg.compile,
        "chunk_size": cfg.chunk_size,
        "batch_size": cfg.batch_size,
        "padding_side": cfg.padding_side,
        "logprobs": None if cfg.logprobs is None else vars(cfg.logprobs),
        **cfg.extra,
    }
    run_model = compiled_model(model, cfg, seqs) if cfg.compile else model
    with (
        torch.inference_mode(),
        Capture(
            run_model,
            cfg.out,
            layers=cfg.layers,
            modules=cfg.modules,
            points=cfg.points,
            model_name=cfg.model,
            extra=extra,
            sketch=cfg.sketch,
        ) as cap,
    ):
        generated = _prefill_job(model, run_model, seqs, cfg, cap, progress)
        if cfg.new_tokens:
            cap.extra.update({NEW_TOKENS: cfg.new_tokens, GENERATED_IDS: generated})
        if cfg.speculative is not None:  # the verify passes, from the rows each recorded
            steps = derive_steps(hidden_rows(cap.records), [len(s) for s in seqs])
            cap.extra[SPECULATIVE_KEY] = speculative_extra(
                cfg.speculative.setting, hf_speculative_config(cfg.speculative), steps
            )
        if cfg.next_ids:
            cap.extra[NEXT_IDS] = [[t] for t in cfg.next_ids]
    if not cfg.observer_check or cfg.logprobs is None:
        return load_manifest(cfg.out)
    check = ObserverCheck(cfg.out, logits=cfg.logprobs.save_logits)
    reference_sequences(model, seqs, cfg, check)
    return mark_observer(cfg.out, check.result())


def reference_sequences(model: torch.nn.Module, seqs: list[list[int]], cfg: RunConfig, sink: LogprobSink) -> None:
    """``cfg``'s job once more with nothing of driftscope on the model, its logprobs recorded into ``sink``.

    No capture is active and no hook is added. With ``cfg.compile`` the tap comes off the model
    (it stays off) and the model is compiled afresh without it, after
    :func:`torch.compiler.reset`: Dynamo does not guard on hooks, so a cached graph would
    still call the tap. The reset drops every compiled graph of this process.
    """
    run_model = model
    if cfg.compile:
        remove_tap(model)
        torch.compiler.reset()
        run_model = torch.compile(model)
    with torch.inference_mode():
        _prefill_job(model, run_model, seqs, cfg, sink, None)


def _prefill_job(
    model: torch.nn.Module,
    run_model: torch.nn.Module,
    seqs: list[list[int]],
    cfg: RunConfig,
    sink: LogprobSink,
    progress: ProgressFn | None,
) -> list[list[int]]:
    """Prefill ``seqs`` through ``run_model`` in ``cfg``'s batches and chunks, logprobs into ``sink``, then
    decode ``cfg.new_tokens`` per sequence (:mod:`dumper.prefill.decode`); returns the tokens generated.

    ``sink`` is the capture (or the observer check): it is told each batch's sequence ids.
    """
    device = next(model.parameters()).device
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    done, total = 0, sum(map(len, seqs)) + len(seqs) * max(cfg.new_tokens - 1, 0)
    generated: list[list[int]] = []
    if cfg.speculative is not None:  # transformers' prompt lookup: one prompt at a time, through its generate
        for i, prompt in enumerate(seqs):
            generated.append(
                prompt_lookup_decode(model, sink, prompt, i, cfg.new_tokens, cfg.speculative, cfg.logprobs, pad_id)
            )
            done += len(prompt) + cfg.new_tokens - 1
            if progress is not None:
                progress(done, total)
        return generated
    for first in range(0, len(seqs), cfg.batch_size):
        batch = seqs[first : first + cfg.batch_size]
        seq_ids = list(range(first, first + len(batch)))
        sink.set_sequence_ids(seq_ids)
        ids, mask = pad_batch(batch, side=cfg.padding_side, pad_id=pad_id)
        ids, mask = ids.to(device), mask.to(device)
        on_logits = (
            None
            if cfg.logprobs is None
            else functools.partial(_record_pass_logprobs, sink, ids, mask, seq_ids, cfg.logprobs)
        )
        last = LastLogits(mask) if cfg.new_tokens or cfg.next_ids else None
        cache = prefill(
            run_model,
            ids,
            mask,
            chunk_size=cfg.chunk_size,
            keep_cache=bool(cfg.new_tokens) or bool(set(cfg.points) & set(CACHE_POINTS)),  # the cache points read it
            on_logits=_both(on_logits, last),
        )
        if last is not None and cfg.next_ids and cfg.logprobs is not None:
            assert last.logits is not None and last.positions is not None
            nxt = torch.as_tensor(cfg.next_ids[first : first + len(batch)], device=device)
            record_next_logprobs(sink, last.logits, nxt, last.positions + 1, seq_ids, cfg.logprobs)
        if last is not None and cfg.new_tokens:
            generated += greedy_steps(run_model, sink, cache, last, mask, seq_ids, cfg.new_tokens, cfg.logprobs)
        done += sum(map(len, batch)) + len(batch) * max(cfg.new_tokens - 1, 0)
        if progress is not None:
            progress(done, total)
    return generated


def _both(
    *fns: Callable[[torch.Tensor, int, torch.Tensor], None] | None,
) -> Callable[[torch.Tensor, int, torch.Tensor], None] | None:
    """One ``on_logits`` callback calling each of ``fns`` that is not None (None: none is)."""
    live = [f for f in fns if f is not None]
    if not live:
        return None

    def call(logits: torch.Tensor, start: int, positions: torch.Tensor) -> None:
        for f in live:
            f(logits, start, positions)

    return call


def tokens_from(cfg: RunConfig, dump: str) -> RunConfig:
    """``cfg`` as the counterpart of the decode dump ``dump``: each prompt plus the tokens its decode fed back
    as the input (its sequences keep their ids), the last generated token as the one scored after it."""
    if cfg.prompts or cfg.input_ids:
        raise UsageError("--tokens-from takes its prompts from the dump; drop --prompt, --prompts and --input-ids")
    if cfg.new_tokens:
        raise UsageError("--tokens-from runs the prefill counterpart of a decode dump; drop --new-tokens")
    manifest = load_manifest(dump)
    generated = manifest.extra.get(GENERATED_IDS)
    prompts = manifest.extra.get("input_ids")
    if not generated or not prompts or not any(generated):
        raise UsageError(
            f"{dump}: not a decode dump (its manifest lists no generated tokens: "
            "python -m dumper run --new-tokens N writes one)"
        )
    inputs = tuple(tuple(p) + tuple(g[:-1]) for p, g in zip(prompts, generated, strict=True))
    extra = {**cfg.extra, TOKENS_FROM: str(dump), PROMPT_LENGTHS: [len(p) for p in prompts]}
    return replace(cfg, input_ids=inputs, next_ids=tuple(g[-1] for g in generated), extra=extra)
