"""llama.cpp (llama-cpp-python's low-level API): dump a GGUF model's layer inputs and logprobs.

``python -m dumper run --engine llama.cpp --model M.gguf --input-ids ... --layers all --logprobs``
feeds the job's token ids (never llama.cpp's own split of a text) to ``llama_decode``, copies
each layer's ``attn_norm-i`` (HF's ``self_attn`` input) out of the graph, and scores every
position from its logits row. ``--points router`` (or ``input,router``) records each MoE layer's
routing as ``model.layers.{i}.router.{logits,ids,weights}`` (see
:data:`dumper.engines.llama_cpp_ggml.ROUTER_STAGES` for the graph tensors they come from).
Prompts go ``--batch-size`` at a time as separate sequences of one batch, each batch in one
decode or in ``--chunk-size`` token chunks through the KV cache. ``--new-tokens N`` then
greedy-decodes N tokens per prompt, one ``llama_decode`` of one token per sequence a step, each
step recorded (:mod:`dumper.prefill.decode`).

``--engine-arg`` keys (:data:`ENGINE_ARGS`): ``kv=f32|f16|bf16`` (KV-cache dtype, default f32 so
that a clean run is clean), ``threads=N`` (default torch's thread count), ``flash_attn=off|on|auto``
(default off), ``hf_dir=DIR`` (the HF checkpoint the GGUF came from: its tokenizer encodes text
prompts and its config gives the identity, so the comparator checks it against the HF dump),
``verbose=true`` (show llama.cpp's log).

Example::

    python -m dumper run --engine llama.cpp --model m-q8_0.gguf --engine-arg hf_dir=ckpt \
        --layers all --logprobs --out llama_dump
    python -m comparator hf_dump llama_dump
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
from dumper.engines.llama_cpp_ggml import (
    FLASH_ATTN,
    GGML_NODES,
    GGML_TYPE,
    GgufSession,
    check_gguf_file,
    file_type_name,
)
from dumper.errors import UsageError
from dumper.format import ROUTER_POINT, Manifest
from dumper.format.points import order_in_layer
from dumper.hooks.layers import parse_layer_spec
from dumper.prefill.decode import greedy_loop
from dumper.prefill.run import RunConfig
from dumper.progress import ProgressFn

__all__ = ["ENGINE_ARGS", "HF_ARCHITECTURES", "run_dump"]

ENGINE_ARGS = {
    "kv": EngineArg("the KV-cache dtype; default f32", "choice", tuple(GGML_TYPE)),
    "threads": EngineArg("CPU threads; default torch.get_num_threads()", "int", high=1024),
    "flash_attn": EngineArg("flash attention; default off", "choice", tuple(FLASH_ATTN)),
    "hf_dir": EngineArg("the HF checkpoint directory the GGUF was converted from (tokenizer and identity)", "path"),
    "verbose": EngineArg("show llama.cpp's log on stderr; default false", "bool"),
}
"""``--engine-arg`` keys ``--engine llama.cpp`` takes, and their values."""

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo": "OlmoForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
}
"""GGUF ``general.architecture`` -> the HF class it was converted from (where one name is known)."""


def _settings(cfg: RunConfig) -> dict[str, Any]:
    """The parsed ``--engine-arg`` values with their defaults (each checked, one-line errors)."""
    opts = check_engine_args(cfg, ENGINE_ARGS)
    kv, fa = str(opts.get("kv", "f32")), str(opts.get("flash_attn", "off"))
    if cfg.dtype not in ("float32", "fp32"):
        raise UsageError(
            f"--dtype {cfg.dtype}: llama.cpp computes with the GGUF file's types; pick the precision "
            "when converting (convert_hf_to_gguf.py --outtype f32|f16|q8_0)"
        )
    if cfg.modules:
        raise UsageError("--modules: --engine llama.cpp captures the layers' self_attn inputs only (use --layers)")
    hf_dir = opts.get("hf_dir")
    return {
        "kv": kv,
        "kv_type": GGML_TYPE[kv],
        "flash_attn": fa,
        "flash_attn_type": FLASH_ATTN[fa],
        "threads": int(opts.get("threads") or torch.get_num_threads()),
        "verbose": bool(opts.get("verbose")),
        "hf_dir": str(check_checkpoint_dir(str(hf_dir), "llama.cpp")) if hf_dir else None,
    }


def _identity(s: GgufSession, hf_dir: str | None) -> dict[str, Any]:
    """The model identity: the HF config's (same config_hash as the HF dump) when ``hf_dir`` is given."""
    ftype, arch = file_type_name(s.ftype), s.meta("general.architecture") or "unknown"
    facts = {"weights_format": f"gguf:{ftype}", "gguf_architecture": arch, "gguf_file_type": ftype}
    if hf_dir is None:
        return {
            "name": str(s.path),
            "architecture": HF_ARCHITECTURES.get(arch, f"gguf:{arch}"),
            "num_layers": s.n_layer,
            "hidden_size": s.n_embd,
            "vocab_size": s.n_vocab,
            "config_hash": None,
            "weights_hash": None,
            **facts,
        }
    ident = hf_identity(hf_dir, name=str(s.path), **facts)
    for key, gguf in (("num_layers", s.n_layer), ("hidden_size", s.n_embd), ("vocab_size", s.n_vocab)):
        if ident.get(key) is not None and ident[key] != gguf:
            raise UsageError(
                f"--engine-arg hf_dir={hf_dir}: not the checkpoint of {s.path} "
                f"({key} {ident[key]} in its config.json, {gguf} in the GGUF)"
            )
    return ident


