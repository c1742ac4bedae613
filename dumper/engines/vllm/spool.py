"""driftscope's capture where vLLM runs its model: in the engine core process and in every TP worker.

vLLM's default engine runs the model in processes the caller does not own (the engine core;
one worker per tensor-parallel rank; ``vllm serve``'s back end). The capture therefore lives
there and is steered by the requests themselves: driftscope's client marks each request it
sends (``SamplingParams.extra_args``, which ``vllm serve`` takes as ``vllm_xargs``)::

    {"driftscope_capture": TOKEN, "driftscope_seq": i, "driftscope_n": N[, "driftscope_new": T]}

and a model loaded with the tap (``additional_config={"driftscope": {...}}``, see
:mod:`dumper.engines.vllm.tap`) in a process whose environment names a spool directory
(``DRIFTSCOPE_VLLM_SPOOL=DIR``) records, on every rank, the prompt rows of exactly those
requests, and with ``T`` > 1 their first ``T - 1`` decode steps, into ``DIR/TOKEN/``: rank ``r``
writes its data files and, once all ``N`` requests are complete, its part ``index-r{r}.json``
(:mod:`dumper.hooks.parts`). ``DIR`` may be an fsspec URL (``s3://bucket/spool``): each rank then
records into a local staging directory and sends its data files, then its part, to
``URL/TOKEN/`` (:mod:`dumper.hooks.remote`), so ranks on hosts that share no disk (vLLM's Ray
executor across nodes) need only the URL. Rows of requests without the token (anyone else's
traffic) are never recorded. The client joins the parts into one dump and writes its manifest
(:mod:`dumper.engines.vllm.parts`); a part alone never looks complete.

A capture's last writes and its part are made in a thread of their own, so that the engine
step that completed it does not wait for the disk; the client waits for the part instead.
A failure inside a worker's capture never stops the engine: the token's capture is dropped,
and ``DIR/TOKEN/failed-r{r}.txt`` says why, for the client to report. A capture none of whose
requests ran for :data:`ABANDON_S` seconds (a client that died, a request the server refused)
is dropped the same way, so that it costs the engine nothing for ever.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dumper.engines.vllm.hooks import VllmFamily, runner_on_stack
from dumper.format.remote import is_url, write_small
from dumper.format.sketch import SketchSpec
from dumper.hooks.capture import Capture
from dumper.hooks.parts import dist_rank_world
from dumper.hooks.remote import capture_class
from dumper.settings import env_settings

__all__ = [
    "MARK_TOKEN",
    "MARK_SEQ",
    "MARK_COUNT",
    "MARK_NEW",
    "marker",
    "check_token",
    "failed_name",
    "failed_path",
    "token_dir",
    "leave_failure",
    "MarkedFamily",
    "SpoolRecorder",
    "engine_settings",
    "install_recorder",
]

MARK_TOKEN = "driftscope_capture"
MARK_SEQ = "driftscope_seq"
MARK_COUNT = "driftscope_n"
"""``extra_args`` keys of a marked request: the capture's token, its sequence id, the capture's prompt count."""
MARK_NEW = "driftscope_new"
"""Optional ``extra_args`` key: the tokens the request generates, whose decode steps (all but the last) are recorded."""
ABANDON_S = 600.0
"""Seconds a capture may wait for its next marked request before it is dropped as abandoned."""
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_LOG = logging.getLogger("vllm.driftscope")


def check_token(token: Any) -> str | None:
    """``token`` if it is a capture token (1-64 of ``A-Z a-z 0-9 _ -``: a plain directory name), else None."""
    return token if isinstance(token, str) and _TOKEN.fullmatch(token) else None


def marker(token: str, seq: int, count: int, new_tokens: int = 1) -> dict[str, Any]:
    """The ``extra_args`` (``vllm_xargs``) that put a request into capture ``token`` as sequence ``seq`` of ``count``,
    its decode steps recorded when it generates ``new_tokens`` > 1."""
    if check_token(token) is None:
        raise ValueError(f"capture token {token!r}: expected 1-64 letters, digits, '_' or '-'")
    return {
        MARK_TOKEN: token,
        MARK_SEQ: int(seq),
        MARK_COUNT: int(count),
        **({MARK_NEW: int(new_tokens)} if new_tokens > 1 else {}),
    }


def failed_name(rank: int) -> str:
    """The file in which rank ``rank`` says why its capture of a token was dropped (a directory's or a URL's)."""
    return f"failed-r{rank}.txt"


def failed_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` says why its capture of a token was dropped."""
    return directory / failed_name(rank)


def token_dir(root: Path | str, token: str) -> Path | str:
    """Capture ``token``'s directory under the spool ``root``: a local directory, or a prefix of a URL spool
    (ranks on several hosts without a shared disk send their files there, :mod:`dumper.hooks.remote`)."""
    return f"{str(root).rstrip('/')}/{token}" if is_url(root) else Path(root) / token


