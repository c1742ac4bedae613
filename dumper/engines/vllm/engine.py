"""vLLM as users run it: ``python -m dumper run --engine vllm --model HF_DIR ...``.

vLLM's default engine: multiprocess (the model in the engine core process, or one worker per
tensor-parallel rank) and compiled. Every prompt of the job goes into one ``LLM.generate`` call
(vLLM batches them itself), fed as token ids (``TokensPrompt``), with ``max_tokens=1``: a
prefill of each prompt, each request marked for driftscope's capture. The capture runs where
the model runs (:mod:`dumper.engines.vllm.spool`, installed by vLLM's own plugin loader), each
rank writes its part, and this process joins them into one dump (:mod:`dumper.engines.vllm.parts`):
``model.layers.{i}.self_attn.input`` rows at absolute positions, sequence ids in prompt order,
on every rank, as the HF dump of the same checkpoint holds them. ``--logprobs`` asks vLLM for
``prompt_logprobs`` (top ``--top-k``);
``--save-logits`` runs vLLM with ``logprobs_mode="raw_logits"`` and every vocabulary entry.
``--chunk-size N`` is vLLM's chunked prefill with a budget of ``N`` tokens per engine step.
``--new-tokens N`` generates N greedy tokens per prompt (``max_tokens=N``, ``ignore_eos``); the
decode steps that feed all but the last are recorded, and with ``--logprobs`` each generated
token's logprob and top-k as vLLM sampled it (:mod:`dumper.format.decode`).
``--observer-check`` runs the job again on a second engine, built without the tap, and compares
its logprobs bit for bit (:func:`observe_llm`).

Example::

    python -m dumper run --model ckpt --layers all --logprobs --out dumps/hf
    python -m dumper run --engine vllm --model ckpt --layers all --logprobs --out dumps/vllm
    python -m comparator dumps/hf dumps/vllm
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dumper.engines.base import (
    EngineArg,
    EngineInfo,
    check_checkpoint_dir,
    check_engine_args,
    hf_identity,
    job_sequences,
)
from dumper.engines.held_output import Relay, held_stderr
from dumper.engines.vllm.parts import join_dump, new_token, remove_spool, spool_root, wait_parts
from dumper.engines.vllm.serve import CPU_DEFAULTS
from dumper.engines.vllm.spool import marker, token_dir
from dumper.engines.vllm.tap import register, take_load_failure, tap_config
from dumper.errors import (
    DriftscopeError,
    InternalError,
    ModelError,
    UsageError,
    error_reason,
)
from dumper.format import Manifest, load_manifest
from dumper.format.decode import GENERATED_IDS, NEW_TOKENS
from dumper.format.speculative import SPECULATIVE_KEY, Step, derive_steps, hidden_rows, speculative_extra
from dumper.hooks.capture import Capture
from dumper.hooks.layers import ATTN_INPUT, DEFAULT_LAYERS
from dumper.modeldir import check_model_dir
from dumper.prefill.logprob_records import record_logprobs, record_token_logprobs
from dumper.prefill.observer import LogprobSink, ObserverCheck, ObserverResult, mark_observer
from dumper.prefill.run import RunConfig
from dumper.progress import ProgressFn

__all__ = [
    "run_dump",
    "dump_llm",
    "observe_llm",
    "reference_llm",
    "load_llm",
    "release_llm",
    "engine_kwargs",
    "env_defaults",
    "ENGINE_ARGS",
]

ENGINE_ARGS = {
    "enable_prefix_caching": EngineArg("reuse KV blocks of shared prompt prefixes; default vLLM's, true", "bool"),
    "kv_cache_dtype": EngineArg(
        "the KV-cache dtype; default auto, the model dtype",
        "choice",
        ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    ),
    "max_num_seqs": EngineArg("requests per engine step; default vLLM's, at most --chunk-size", "int", high=1 << 16),
    "max_model_len": EngineArg(
        "the context vLLM reserves; default max(512, longest prompt + --new-tokens, at least + 1)", "int"
    ),
    "enforce_eager": EngineArg("run the model eager (no torch.compile, no CUDA graphs); default vLLM's, false", "bool"),
    "tensor_parallel_size": EngineArg("tensor-parallel ranks (one worker process each); default 1", "int", high=64),
    "pipeline_parallel_size": EngineArg("pipeline stages (one worker process each); default 1", "int", high=64),
    "distributed_executor_backend": EngineArg(
        "how vLLM runs its ranks: mp (worker processes, the default) or ray "
        "(Ray actors, placed on the nodes of a Ray cluster)",
        "choice",
        ("mp", "ray"),
    ),
}
"""``--engine-arg`` keys ``--engine vllm`` takes, and their values."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""A checkpoint with none of these has no tokenizer: vLLM is told not to load one (ids go in anyway)."""


