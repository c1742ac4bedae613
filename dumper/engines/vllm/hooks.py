"""The hook API's vLLM family: capture inside vLLM's own model code, named as the HF capture names it.

vLLM runs every scheduled token of every request in one flattened ``[tokens]`` batch: the
attention modules of its Llama-family models are called as ``self_attn(positions=[tokens],
hidden_states=[tokens, hidden])`` (the hidden states already normalized, as HF's self_attn
input is). Which rows belong to which request comes from vLLM's batch metadata: the forward
context's attention metadata (``query_start_loc``) and the model runner's input batch (request
ids, prompts). Sequence ids are given in the order requests first appear, which for one
``LLM.generate`` call is prompt order. Prompt positions are kept, and the first ``T - 1`` decode
steps of a sequence given ``new_tokens`` ``T`` (:mod:`dumper.format.decode`: a decode step feeds
the token it generated before at the next position); padding rows are dropped.

A prefix-cache hit computes only the tokens past the cached prefix; the rows of the cached
positions are those of the earlier request whose blocks were reused, and are written under
the hit's sequence at the end (``meta`` ``shared_prefix``), so every prompt's positions are
complete when that request ran inside the capture.

Example (a script of your own; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the model in process)::

    llm = LLM(model=DIR, enforce_eager=True)
    with dumper.capture(llm, "dumps/vllm", layers="all"):   # or the model module itself
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], SamplingParams(max_tokens=1))
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from dumper.errors import UsageError
from dumper.format import encode_runs
from dumper.hooks.families import FamilyAdapter, register
from dumper.hooks.fingerprint import config_hash
from dumper.hooks.rows import PassRows, Runs, SharedRows

__all__ = ["VllmFamily", "model_runner_of", "model_of", "runner_on_stack"]

_RUNNER_PATH = "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner"


def model_runner_of(llm: Any) -> Any:
    """The in-process model runner of a vLLM ``LLM``; a :class:`UsageError` when the engine runs elsewhere."""
    obj = llm
    for attr in _RUNNER_PATH.split("."):
        obj = getattr(obj, attr, None)
        if obj is None:
            raise UsageError(
                "vLLM's model runs in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "(and use one GPU / no tensor parallelism) to capture inside it"
            )
    return obj


def model_of(llm: Any) -> nn.Module:
    """The ``nn.Module`` a vLLM ``LLM`` runs in this process (under any CUDA-graph wrapper)."""
    runner = model_runner_of(llm)
    get = getattr(runner, "get_model", None)
    return get() if callable(get) else runner.model


def _is_llm(obj: Any) -> bool:
    return type(obj).__module__.startswith("vllm.entrypoints") and hasattr(obj, "llm_engine")


def _runner_models(runner: Any) -> tuple[Any, ...]:
    """The model a runner calls, as it holds it and under any CUDA-graph wrapper (``get_model()``)."""
    get = getattr(runner, "get_model", None)
    return getattr(runner, "model", None), get() if callable(get) else None


def runner_on_stack(model: nn.Module) -> Any:
    """The model runner whose forward is calling ``model`` now (the caller frame's ``self``), or None."""
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "input_batch") and model in _runner_models(owner):
            return owner
        frame = frame.f_back
    return None