def leave_failure(directory: Path | str, rank: int, reason: str) -> None:
    """Say in ``directory`` why rank ``rank`` dropped its capture (for the client, which stops waiting)."""
    if isinstance(directory, str):
        write_small(f"{directory}/{failed_name(rank)}", (reason + "\n").encode())
        return
    directory.mkdir(parents=True, exist_ok=True)
    failed_path(directory, rank).write_text(reason + "\n")


def _mark(request: Any) -> tuple[str, int, int, int] | None:
    """(token, sequence, count, new tokens) of a marked request, None for any other."""
    params = getattr(request, "sampling_params", None)
    args = getattr(params, "extra_args", None)
    if not isinstance(args, dict) or check_token(args.get(MARK_TOKEN)) is None:
        return None
    seq = args.get(MARK_SEQ)
    count = args.get(MARK_COUNT)
    new = args.get(MARK_NEW, 1)
    if type(seq) is not int or type(count) is not int or not 0 <= seq < count or type(new) is not int or new < 1:
        return None
    return args[MARK_TOKEN], seq, count, new


class MarkedFamily(VllmFamily):
    """The vLLM family, keeping only the rows of requests marked with one capture token."""

    def __init__(self, model: nn.Module, token: str, count: int, runner: Any = None) -> None:
        super().__init__(model)
        self.token, self.count = token, count
        self._runner = runner  # the recorder's, so that the stack is not searched again

    def _number(self, rid: str, request: Any) -> int | None:
        mark = _mark(request)
        if mark is None or mark[0] != self.token or mark[2] != self.count:
            return None
        self.new_tokens[mark[1]] = mark[3]
        return mark[1]

    def complete(self) -> bool:
        """Every one of the capture's requests ran, each recorded from its first computed position to its end
        (its last decode step fed)."""
        return len(self._prompt) == self.count and not self.unrecorded()


_WATCHED = "_driftscope_watched"
"""Marks the model runner's ``sample_tokens`` once :meth:`SpoolRecorder._watch_sampling` wrapped it."""


def _abandon(token: str) -> None:
    raise TimeoutError(f"no request of capture {token} ran for {ABANDON_S:.0f} s; dropped as abandoned")