class KeptEngine:
    """The one vLLM engine a process keeps between jobs with the same settings (a GPU fits one), and the relay of
    each started engine's stderr (:mod:`dumper.engines.held_output`)."""

    def __init__(self) -> None:
        self.llm: Any = None
        """The kept ``vllm.LLM`` (None: none)."""
        self._key: str | None = None
        self._stderr: weakref.WeakKeyDictionary[Any, Relay] = weakref.WeakKeyDictionary()

    def load(self, kwargs: dict[str, Any], *, device: str = "cpu") -> Any:
        """A ``vllm.LLM(**kwargs)``: the kept one when its settings are the same, else a new one, kept."""
        key = json.dumps(kwargs, sort_keys=True)
        if self.llm is not None and self._key == key:
            return self.llm
        self.forget()
        env_defaults(device)
        with held_stderr() as relay:  # vLLM's import notes and a failed start's tracebacks give way to our line
            llm = _start(kwargs)
        self._stderr[llm] = relay
        self.llm, self._key = llm, key
        return llm

    def stderr(self, llm: Any) -> Relay | None:
        """The relay of ``llm``'s stderr, if this process started it."""
        return self._stderr.get(llm)

    def forget(self, llm: Any = None) -> None:
        """Keep no engine (only if it is ``llm``, when given); the next :meth:`load` starts one."""
        if llm is None or llm is self.llm:
            self.llm, self._key = None, None


ENGINE = KeptEngine()
"""This process's kept engine (:func:`load_llm`, :func:`release_llm`)."""


def env_defaults(device: str) -> None:
    """vLLM's quiet log; on a CPU, vLLM's CPU settings (each only where unset). The engine stays multiprocess."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if device == "cpu":
        for key, value in CPU_DEFAULTS.items():
            os.environ.setdefault(key, value)


def engine_kwargs(cfg: RunConfig, checkpoint: Path, seqs: list[list[int]], *, tap: bool = True) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` that runs ``cfg``'s job: vLLM's default (compiled) mode, token ids in.

    The capture is the tap (:mod:`dumper.engines.vllm.tap`), asked for in ``additional_config``
    so that vLLM's loader installs it before vLLM compiles the model; ``tap=False`` gives the
    same engine without it (the observer check's reference). The checkpoint's code never runs
    (``trust_remote_code=False``; :func:`check_model_dir` refuses it first).
    """
    opts = check_engine_args(cfg, ENGINE_ARGS)
    if cfg.batch_size != 1:
        raise UsageError(
            "--batch-size: --engine vllm batches every prompt itself; "
            "--engine-arg max_num_seqs=N bounds the requests of one engine step"
        )
    if cfg.attn != "eager":
        raise UsageError(
            f"--attn {cfg.attn}: HF's attention setting; vLLM picks its own attention backend "
            "(recorded in the manifest as engine_attention_backend)"
        )
    config = check_model_dir(checkpoint) or {}
    context = max(map(len, seqs)) + max(cfg.new_tokens, 1)  # the longest prompt and the tokens it generates
    positions = config.get("max_position_embeddings")
    kw: dict[str, Any] = {
        "model": str(checkpoint),
        "dtype": cfg.dtype,
        "enforce_eager": bool(opts.get("enforce_eager", False)),
        "trust_remote_code": False,
        "skip_tokenizer_init": not any((checkpoint / f).is_file() for f in _TOKENIZER_FILES),
        "seed": cfg.seed,
        "max_model_len": opts.get("max_model_len")
        or min(max(512, context), positions if type(positions) is int and positions > 0 else context),
    }
    kw.update(
        (k, opts[k])
        for k in (
            "enable_prefix_caching",
            "kv_cache_dtype",
            "max_num_seqs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "distributed_executor_backend",
        )
        if k in opts
    )
    if cfg.speculative is not None:  # and vLLM's own per-step acceptance of each request (no numeric effect)
        kw.update(speculative_config=cfg.speculative.vllm_config(), per_request_spec_decode_metrics="detailed")
    if tap:
        points = None if tuple(cfg.points) == (ATTN_INPUT,) else ",".join(cfg.points)  # the default: as before
        kw["additional_config"] = tap_config(
            cfg.layers if cfg.layers is not None else DEFAULT_LAYERS, points, sketch=cfg.sketch
        )
    if cfg.chunk_size is not None:
        if kw.get("max_num_seqs", 0) > cfg.chunk_size:
            raise UsageError(
                f"--engine-arg max_num_seqs={kw['max_num_seqs']} is more than --chunk-size "
                f"{cfg.chunk_size}; vLLM needs a step budget of at least one token per request"
            )
        kw.update(
            enable_chunked_prefill=True,
            max_num_batched_tokens=cfg.chunk_size,
            max_num_seqs=kw.get("max_num_seqs", min(cfg.chunk_size, 256)),
        )
    spec = cfg.logprobs
    if spec is not None and spec.save_logits and cfg.new_tokens:
        raise UsageError(
            "--save-logits with --new-tokens: vLLM's logits rows of generated tokens are not recorded "
            "yet; drop --save-logits (the logprobs and --top-k are)"
        )
    if spec is not None and spec.save_logits:
        kw.update(logprobs_mode="raw_logits", max_logprobs=-1)
    elif spec is not None and spec.top_k > 20:
        kw["max_logprobs"] = spec.top_k
    return kw


RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
"""vLLM's own list of env var prefixes its Ray executor copies into its actors (comma-separated)."""


def carry_env_to_ray() -> None:
    """Ray actors inherit the environment of the ``ray start`` that made their node, not this process's: have
    vLLM's Ray executor copy every ``DRIFTSCOPE_*`` variable (the spool directory, first) into its actors."""
    prefixes = [p for p in os.environ.get(RAY_PREFIXES_ENV, "").split(",") if p.strip()]
    if "DRIFTSCOPE_" not in prefixes:
        os.environ[RAY_PREFIXES_ENV] = ",".join([*prefixes, "DRIFTSCOPE_"])


def load_llm(kwargs: dict[str, Any], *, device: str = "cpu") -> Any:
    """A ``vllm.LLM(**kwargs)``; the previous one when its settings are the same (:data:`ENGINE` keeps one)."""
    return ENGINE.load(kwargs, device=device)


def _start(kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM(**kwargs)`` with the tap's hook registered; what the tap refused inside vLLM's processes raised."""
    from vllm import LLM

    register()  # the tap's loader hook, for this process (vLLM's plugin loader does it for spawned ones)
    root = spool_root()  # exported before the engine's processes start, so that they inherit it
    if kwargs.get("distributed_executor_backend") == "ray":
        carry_env_to_ray()
    take_load_failure(root)  # what an earlier engine's processes left
    try:
        return LLM(**kwargs)
    except (DriftscopeError, InternalError):
        raise
    except Exception as e:  # noqa: BLE001 - the engine's load boundary: a checkpoint or setting it refuses
        relayed = take_load_failure(root)  # the tap refused the model in one of vLLM's processes
        if relayed is not None:
            raise relayed from None
        raise ModelError(f"{kwargs['model']}: vLLM cannot load it ({error_reason(e)})") from None


def _engine_info(checkpoint: Path, dtype: str, settings: dict[str, Any]) -> EngineInfo:
    """The engine as its worker described it (:func:`~dumper.engines.vllm.spool.engine_settings`)."""
    import vllm

    return EngineInfo("vllm", vllm.__version__, str(checkpoint), {"dtype": dtype, **settings})


def _record_prompt_logprobs(
    cap: LogprobSink, seq_id: int, ids: list[int], entries: list[Any], cfg: RunConfig, vocab: int
) -> None:
    """Record vLLM's ``prompt_logprobs`` of one prompt: entry ``j`` (``j >= 1``) scores token ``ids[j]``."""
    spec = cfg.logprobs
    assert spec is not None
    keep = [j for j in range(1, len(ids)) if j > spec.start_len and entries[j] is not None]
    if not keep:
        return
    if spec.save_logits:  # raw_logits mode: each entry holds every vocabulary id's logit
        if any(len(entries[j]) != vocab for j in range(1, len(ids))):
            raise InternalError(f"vLLM returned prompt logits of another width than the vocabulary ({vocab})")
        rows = torch.tensor([[e.logprob for _, e in sorted(entries[j].items())] for j in range(1, len(ids))])
        ids_t = torch.tensor([ids])
        record_logprobs(cap, rows[None], ids_t, torch.ones_like(ids_t), torch.arange(len(ids))[None], 0, [seq_id], spec)
        return
    top = [sorted(entries[j].items(), key=lambda kv: kv[1].rank)[: spec.top_k] for j in keep] if spec.top_k else None
    record_token_logprobs(
        cap,
        keep,
        [seq_id] * len(keep),
        [ids[j] for j in keep],
        [entries[j][ids[j]].logprob for j in keep],
        None if top is None else [[t for t, _ in row] for row in top],
        None if top is None else [[e.logprob for _, e in row] for row in top],
    )


def _record_decode_logprobs(cap: LogprobSink, seq_id: int, prompt: list[int], out: Any, cfg: RunConfig) -> None:
    """Record the logprob (and top-k) vLLM sampled each generated token with, at the token's own position."""
    spec = cfg.logprobs
    assert spec is not None
    tokens, entries = list(out.token_ids), list(out.logprobs or [])
    keep = [s for s in range(len(tokens)) if len(prompt) + s > spec.start_len]
    if len(entries) != len(tokens):
        raise InternalError(f"vLLM returned {len(entries)} logprobs for {len(tokens)} generated tokens")
    if not keep:
        return
    top = [sorted(entries[s].items(), key=lambda kv: kv[1].rank)[: spec.top_k] for s in keep] if spec.top_k else None
    record_token_logprobs(
        cap,
        [len(prompt) + s for s in keep],
        [seq_id] * len(keep),
        [tokens[s] for s in keep],
        [entries[s][tokens[s]].logprob for s in keep],
        None if top is None else [[t for t, _ in row] for row in top],
        None if top is None else [[e.logprob for _, e in row] for row in top],
    )


def _record_logprobs(cap: LogprobSink, cfg: RunConfig, seqs: list[list[int]], outs: list[Any], vocab: int) -> None:
    """Each prompt's logprobs, then (``--new-tokens``) each generated token's."""
    for i, o in enumerate(outs):
        _record_prompt_logprobs(cap, i, seqs[i], o.prompt_logprobs or [], cfg, vocab)
        if cfg.new_tokens:
            _record_decode_logprobs(cap, i, seqs[i], o.outputs[0], cfg)


def _generate(
    llm: Any, cfg: RunConfig, seqs: list[list[int]], *, token: str | None = None, logprobs: bool = True
) -> list[Any]:
    """One ``llm.generate`` of every prompt as token ids: a greedy one-token prefill with ``cfg``'s prompt logprobs,
    or with ``cfg.new_tokens`` a greedy decode of that many tokens (no stop at EOS) with their logprobs.

    With ``token``, request ``i`` is marked as sequence ``i`` of that capture (:func:`marker`).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = cfg.logprobs if logprobs else None
    prompt_logprobs = None if spec is None else -1 if spec.save_logits else spec.top_k
    new = max(cfg.new_tokens, 1)
    params = [
        SamplingParams(
            max_tokens=new,
            temperature=0.0,
            detokenize=False,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=True,
            logprobs=spec.top_k if spec is not None and cfg.new_tokens else None,
            extra_args=None if token is None else marker(token, i, len(seqs), new),
        )
        for i in range(len(seqs))
    ]
    # the engine's stderr while it runs: written out after, dropped with a failure's one line (held_output)
    with held_stderr(ENGINE.stderr(llm)):
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        except (DriftscopeError, InternalError):
            raise
        except Exception as e:  # noqa: BLE001 - the engine's boundary: a prompt or setting it refuses mid-run
            _stop(llm)  # it may be dead (a killed engine process): the next job starts a new one
            raise ModelError(f"{cfg.model}: vLLM's generate failed ({error_reason(e)})") from None
    for i, o in enumerate(outs):
        if list(o.prompt_token_ids or ()) != seqs[i]:
            raise InternalError(f"vLLM returned the prompts in another order than given (output {i})")
    return outs


def _stop(llm: Any) -> None:
    """Shut ``llm``'s engine down now, inside the failed run's hold: its surviving processes fail and stop there
    (the engine core's traceback when a worker was killed), not after driftscope's error line, as they would at
    exit when vLLM's finalizers stop them. The engine is forgotten; a next job starts a new one."""
    ENGINE.forget(llm)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)  # vLLM's client of its engine core
    if core is not None:
        with contextlib.suppress(Exception):  # best effort: the job fails either way, with its own message
            core.shutdown()


def dump_llm(
    llm: Any,
    cfg: RunConfig,
    seqs: list[list[int]],
    checkpoint: Path,
    *,
    identity: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> Manifest:
    """Prefill ``seqs`` in one ``llm.generate`` call, marked for capture, and join the ranks' parts into ``cfg.out``.

    The prefix cache is emptied first, so that hits come from this job's own prompts (with
    ``cfg.warm_prefix_cache``, from one unrecorded run of them just before). ``identity``
    defaults to :func:`~dumper.engines.base.hf_identity` of ``checkpoint``.
    """
    llm.reset_prefix_cache()
    if cfg.warm_prefix_cache:
        _generate(llm, cfg, seqs, logprobs=False)
    token = new_token()
    directory = token_dir(spool_root(), token)
    try:
        outs = _generate(llm, cfg, seqs, token=token)
        parts = wait_parts(directory)
        manifest = _join(cfg, seqs, checkpoint, parts, outs, identity)
    finally:
        remove_spool(directory)
    if progress is not None:
        total = sum(map(len, seqs))
        progress(total, total)
    return manifest


def _join(
    cfg: RunConfig,
    seqs: list[list[int]],
    checkpoint: Path,
    parts: Any,
    outs: list[Any],
    identity: dict[str, Any] | None,
) -> Manifest:
    """Write ``cfg.out`` (:func:`~dumper.engines.vllm.parts.join_dump`): the ranks' records, the prompt logprobs
    vLLM returned, and the manifest last."""
    spec = cfg.logprobs
    info = _engine_info(checkpoint, cfg.dtype, parts.engine_settings)
    job = {
        "job": "decode" if cfg.new_tokens else "prefill",
        "input_ids": seqs,
        "dtype": cfg.dtype,
        "chunk_size": cfg.chunk_size,
        "batch_size": cfg.batch_size,
        "logprobs": None if spec is None else vars(spec),
        "prefix_cache_hits": [int(o.num_cached_tokens or 0) for o in outs],
        **cfg.extra,
        **(
            {NEW_TOKENS: cfg.new_tokens, GENERATED_IDS: [list(o.outputs[0].token_ids) for o in outs]}
            if cfg.new_tokens
            else {}
        ),
    }
    if cfg.speculative is not None:
        steps = derive_steps(hidden_rows(parts.records.get(0, ())), [len(s) for s in seqs])
        engine_steps = [engine_acceptance(o) for o in outs]
        check_engine_steps(steps, engine_steps, [len(s) + cfg.new_tokens - 1 for s in seqs])
        job[SPECULATIVE_KEY] = speculative_extra(
            cfg.speculative.setting, cfg.speculative.vllm_config(), steps, engine_steps=engine_steps
        )
    identity = identity or hf_identity(checkpoint, cfg.model)
    vocab = int(identity.get("vocab_size") or 0)

    def record(cap: Capture) -> None:
        if spec is not None:
            _record_logprobs(cap, cfg, seqs, outs, vocab)

    return join_dump(cfg.out, parts, model_name=cfg.model, identity=identity, engine=info, job_extra=job, record=record)


def engine_acceptance(out: Any) -> dict[str, list[int]]:
    """vLLM's own per-step draft counts of one request (``per_request_spec_decode_metrics="detailed"``): the steps
    that proposed drafts, in order (``drafted``, ``accepted``)."""
    metrics = getattr(out.outputs[0], "spec_decode_metrics", None)
    if metrics is None:
        raise InternalError("vLLM returned no speculative-decoding metrics for a request of a speculative run")
    return {
        "drafted": [int(n) for n in metrics.per_step_drafted],
        "accepted": [int(n) for n in metrics.per_step_accepted],
    }


def check_engine_steps(steps: list[list[Step]], engine_steps: list[dict[str, list[int]]], ends: list[int]) -> None:
    """The steps read from the recorded verify rows agree with vLLM's own counts of the steps that proposed drafts,
    in order. Rows past the output (position ``ends[s]`` on) are not recorded but vLLM counts their drafts: a step
    near the end records fewer, and the last one, at the last fed position, may record none."""
    for s, (mine, theirs) in enumerate(zip(steps, engine_steps, strict=True)):
        want = list(zip(theirs["drafted"], theirs["accepted"], strict=True))
        left = list(want)
        ok = True
        for st in mine:
            if not st.proposed:
                if st is mine[-1] and st.position == ends[s] - 1 and len(left) == 1:
                    left.pop(0)  # its drafts all past the output
                continue
            if not left:
                ok = False
                break
            drafted, accepted = left.pop(0)
            ok = ok and min(drafted, ends[s] - 1 - st.position) == st.proposed
            ok = ok and min(accepted, st.proposed) == st.accepted
        if not ok or left:
            raise InternalError(
                f"sequence {s}: the recorded verify passes give (proposed, accepted) "
                f"{[(st.proposed, st.accepted) for st in mine if st.proposed]} but vLLM counted {want} "
                f"(steps as [pass, position, proposed, accepted]: {[st.to_json() for st in mine]})"
            )


def reference_llm(llm: Any, cfg: RunConfig, seqs: list[list[int]], sink: LogprobSink, vocab: int) -> list[Any]:
    """``cfg``'s job through ``llm`` with no capture (the observer check's reference): prompt logprobs into ``sink``;
    vLLM's outputs.

    ``llm`` is an engine built without the tap (``engine_kwargs(..., tap=False)``), so nothing
    of driftscope is in its model or its compiled graph.
    """
    llm.reset_prefix_cache()
    with torch.inference_mode():
        outs = _generate(llm, cfg, seqs)
    _record_logprobs(sink, cfg, seqs, outs, vocab)
    return outs


def release_llm() -> None:
    """Let go of the engine :func:`load_llm` keeps, so that the next one gets its memory (a GPU fits one)."""
    ENGINE.forget()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def observe_llm(cfg: RunConfig, checkpoint: Path, seqs: list[list[int]], *, vocab: int) -> Manifest:
    """The observer check of the dump at ``cfg.out``: the job again on the same engine without the tap.

    Eager or compiled alike, the reference is a second engine (the tapped one's graph holds the
    tap); the one :func:`load_llm` keeps is let go first. Returns the manifest with
    ``extra["observer"]`` (:mod:`dumper.prefill.observer`).
    """
    assert cfg.logprobs is not None  # RunConfig refuses --observer-check without --logprobs
    release_llm()
    check = ObserverCheck(cfg.out, logits=cfg.logprobs.save_logits)
    reference = load_llm(engine_kwargs(cfg, checkpoint, seqs, tap=False), device=cfg.device)
    outs = reference_llm(reference, cfg, seqs, check, vocab)
    result = check.result()
    if cfg.speculative is not None:  # and the acceptance of every step, as vLLM counted it
        result = same_acceptance(result, load_manifest(cfg.out).extra, [engine_acceptance(o) for o in outs])
    return mark_observer(cfg.out, result)


def same_acceptance(
    result: ObserverResult, extra: dict[str, Any], reference: list[dict[str, list[int]]]
) -> ObserverResult:
    """``result`` with the speculative acceptance compared too: vLLM's per-step counts of the captured run
    (``extra.speculative.engine_steps``) and of the run without capture must be equal."""
    captured = extra[SPECULATIVE_KEY]["engine_steps"]
    compared = f"{result.compared}+speculative acceptance"
    for s, (got, want) in enumerate(zip(captured, reference, strict=True)):
        if got != want:
            return replace(result, bit_exact=False, compared=compared, sequence=s, position=None)
    return replace(result, compared=compared)


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Load ``cfg.model`` (a local HF checkpoint directory) into vLLM and dump the job through it.

    With ``cfg.observer_check``, :func:`observe_llm` follows.
    """
    checkpoint = check_checkpoint_dir(cfg.model, "vllm")
    identity = hf_identity(checkpoint, cfg.model)
    vocab = int(identity.get("vocab_size") or 0)
    seqs = job_sequences(cfg, checkpoint, vocab)
    llm = load_llm(engine_kwargs(cfg, checkpoint, seqs), device=cfg.device)
    manifest = dump_llm(llm, cfg, seqs, checkpoint, identity=identity, progress=progress)
    if not cfg.observer_check:
        return manifest
    del llm  # the tapped engine goes before the reference comes
    return observe_llm(cfg, checkpoint, seqs, vocab=vocab)
