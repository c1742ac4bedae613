"""Who computed a dump: the environment fingerprint and the model identity.

Logprobs and hidden states depend on the GPU model, kernels and torch version, so a dump
records them; a baseline is only meaningful against a target from the same environment.
"""

from __future__ import annotations

import hashlib
import json
import platform
import weakref
from typing import Any

import torch

from dumper.version import __version__ as VERSION

__all__ = ["environment_fingerprint", "model_identity", "config_identity", "config_hash", "weights_hash"]


def environment_fingerprint(
    device: torch.device | str | None = None, attn_implementation: str | None = None
) -> dict[str, Any]:
    """Software and hardware facts that change numerics (torch, CUDA/cuDNN, device name, ...)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    env: dict[str, Any] = {
        "driftscope": VERSION,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device_type": dev.type,
        "attn_implementation": attn_implementation,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        env["transformers"] = None
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        env["device_name"] = torch.cuda.get_device_name(idx)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["cuda"] = None
        env["cudnn"] = None
    return env


def config_hash(config: Any) -> str | None:
    """A stable hash of a HF config (``to_dict()``), ignoring fields that do not change numerics."""
    if config is None:
        return None
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for k in (
        "_name_or_path",
        "transformers_version",
        "_attn_implementation",
        "attn_implementation",
        "torch_dtype",
        "dtype",
        "_commit_hash",
        "architectures",
    ):
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_WEIGHTS_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str | None]] = weakref.WeakKeyDictionary()


def weights_hash(module: torch.nn.Module, *, max_bytes: int = 256 << 20) -> str | None:
    """A hash of all parameters and buffers, or ``None`` when the model is too big to hash cheaply.

    Cached per module until a tensor is replaced or modified in place (``_version`` changes),
    so repeated captures of the same model do not pay for it again.
    """
    state = list(module.state_dict(keep_vars=True).items())
    key = tuple((name, t.data_ptr(), t._version) for name, t in state)
    cached = _WEIGHTS_CACHE.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    total = sum(t.numel() * t.element_size() for _, t in state)
    digest = None
    if total <= max_bytes:
        h = hashlib.sha256()
        for name, t in state:
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        digest = h.hexdigest()[:16]
    _WEIGHTS_CACHE[module] = (key, digest)
    return digest


def _config_int(config: Any, *names: str) -> int | None:
    """The first of ``names`` that the config holds as an int (HF spells sizes per family)."""
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def model_identity(model: torch.nn.Module | None, name: str | None = None) -> dict[str, Any]:
    """Model name/path, architecture, sizes, and config and weights hashes (weights only when cheap).

    ``architecture``, ``num_layers``, ``hidden_size`` and ``config_hash`` say *which model* this
    is: the comparator refuses to compare dumps that differ in them (see
    :mod:`comparator.judging.identity`). Run settings (dtype, attention implementation, device) are
    not identity and are left out of the hash.
    """
    if model is None:
        return {"name": name, "config_hash": None, "weights_hash": None}
    config = getattr(model, "config", None)
    return {
        **config_identity(
            config, name or getattr(config, "_name_or_path", None) or type(model).__name__, type(model).__name__
        ),
        "weights_hash": weights_hash(model),
    }


def config_identity(config: Any, name: str | None, architecture: str | None) -> dict[str, Any]:
    """The identity fields a HF config gives (all of :func:`model_identity` but the weights hash).

    Engine adapters that load a checkpoint themselves build the same identity from its config
    (``dumper.engines.base.hf_identity``), so the comparator's identity check agrees with the HF dump.
    """
    return {
        "name": name,
        "architecture": architecture,
        "num_layers": _config_int(config, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": _config_int(config, "hidden_size", "n_embd", "d_model"),
        "vocab_size": _config_int(config, "vocab_size"),
        "config_hash": config_hash(config),
    }