class SpoolRecorder:
    """The top-level hooks of a tapped vLLM model: one worker-side :class:`Capture` per capture token in flight."""

    def __init__(
        self, model: nn.Module, root: Path | str, spec: dict[str, Any], settings: dict[str, Any], router: Any = None
    ) -> None:
        self.model, self.root, self.spec, self.settings = model, root, spec, settings
        self.rank = dist_rank_world()[0]
        self.router = router  # the MoE layers' probes (dumper.hooks.router_tap.RouterTap), with the ``router`` point
        self._tokens: int | None = None  # tokens of the pass running now (what each router probe must see)
        self._runner: Any = None  # vLLM's model runner, found on the stack in the first pass it drives
        self._open: dict[str, Capture] = {}
        self._seen: dict[str, float] = {}  # token -> when one of its requests last ran
        self._ended: set[str] = set()
        model.register_forward_pre_hook(self._on_start, with_kwargs=True)
        model.register_forward_hook(self._on_end, always_call=True)

    def _on_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._runner is None:
            self._runner = runner_on_stack(self.model)
            self._watch_sampling(self._runner)
        runner = self._runner
        now = time.monotonic()
        for rid in getattr(getattr(runner, "input_batch", None), "req_ids", None) or ():
            mark = _mark(runner.requests.get(rid))
            if mark is None or mark[0] in self._ended:
                continue
            self._seen[mark[0]] = now
            if mark[0] not in self._open:
                self._guard(mark[0], self._begin, mark[0], mark[2])
        for token in [t for t in self._open if now - self._seen.get(t, now) > ABANDON_S]:
            self._guard(token, _abandon, token)
        for token, cap in list(self._open.items()):
            self._guard(token, cap.pass_start, args, kwargs)
        if self.router is not None:
            self.router.clear()
            positions = kwargs.get(VllmFamily.positions_kwarg, args[1] if len(args) > 1 else None)
            self._tokens = int(positions.shape[-1]) if isinstance(positions, torch.Tensor) else None

    def _on_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        parts = None
        for token, cap in list(self._open.items()):
            if self.router is not None:  # into the pass still open, whose rows it inherits
                parts = self._guard(token, self.router.parts, self._tokens) if parts is None else parts
                self._guard(token, _record_router, cap, parts or [])
            if token in self._open:
                self._guard(token, cap.pass_end)
        self._close_complete()

    def _close_complete(self) -> None:
        """Close every capture whose requests are all recorded to their end: its last writes and its part, off the
        engine's step."""
        for token, cap in list(self._open.items()):
            family = cap.family
            if isinstance(family, MarkedFamily) and family.complete():
                self._ended.add(token)
                self._seen.pop(token, None)
                done = self._open.pop(token)
                threading.Thread(target=self._guard, args=(token, done.close), name=f"driftscope-close-{token}").start()

    def _watch_sampling(self, runner: Any) -> None:
        """With speculative decoding, which rows of a verify pass count is known only once vLLM sampled: wrap the
        runner's ``sample_tokens`` (once) to tell each capture what it emitted, then close what is complete."""
        sample = getattr(runner, "sample_tokens", None)
        if getattr(runner, "speculative_config", None) is None or sample is None or getattr(sample, _WATCHED, False):
            return

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            out = sample(*args, **kwargs)
            req_ids, sampled = getattr(out, "req_ids", None), getattr(out, "sampled_token_ids", None)
            if isinstance(req_ids, list) and isinstance(sampled, list):
                for token, cap in list(self._open.items()):
                    if isinstance(cap.family, MarkedFamily):
                        self._guard(token, cap.family.sampled, req_ids, sampled)
                self._close_complete()
            return out

        setattr(sample_tokens, _WATCHED, True)
        runner.sample_tokens = sample_tokens

    def _begin(self, token: str, count: int) -> None:
        cap = capture_class(self.root)(
            self.model,
            token_dir(self.root, token),
            layers=self.spec.get("layers"),
            points=self.spec.get("points"),
            family=MarkedFamily(self.model, token, count, self._runner),
            hooks=False,
            part=True,
            extra={"engine_settings": self.settings},
            sketch=SketchSpec.from_json(self.spec["sketch"]) if self.spec.get("sketch") else None,
        )
        cap.__enter__()
        self._open[token] = cap

    def _guard(self, token: str, fn: Any, *args: Any) -> Any:
        """Run one step of ``token``'s capture; a failure drops that capture (said in a file), never the engine."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - nothing of driftscope's may take down the engine it observes
            self._ended.add(token)
            self._seen.pop(token, None)
            cap = self._open.pop(token, None)
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            _LOG.error("driftscope: capture %s dropped on rank %d (%s)", token, self.rank, reason)
            try:
                if cap is not None:
                    cap.__exit__(RuntimeError, None, None)  # no part: the shards stay, never a complete dump
                leave_failure(token_dir(self.root, token), self.rank, reason)
            except Exception:  # noqa: BLE001 - the reason is in vLLM's log already
                pass


def _record_router(cap: Capture, parts: list[tuple[str, int, dict[str, Any], dict[str, int]]]) -> None:
    for prefix, layer, tensors, meta in parts:
        cap.record_router(prefix, layer, tensors, scores_meta=meta)


def engine_settings(vllm_config: Any, model: nn.Module) -> dict[str, Any]:
    """How the engine runs the model (``extra.engine.settings`` of a dump): compiled, CUDA graphs, batching, cache,
    ranks."""
    backend = next((m.attn_backend.get_name() for m in model.modules() if hasattr(m, "attn_backend")), None)
    sched = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    comp = vllm_config.compilation_config
    par = vllm_config.parallel_config
    compiled = not vllm_config.model_config.enforce_eager and str(comp.mode).rsplit(".", 1)[-1] != "NONE"
    graphs = str(getattr(comp, "cudagraph_mode", None)).rsplit(".", 1)[-1] not in ("NONE", "None")
    return {
        "kv_cache_dtype": str(cache.cache_dtype),
        "attention_backend": backend,
        "compiled": compiled,
        "cuda_graphs": graphs and vllm_config.device_config.device.type == "cuda",
        "chunked_prefill": bool(sched.enable_chunked_prefill),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_num_seqs": int(sched.max_num_seqs),
        "prefix_caching": bool(cache.enable_prefix_caching),
        "block_size": int(cache.block_size),
        "tensor_parallel_size": int(par.tensor_parallel_size),
        "pipeline_parallel_size": int(par.pipeline_parallel_size),
        "executor": str(getattr(par, "distributed_executor_backend", None) or "mp"),
    }


def install_recorder(
    model: nn.Module, spec: dict[str, Any], vllm_config: Any, *, router: Any = None
) -> SpoolRecorder | None:
    """Add the marked-request recorder to a model tapped as ``spec`` says, when ``DRIFTSCOPE_VLLM_SPOOL`` is set.

    ``spec``'s points are the hidden-state tap's; ``router`` (a :class:`~dumper.hooks.router_tap.RouterTap`)
    adds each MoE layer's routing to every pass.
    """
    root = env_settings().vllm_spool
    if not root:
        return None
    recorder = SpoolRecorder(
        model, root if is_url(root) else Path(root), spec, engine_settings(vllm_config, model), router
    )
    _LOG.info("driftscope: recording marked requests into %s (rank %d)", root, recorder.rank)
    return recorder
