"""Tiny real checkpoints for the engine tests: an HF Llama directory with an offline-trained tokenizer.

The engines load checkpoints from disk, so the tests write one: random float32 weights under
a fixed seed, and a Llama-2-style BPE tokenizer (byte fallback, ``▁`` for spaces) trained by
``tokenizers`` on a fixed text, which llama.cpp's ``convert_hf_to_gguf.py`` and ONNX Runtime
GenAI's model builder both accept. Sizes are the smallest that vLLM's CPU attention takes
(head_dim 32).

``python tests/engine_models.py DIR`` writes one by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "build_checkpoint",
    "build_moe_checkpoint",
    "MOE_CONFIG",
    "CORPUS",
    "llama_cpp_dir",
    "to_gguf",
    "engine_missing",
    "ENGINE_MODULES",
]

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Inference engines change every day: a new attention "
    "backend, a fused kernel, another chunked prefill cut, a radix cache that reuses keys and values. "
    "Each of these can shift the numerics without raising an error; the model just gets a little worse. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n"
    "Layer by layer and token by token, a comparison says where two runs of one model part ways. "
)
CORPUS = tuple(_TEXT.replace(".", f" {i}.") for i in range(64))
"""Training text of the tokenizer: fixed, so every machine trains the same vocabulary."""

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""The tiny Llama: 4 layers, hidden 128, GQA 4/2 heads of 32 (vocab_size comes from the tokenizer)."""

MOE_CONFIG = {
    **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "intermediate_size")},
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "sliding_window": None,
}
"""The tiny Mixtral: the tiny Llama's attention, 8 experts of width 64 per layer, top-2."""

ENGINE_MODULES = {"vllm": "vllm", "llama.cpp": "llama_cpp", "onnxruntime-genai": "onnxruntime_genai", "ray": "ray"}


def _train_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(CORPUS, BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
    )
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # a llama tokenizer: bos prepended, as llama.cpp assumes
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        {
            "tokenizer_class": "LlamaTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "add_prefix_space": None,
        }
    )
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


def _write_checkpoint(
    out: str | os.PathLike[str],
    config_cls: type,
    model_cls: type,
    base: dict[str, object],
    *,
    seed: int,
    vocab_size: int,
    overrides: dict[str, object],
) -> Path:
    """Train the tokenizer into ``out``, build ``model_cls`` from ``base`` + overrides under ``seed``, save it
    (float32)."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(out, vocab_size)
    config = config_cls(**{**base, "vocab_size": vocab, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    gen.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}))
    return out


def build_checkpoint(out: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512, **overrides: object) -> Path:
    """Write a tiny random-weight Llama (float32 safetensors, config, tokenizer) to ``out``; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _write_checkpoint(
        out, LlamaConfig, LlamaForCausalLM, CONFIG, seed=seed, vocab_size=vocab_size, overrides=overrides
    )


def build_moe_checkpoint(
    out: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512, **overrides: object
) -> Path:
    """Write a tiny random-weight Mixtral (:data:`MOE_CONFIG`, float32 safetensors, tokenizer) to ``out``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _write_checkpoint(
        out, MixtralConfig, MixtralForCausalLM, MOE_CONFIG, seed=seed, vocab_size=vocab_size, overrides=overrides
    )


def llama_cpp_dir() -> Path | None:
    """llama.cpp's source tree (convert_hf_to_gguf.py) as ``.ci/install-engines.sh`` leaves it, or None."""
    base = Path(os.environ.get("DRIFTSCOPE_ENGINES_DIR", ROOT / ".engines"))
    tree = base / "llama.cpp"
    return tree if (tree / "convert_hf_to_gguf.py").is_file() else None


def llama_tool(name: str) -> Path | None:
    """A llama.cpp tool binary (``llama-perplexity``) built by ``.ci/install-engines.sh``, or None."""
    base = Path(os.environ.get("DRIFTSCOPE_ENGINES_DIR", ROOT / ".engines"))
    exe = base / "llama-build" / "bin" / name
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def to_gguf(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str = "f32") -> Path:
    """Convert an HF directory to GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (f32, f16, q8_0)."""
    tree = llama_cpp_dir()
    if tree is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py not found; run bash .ci/install-engines.sh")
    subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out), "--outtype", outtype],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return Path(out)


def engine_missing(name: str) -> str | None:
    """Why the engine ``name`` cannot be tested here, or None when it is installed.

    In CI (``CI=true``) a missing engine is a failure, not a skip: the caller raises.
    """
    import importlib.util

    module = ENGINE_MODULES[name]
    if importlib.util.find_spec(module) is None:
        return f"{name} is not installed (bash .ci/install-engines.sh installs it)"
    if name == "llama.cpp" and llama_cpp_dir() is None:
        return "llama.cpp's source tree is not under .engines/ (bash .ci/install-engines.sh puts it there)"
    return None


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if target.exists():
        shutil.rmtree(target)
    print(build_checkpoint(target))
