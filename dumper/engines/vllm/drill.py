"""vLLM's side of ``python -m dumper drill``: one half of one layer of vLLM's own model, op by op.

The drill starts vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager
(``enforce_eager``: no graph, so every op dispatches one by one, custom ops included), one request
at a time and no prefix cache, and runs the baseline's tokens of one sequence as one prefill. A
forward pre-hook on the half's module (``model.layers.L.self_attn`` or ``.mlp``) swaps the hidden
states vLLM computed for the baseline's rows, and an :class:`~dumper.hooks.drill.record.OpRecorder`
records what the module dispatches: vLLM's oneDNN GEMMs (``_C.onednn_mm``), its rotary kernel, its
opaque attention op with the real attention metadata and paged cache, and the aten ops between them.

Two things vLLM does not show in an op's arguments are kept for the float64 references
(:mod:`dumper.hooks.drill.reference`): the weight of each oneDNN GEMM (vLLM packs it into a handle
and drops the tensor: :func:`keep_gemm_weights` keeps it as vLLM loads) and each attention layer's
scale. Tensor parallelism is refused: the drill runs one worker, in this process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dumper.engines.base import check_checkpoint_dir
from dumper.errors import ModelError, UsageError, error_reason
from dumper.hooks.drill.record import OpRecorder, half_module

__all__ = ["run_half", "run_halves", "keep_gemm_weights"]

_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def keep_gemm_weights(weights: dict[int, torch.Tensor]) -> Iterator[None]:
    """While inside, each oneDNN GEMM handle vLLM creates maps to its weight [N, K] in ``weights``."""
    from vllm import _custom_ops as ops

    create = ops.create_onednn_mm

    def keeping(weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        handler = create(weight, *args, **kwargs)
        weights[int(handler.handler_tensor.reshape(-1)[0])] = weight.detach().t()
        return handler

    ops.create_onednn_mm = keeping
    try:
        yield
    finally:
        ops.create_onednn_mm = create


def _engine(cfg: Any, n: int, token_ids: list[int], weights: dict[int, torch.Tensor]) -> Any:
    from dumper.engines.vllm.engine import engine_kwargs, load_llm
    from dumper.prefill.run import RunConfig

    opts = dict(cfg.engine_args)
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if opts.get(key, "1") not in ("1", ""):
            raise UsageError(
                f"drill --engine-arg {key}={opts[key]}: the drill runs vLLM's layer in one worker, in this process; "
                "drill a rank's half with tensor_parallel_size=1"
            )
    if os.environ.get(_IN_PROCESS, "0") not in ("0", ""):
        raise UsageError(f"drill --engine vllm runs vLLM in this process: unset {_IN_PROCESS} (or set it to 0)")
    os.environ[_IN_PROCESS] = "0"
    checkpoint = check_checkpoint_dir(cfg.model, "vllm")
    run = RunConfig(
        out=cfg.out, model=cfg.model, dtype=cfg.dtype, engine="vllm", engine_args=cfg.engine_args, seed=cfg.seed
    )
    kw = engine_kwargs(run, checkpoint, [token_ids], tap=False)
    kw.update(enforce_eager=True, enable_prefix_caching=False, max_num_seqs=1)
    kw["max_num_batched_tokens"] = max(n, 256)
    kw["max_model_len"] = max(int(kw.get("max_model_len") or 0), n + 1)
    with keep_gemm_weights(weights):
        return load_llm(kw, device=cfg.device)


def _scales(model: torch.nn.Module) -> dict[str, float]:
    """Each attention layer's softmax scale, by the name vLLM passes its attention op."""
    out = {}
    for m in model.modules():
        impl, name = getattr(m, "impl", None), getattr(m, "layer_name", None)
        if isinstance(name, str) and impl is not None and hasattr(impl, "scale"):
            out[name] = float(impl.scale)
    return out


