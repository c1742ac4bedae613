"""ONNX Runtime GenAI: dump a model built by ``onnxruntime_genai.models.builder`` under the HF capture's names.

Logprobs come from ONNX Runtime GenAI itself (``og.Generator.append_tokens`` with the job's
token ids, then ``get_output("logits")``: every position of the appended tokens). Hidden states
come from the same ``model.onnx`` run by plain onnxruntime with the input_layernorm outputs
exposed (:mod:`.onnxruntime_genai_graph`). Each prompt is its own generator; ``--chunk-size``
appends it in chunks through both engines' KV caches, one forward pass per chunk.

Example::

    python -m onnxruntime_genai.models.builder -i CKPT -o ORT -p fp32 -e cpu
    python -m dumper run --engine onnxruntime-genai --model ORT --engine-arg hf_dir=CKPT \
        --layers all --logprobs --top-k 5 --out dumps/ort
    python -m comparator dumps/hf dumps/ort
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dumper.engines.base import (
    EngineArg,
    EngineDump,
    EngineInfo,
    check_checkpoint_dir,
    check_engine_args,
    hf_identity,
    job_sequences,
)
from dumper.engines.onnxruntime_genai_graph import (
    HiddenRunner,
    OrtModel,
    read_ort_model,
)
from dumper.errors import ModelError, UsageError, error_reason
from dumper.format import Manifest
from dumper.hooks.layers import parse_layer_spec
from dumper.prefill.run import RunConfig
from dumper.progress import ProgressFn

__all__ = ["ENGINE_ARGS", "run_dump"]

ENGINE = "onnxruntime-genai"
ENGINE_ARGS = {
    "hf_dir": EngineArg(
        "the HF checkpoint the ONNX model was built from: its config is the dump's identity "
        "and its tokenizer encodes text prompts; default the tokenizer the builder copied",
        "path",
    )
}
"""``--engine-arg`` keys ``--engine onnxruntime-genai`` takes, and their values."""


def _check_job(cfg: RunConfig, model: OrtModel) -> None:
    """Refuse the run options this engine cannot honour, each with the reason."""
    if cfg.dtype != model.activation_dtype:
        raise UsageError(
            f"--dtype {cfg.dtype}: {model.onnx_path} computes in {model.activation_dtype} (its precision "
            f"is fixed when the builder writes it, -p fp32|int8|int4); pass --dtype "
            f"{model.activation_dtype} or rebuild the model"
        )
    if cfg.batch_size != 1:
        raise UsageError(
            f"--batch-size {cfg.batch_size}: --engine {ENGINE} runs one prompt per generator (ORT GenAI "
            "infers padding from pad_token_id, which would mask real tokens of that id); use --batch-size 1"
        )
    if cfg.modules is not None:
        raise UsageError(
            f"--modules: --engine {ENGINE} captures the self-attention input only (the graph's "
            "input_layernorm outputs); other modules need the HF hook API"
        )
    if cfg.attn != "eager":
        raise UsageError(f"--attn {cfg.attn}: the ONNX graph fixes its attention op; --engine {ENGINE} takes no --attn")
    wanted = "cuda" if cfg.device.startswith("cuda") else cfg.device
    if wanted not in model.providers:
        raise UsageError(
            f"--device {cfg.device}: {model.dir} was built for execution provider "
            f"{', '.join(model.providers)}; rebuild it with -e {wanted} or pass --device "
            f"{model.providers[0]}"
        )


def _identity(cfg: RunConfig, model: OrtModel, hf_dir: str | None) -> dict[str, Any]:
    """The HF checkpoint's identity (so config_hash matches its HF dump), or what genai_config.json says."""
    fmt = model.weights_format()
    source = hf_dir or (str(model.dir) if (model.dir / "config.json").is_file() else None)
    if source is None:
        return {
            "name": cfg.model,
            "architecture": None,
            "num_layers": model.num_layers,
            "hidden_size": int(model.decoder.get("hidden_size", 0)) or None,
            "vocab_size": model.vocab_size,
            "config_hash": None,
            "weights_hash": None,
            "weights_format": fmt,
        }
    if hf_dir is not None:
        check_checkpoint_dir(hf_dir, ENGINE)
    ident = hf_identity(source, name=cfg.model, weights_format=fmt)
    ours = {
        "num_layers": model.num_layers,
        "hidden_size": model.decoder.get("hidden_size"),
        "vocab_size": model.vocab_size,
    }
    for key, value in ours.items():
        if ident.get(key) is not None and value is not None and int(ident[key]) != int(value):
            raise UsageError(
                f"--engine-arg hf_dir={source}: its {key} is {ident[key]} but {model.dir}'s genai "
                f"config says {value}; pass the checkpoint this ONNX model was built from"
            )
    return ident