@register
class VllmFamily(FamilyAdapter):
    """vLLM models (classes under ``vllm.``) and ``vllm.LLM`` handles, in process."""

    name = "vllm"
    positions_kwarg: ClassVar[str] = "positions"
    """The model call's ``[tokens]`` positions (else its second positional argument):
    ``forward(input_ids, positions)``."""

    def __init__(self, model: nn.Module | None, handle: Any = None) -> None:
        super().__init__(model, handle)
        self._runner = model_runner_of(handle) if handle is not None else None
        self._seq_of: dict[str, int] = {}  # request id -> sequence id
        self._prompt: dict[int, tuple[int, ...]] = {}  # per sequence: its prompt tokens
        self._start: dict[int, int] = {}  # per sequence: first position it computed (> 0: a prefix-cache hit)
        self._done: dict[int, int] = {}  # per sequence: positions below this are recorded
        self.new_tokens: dict[int, int] = {}  # per sequence: the tokens it generates (absent: 1, a prefill)
        self._shared: list[SharedRows] = []
        self._verify: dict[int, tuple[str, int]] = {}  # speculative: per sequence, (request, first position) of the
        # verify pass that ran last and whose sampled tokens are not yet known
        self._kept: dict[int, int] = {}  # speculative: per sequence, the position after its last kept row
        self.speculative = False
        """Whether the engine decodes speculatively (its verify passes compute rejected drafts' positions again)."""
        self.last_batch: list[tuple[int, int, int, int, int]] = []
        """The last pass's recorded requests: (index in the batch, sequence, its last and first position in the
        pass, its first computed position: > 0 after a prefix-cache hit), for :mod:`dumper.engines.vllm.kv_cache`."""

    @classmethod
    def matches(cls, model: Any) -> bool:
        return type(model).__module__.startswith("vllm.")

    @classmethod
    def resolve(cls, obj: Any) -> Any:
        return model_of(obj) if _is_llm(obj) else obj

    def hidden_input(self, args: tuple, kwargs: dict) -> Any:
        return kwargs.get(self.hidden_kwarg, args[1] if len(args) > 1 else None)  # forward(positions, hidden_states)

    def pass_rows(self, args: tuple, kwargs: dict) -> PassRows | None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        positions = kwargs.get(self.positions_kwarg, args[1] if len(args) > 1 else None)
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or not is_forward_context_available():
            return None  # M-RoPE ([3, tokens]) positions or a call outside vLLM's runner: rows stay unlabelled
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            raise UsageError("vLLM micro-batching (dual-batch overlap) is on; turn it off to capture")
        first = next(iter(meta.values()), None) if isinstance(meta, dict) else meta
        if first is None:  # a dummy or profiling run: nothing to record
            return PassRows((int(positions.shape[0]),), Runs([]), Runs([]), keep=torch.zeros(0, dtype=torch.int64))
        runner = self._runner = self._runner or runner_on_stack(self.model)
        if runner is None:
            raise UsageError("cannot find vLLM's model runner for this model; pass the vllm.LLM to dumper.capture")
        starts = first.query_start_loc.detach().cpu().numpy()
        return self._rows(positions.detach().cpu().numpy(), starts, runner)

    def _rows(self, pos: np.ndarray, starts: np.ndarray, runner: Any) -> PassRows:
        """Request ``i`` holds rows ``starts[i]:starts[i+1]`` of the flat batch; keep its unrecorded rows up to its
        end (:meth:`end`)."""
        seq = np.zeros(pos.shape[0], dtype=np.int64)
        keep = np.zeros(pos.shape[0], dtype=bool)
        self.last_batch = []
        # speculative decoding computes a rejected draft's position again in a later pass: every decode row is kept
        again = self.speculative = getattr(runner, "speculative_config", None) is not None
        for i, rid in enumerate(runner.input_batch.req_ids[: len(starts) - 1]):
            a, b = int(starts[i]), int(starts[i + 1])
            if b <= a:
                continue
            s = self._sequence(rid, int(pos[a]), runner.requests[rid])
            if s is None:
                continue
            self.last_batch.append((i, s, int(pos[b - 1]), int(pos[a]), self._start[s]))
            fresh = (pos[a:b] >= self._done[s]) | (again & (pos[a:b] >= len(self._prompt[s])))
            keep[a:b] = fresh & (pos[a:b] < self.end(s))
            if again and int(pos[a]) >= len(self._prompt[s]):
                self._verify[s] = (rid, int(pos[a]))
            seq[a:b] = s
            if keep[a:b].any():
                self._done[s] = max(self._done[s], int(pos[a:b][keep[a:b]].max()) + 1)
        rows = np.flatnonzero(keep)
        return PassRows(
            (int(pos.shape[0]),),
            Runs(encode_runs(pos[rows], step=1)),
            Runs(encode_runs(seq[rows], step=0)),
            keep=None if rows.size == pos.shape[0] else torch.from_numpy(rows),
        )

    def sampled(self, req_ids: list[str], sampled: list[Any]) -> None:
        """What vLLM sampled after a speculative step: request ``req_ids[i]`` emitted ``len(sampled[i])`` tokens, so
        the verify pass that ran last kept that many rows of it (draft index 0 and the accepted drafts)."""
        index = {rid: i for i, rid in enumerate(req_ids)}
        for s, (rid, first) in self._verify.items():
            i = index.get(rid)
            if i is not None and len(sampled[i]):
                self._kept[s] = max(self._kept.get(s, 0), first + len(sampled[i]))
        self._verify.clear()

    def _frontier(self, s: int) -> int:
        """The position up to which sequence ``s`` is recorded for sure: its prompt rows, then (speculative) its
        kept rows, known once vLLM sampled (:meth:`sampled`); a rejected draft's row does not count."""
        if not self.speculative:
            return self._done[s]
        return max(min(self._done[s], len(self._prompt[s])), self._kept.get(s, 0))

    def end(self, s: int) -> int:
        """The position after sequence ``s``'s last recorded row: its prompt, then the decode steps that feed
        all but its last generated token."""
        return len(self._prompt[s]) + max(self.new_tokens.get(s, 1) - 1, 0)

    def _number(self, rid: str, request: Any) -> int | None:
        """The sequence id a request new to this capture gets (``None``: not recorded): the next one."""
        return len(self._prompt)

    def _sequence(self, rid: str, first: int, request: Any) -> int | None:
        """The sequence id of request ``rid``, numbered on first sight; a first position past 0 is a cache hit."""
        if rid in self._seq_of:
            return self._seq_of[rid]
        s = self._number(rid, request)
        if s is None or s in self._prompt:
            return None
        self._seq_of[rid] = s
        self._prompt[s] = tuple(int(t) for t in request.prompt_token_ids or ())
        self._start[s] = self._done[s] = first
        if first > 0:
            head = self._prompt[s][:first]
            src = next(
                (k for k in sorted(self._prompt) if k != s and self._start[k] == 0 and self._prompt[k][:first] == head),
                None,
            )
            if src is not None:
                self._shared.append(SharedRows(s, src, first))
        return s

    def cache_reader(self, targets: Any) -> Any:
        from dumper.engines.vllm.kv_cache import VllmCacheReader

        return VllmCacheReader(self, targets)

    def compiled_reason(self) -> str | None:
        compiled = self.model is not None and any(
            getattr(m, "do_not_compile", True) is False for m in self.model.modules()
        )
        return "vLLM's torch.compile" if compiled else None

    def tap_hint(self) -> str:
        return (
            'start vLLM with additional_config={"driftscope": {"layers": "all"}}, or --engine-arg '
            "enforce_eager=true for module hooks; see docs/hooks.md, 'Compiled models: the tap'"
        )

    def shared_rows(self) -> list[SharedRows]:
        return list(self._shared)

    def unrecorded(self) -> list[tuple[int, int, int]]:
        """(sequence, first position not recorded, end) of every sequence whose rows are incomplete.

        A sequence is complete when every position from its first computed one (after a prefix
        hit) to its end (:meth:`end`) was recorded: a pass the capture could not read (a full
        CUDA-graph replay runs no Python) leaves a hole, which a dump must not hide.
        """
        return [(s, self._frontier(s), self.end(s)) for s in sorted(self._prompt) if self._frontier(s) < self.end(s)]

    def identity(self, name: str | None) -> dict[str, Any]:
        """The HF config vLLM loaded names the model; no weights hash (vLLM fuses and renames weights: qkv_proj)."""
        config = getattr(self.model, "config", None)
        return {
            "name": name or getattr(config, "_name_or_path", None) or type(self.model).__name__,
            "architecture": type(self.model).__name__,
            "num_layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
            "config_hash": config_hash(config),
            "weights_hash": None,
        }

    def environment(self) -> dict[str, Any]:
        import vllm

        backend = (
            next((m.attn_backend.get_name() for m in self.model.modules() if hasattr(m, "attn_backend")), None)
            if self.model is not None
            else None
        )
        return {"engine": "vllm", "engine_version": vllm.__version__, "engine_attention_backend": backend}