def run_halves(
    cfg: Any,
    halves: list[tuple[int, str, torch.Tensor]],
    token_ids: list[int],
    recorder_for: Callable[[str], OpRecorder],
    state: dict[str, Any],
) -> list[tuple[OpRecorder, torch.Tensor, dict[str, Any]]]:
    """vLLM's halves ``(layer, half, x)`` (``x``: the baseline's rows [n, d] of that half's input) in one prefill of
    ``token_ids`` on one engine: per half, the recorder, the half's output [n, d] and the log's header fields.

    Each half gets the baseline's rows whatever came before it, so every half of the model can be drilled in one
    forward."""
    import vllm
    from vllm import SamplingParams

    from dumper.engines.vllm.engine import release_llm
    from dumper.engines.vllm.hooks import VllmFamily, model_of

    n = int(halves[0][2].shape[0])
    weights: dict[int, torch.Tensor] = state.setdefault("weights", {})
    llm = _engine(cfg, n, token_ids, weights)
    try:
        model = model_of(llm)
        state["attention_scale"] = _scales(model)
        state["fresh_prefill"] = True
        runs = []
        with contextlib.ExitStack() as stack:
            for layer, half, x in halves:
                path, module = half_module(model, layer, half, VllmFamily, "vLLM's model")
                rec = recorder_for(path)
                seen: list[torch.Tensor] = []
                for h in _swap_hooks(module, half, x, rec, seen):
                    stack.callback(h.remove)
                stack.enter_context(rec.watch(module, path))
                runs.append((path, rec, seen))
            try:
                llm.generate(
                    [{"prompt_token_ids": list(token_ids)}],
                    SamplingParams(max_tokens=1, temperature=0.0),
                    use_tqdm=False,
                )
            except Exception as e:  # noqa: BLE001 - vLLM's own run
                raise ModelError(f"{cfg.model}: vLLM failed on the baseline's rows ({error_reason(e)})") from e
        out = []
        for path, rec, seen in runs:
            if len(seen) < 2:
                raise ModelError(
                    f"{cfg.model}: vLLM never ran {path} on one prefill of the sequence's {n} tokens: nothing drilled"
                )
            info = {"engine": "vllm", "engine_version": vllm.__version__, "module": path, "engine_mode": "eager"}
            out.append((rec, seen[1].detach().to("cpu").reshape(n, -1), info))
        return out
    finally:
        release_llm()


def _swap_hooks(
    module: torch.nn.Module, half: str, x: torch.Tensor, rec: OpRecorder, seen: list[torch.Tensor]
) -> list[Any]:
    """Hooks on ``module``: its first call on ``n`` rows gets ``x`` as its hidden states, recorded by ``rec``; its
    output is appended to ``seen`` (after the rows it ran on)."""
    n = int(x.shape[0])

    def swap(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if half == "mlp":
            hidden = args[0] if args else kwargs.get("x")
        else:
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        if hidden is None or hidden.shape[0] != n or seen:
            return None
        rows = x.to(hidden.device, hidden.dtype, non_blocking=True).reshape(hidden.shape)
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": rows}
        elif half == "attn":
            args = (args[0], rows, *args[2:])
        elif args:
            args = (rows, *args[1:])
        else:
            kwargs = {**kwargs, "x": rows}
        rec.__enter__()
        seen.append(rows)
        return args, kwargs

    def done(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if len(seen) == 1:
            rec.__exit__(None, None, None)
            seen.append(out[0] if isinstance(out, tuple) else out)

    return [
        module.register_forward_pre_hook(swap, with_kwargs=True),
        module.register_forward_hook(done, with_kwargs=True, always_call=True),
    ]


def run_half(
    cfg: Any,
    layer: int,
    half: str,
    x: torch.Tensor,
    token_ids: list[int],
    recorder_for: Callable[[str], OpRecorder],
    state: dict[str, Any],
) -> tuple[OpRecorder, torch.Tensor, dict[str, Any]]:
    """vLLM's half ``half`` of layer ``layer`` on the baseline's rows ``x`` [n, d] of one prefill of ``token_ids``:
    the recorder, the half's output [n, d] and the header fields of the log (:func:`run_halves` of one)."""
    return run_halves(cfg, [(layer, half, x)], token_ids, recorder_for, state)[0]