def _sequences(cfg: RunConfig, s: GgufSession, hf_dir: str | None) -> list[list[int]]:
    if hf_dir is None and (cfg.prompts or not cfg.input_ids):
        raise UsageError(
            f"{cfg.model}: text prompts need --engine-arg hf_dir=DIR (the HF tokenizer; llama.cpp's "
            "own splits text differently), or pass --input-ids"
        )
    return job_sequences(cfg, hf_dir, s.n_vocab)


def _decodes(batch: Sequence[Sequence[int]], chunk: int | None) -> list[list[tuple[int, int, int]]]:
    """The decodes of one prompt batch: lists of (batch row, start, end) token ranges, chunk by chunk."""
    longest = max(map(len, batch))
    step = chunk or longest
    return [
        [(row, start, min(start + step, len(ids))) for row, ids in enumerate(batch) if start < len(ids)]
        for start in range(0, longest, step)
    ]


def _no_moe(cfg: RunConfig, layers: Sequence[int], why: str) -> UsageError:
    """The one-line error of ``--points router`` on a model with no MoE layer among ``layers``."""
    return UsageError(
        f"--points {ROUTER_POINT}: {cfg.model} has no MoE layer among layers {','.join(map(str, layers))} ({why})"
    )


def _record_pass(out: EngineDump, got: Any, positions: torch.Tensor, seq_ids: torch.Tensor) -> None:
    for point, layer in sorted(got.hidden, key=lambda k: (k[1], order_in_layer(k[0]))):
        out.hidden(layer, got.hidden[point, layer], positions, seq_ids, point=point)
    for layer, parts in sorted(got.router.items()):
        out.router(layer, parts, positions, seq_ids)