def _load_generator_model(model: OrtModel) -> Any:
    import onnxruntime_genai as og

    try:
        return og.Model(str(model.dir))
    except Exception as e:  # noqa: BLE001 - the engine refusing the user's model directory
        raise ModelError(f"{model.dir}: ONNX Runtime GenAI cannot load it ({error_reason(e)})") from None


def _generator(og_model: Any, model: OrtModel, n_tokens: int) -> Any:
    """A fresh generator with room for ``n_tokens`` (one prompt, teacher-forced)."""
    import onnxruntime_genai as og

    try:
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=n_tokens)
        return og.Generator(og_model, params)
    except Exception as e:  # noqa: BLE001 - e.g. a prompt longer than the model's context_length
        raise ModelError(
            f"{model.dir}: ONNX Runtime GenAI cannot take a {n_tokens}-token prompt ({error_reason(e)})"
        ) from None


def _append(generator: Any, model: OrtModel, ids: list[int]) -> np.ndarray:
    """Append ``ids`` to the generator's sequence; return the logits of those positions [n, V]."""
    try:
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        return np.asarray(generator.get_output("logits"))[0]
    except Exception as e:  # noqa: BLE001 - the engine's forward boundary
        raise ModelError(f"{model.dir}: ONNX Runtime GenAI's forward pass failed ({error_reason(e)})") from None


def _info(model: OrtModel, hf_dir: str | None) -> EngineInfo:
    import onnxruntime
    import onnxruntime_genai as og

    quant = model.quantization()
    settings: dict[str, str | int | float | bool | None] = {
        "precision": model.weights_format().split(":", 1)[1],
        "dtype": model.activation_dtype,
        "execution_provider": ",".join(model.providers),
        "onnxruntime_version": onnxruntime.__version__,
        "attention": _attention_op(model),
        "hidden_states": "onnxruntime.InferenceSession, input_layernorm outputs",
        "hf_dir": hf_dir,
        **{f"quant_{k}": v for k, v in quant.items()},
    }
    return EngineInfo(
        name=ENGINE, version=getattr(og, "__version__", None), checkpoint=str(model.dir), settings=settings
    )


def _attention_op(model: OrtModel) -> str | None:
    """The graph's attention op (GroupQueryAttention, MultiHeadAttention, ...), recorded as the attention backend."""
    return next((n.op_type for n in model.graph.graph.node if n.op_type.endswith("Attention")), None)


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Prefill every prompt through ONNX Runtime GenAI (logprobs) and onnxruntime (hidden states); return the
    manifest."""
    opts = check_engine_args(cfg, ENGINE_ARGS)
    hf_dir = str(opts["hf_dir"]) if "hf_dir" in opts else None
    model = read_ort_model(cfg.model)
    _check_job(cfg, model)
    identity = _identity(cfg, model, hf_dir)
    seqs = job_sequences(cfg, hf_dir if hf_dir is not None else model.dir, model.vocab_size)
    runner = HiddenRunner(model, parse_layer_spec(cfg.layers, model.num_layers))  # before any output is written
    og_model = _load_generator_model(model) if cfg.logprobs is not None else None
    info = _info(model, hf_dir)
    extra = {"onnx_model": str(model.onnx_path), "tokenizer": str(hf_dir or model.dir)}
    done, total = 0, sum(map(len, seqs))
    with (
        torch.inference_mode(),
        EngineDump(cfg, info, identity, num_layers=model.num_layers, seqs=seqs, extra=extra) as out,
    ):
        for seq_id, ids in enumerate(seqs):
            generator = None if og_model is None else _generator(og_model, model, len(ids))
            step = cfg.chunk_size or len(ids)
            past = None
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                hidden, _, past = runner.run(chunk, start, past)
                positions = torch.arange(start, start + len(chunk))
                for layer, x in hidden.items():  # x [chunk, hidden]
                    out.hidden(
                        layer, torch.from_numpy(np.ascontiguousarray(x)), positions, torch.full((len(chunk),), seq_id)
                    )
                if generator is not None:
                    out.logits(seq_id, ids, torch.from_numpy(_append(generator, model, chunk)), first=start)
                out.step()
            done += len(ids)
            if progress is not None:
                progress(done, total)
    return out.manifest()