def _decode_steps(
    s: GgufSession,
    out: EngineDump,
    batch: list[list[int]],
    first: int,
    last: torch.Tensor,
    sets: tuple[set[tuple[str, int]], set[int]],
) -> list[list[int]]:
    """Greedy-decode ``--new-tokens`` tokens per prompt after the batch's prefill (``last``: each row's last logits
    row, :func:`~dumper.prefill.decode.greedy_loop`); each step is one ``llama_decode`` of one token per sequence.
    Returns the tokens."""
    rows = list(range(len(batch)))
    seq_ids = torch.tensor(rows, dtype=torch.int64) + first

    def feed(step: int, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out.decode_step(step)
        got = s.decode(token.tolist(), positions.tolist(), rows, want=sets[0], router=sets[1])
        _record_pass(out, got, positions, seq_ids)
        out.step()
        out.decode_step(None)
        return got.logits

    return greedy_loop(
        last,
        torch.tensor([len(p) - 1 for p in batch], dtype=torch.int64),
        out.cfg.new_tokens,
        lambda logits, token, positions: out.next_logprobs(logits, token, positions, seq_ids.tolist()),
        feed,
    )


def _run_batch(
    s: GgufSession, out: EngineDump, batch: list[list[int]], first: int, chunk: int | None, points: tuple[str, ...]
) -> list[list[int]]:
    """Prefill prompts ``first ..`` as KV sequences 0.. of one batch; record hidden states, routing, logprobs; then
    its ``--new-tokens`` decode steps. Returns the tokens each prompt generated."""
    keep = [layer for layer in range(s.n_layer) if out.wants(layer)]
    want = {(point, layer) for point in points if point in GGML_NODES for layer in keep}
    router = set(keep) if ROUTER_POINT in points else set()
    last = torch.zeros(len(batch), s.n_vocab)
    s.clear()
    for ranges in _decodes(batch, chunk):
        tokens = [t for row, a, b in ranges for t in batch[row][a:b]]
        positions = torch.tensor([p for _, a, b in ranges for p in range(a, b)], dtype=torch.int64)
        rows = [row for row, a, b in ranges for _ in range(a, b)]
        got = s.decode(tokens, positions.tolist(), rows, want=want, router=router)
        if router and not got.router:
            raise _no_moe(out.cfg, keep, "their llama.cpp graphs have no ffn_moe_logits")
        _record_pass(out, got, positions, torch.tensor(rows, dtype=torch.int64) + first)
        offset = 0
        for row, a, b in ranges:
            out.logits(first + row, batch[row], got.logits[offset : offset + b - a], first=a)
            if b == len(batch[row]):
                last[row] = got.logits[offset + b - a - 1]
            offset += b - a
        out.step()
    return _decode_steps(s, out, batch, first, last, (want, router)) if out.cfg.new_tokens else []


def run_dump(cfg: RunConfig, *, progress: ProgressFn | None = None) -> Manifest:
    """Prefill ``cfg``'s prompts through llama.cpp and write the dump; return its manifest."""
    opts = _settings(cfg)
    check_gguf_file(cfg.model)
    import llama_cpp  # only once the arguments and the file are known to be good

    with GgufSession.open(cfg.model, verbose=opts["verbose"]) as s:
        if ROUTER_POINT in cfg.points and s.n_expert == 0:
            raise _no_moe(cfg, parse_layer_spec(cfg.layers, s.n_layer), f"GGUF {s.arch}.expert_count is 0")
        ident = _identity(s, opts["hf_dir"])
        seqs = _sequences(cfg, s, opts["hf_dir"])
        batches = [seqs[i : i + cfg.batch_size] for i in range(0, len(seqs), cfg.batch_size)]
        n_ctx = max(sum(len(p) + cfg.new_tokens for p in b) for b in batches)
        n_batch = max(sum(b - a for _, a, b in r) for bt in batches for r in _decodes(bt, cfg.chunk_size))
        s.new_context(
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_seqs=min(cfg.batch_size, len(seqs)),
            threads=opts["threads"],
            kv_type=opts["kv_type"],
            flash_attn=opts["flash_attn_type"],
        )
        settings = {
            "file_type": file_type_name(s.ftype),
            "kv_cache_dtype": opts["kv"],
            "threads": opts["threads"],
            "flash_attn": opts["flash_attn"],
            "n_ctx": n_ctx,
            "n_batch": n_batch,
            "extra_bufts": False,
        }
        info = EngineInfo("llama.cpp", getattr(llama_cpp, "__version__", None), str(s.path), settings)
        done, total = 0, sum(map(len, seqs))
        with EngineDump(cfg, info, ident, num_layers=s.n_layer, seqs=seqs, extra={"hf_dir": opts["hf_dir"]}) as out:
            generated = []
            for i, batch in enumerate(batches):
                generated += _run_batch(s, out, batch, i * cfg.batch_size, cfg.chunk_size, cfg.points)
                done += sum(map(len, batch))
                if progress is not None:
                    progress(done, total)
            if cfg.new_tokens:
                out.generated(generated)
        return out.manifest()
