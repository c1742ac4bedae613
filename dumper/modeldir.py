"""Reading a local HF model directory: the one checked way in, for every loader and engine.

A model directory is a download, so it is read as data and never run: a directory that names
custom code is refused instead of being loaded or asked about. :func:`check_model_dir` runs
before transformers (or an engine) opens anything in it:

* ``config.json`` is a regular file of at most :data:`CONFIG_LIMIT` bytes, opened non-blocking
  and refused by its size before it is read, then parsed with the bounded JSON parser. It is
  an object with a ``model_type`` string and no negative size or count.
* Custom code: an ``auto_map`` (or ``custom_pipelines``) in ``config.json`` or
  ``tokenizer_config.json`` is refused naming the file, before anything prompts on stdin.
* No entry of the directory is a FIFO, socket or device (transformers would block opening
  it), and no metadata file (``.json``, ``.txt``, ``.model``, ``.jinja``, ``.tiktoken``) is
  over :data:`METADATA_LIMIT` bytes.

Every transformers call passes :data:`HF_LOAD` (``trust_remote_code=False``, local files
only), so what the checks miss transformers refuses; it never asks. Before a model is built,
:func:`load_causal_lm` also checks that its config describes about what the weight files hold
(a hand-edited ``vocab_size`` would otherwise allocate what the machine does not have).

Example::

    from dumper.modeldir import check_model_dir, load_causal_lm
    config = check_model_dir("ckpt")          # the parsed config.json, or a one-line ModelError
    model = load_causal_lm("ckpt", dtype=torch.float32, attn="eager")
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dumper.errors import CorruptDumpError, ModelError, error_reason
from dumper.format.files import READ_FLAGS, file_kind, parse_json, printable, read_regular_file, show
from dumper.format.reader import read_safetensors_header

__all__ = [
    "CONFIG_LIMIT",
    "METADATA_LIMIT",
    "HF_LOAD",
    "TOKENIZER_FILES",
    "check_model_dir",
    "has_tokenizer",
    "load_config",
    "load_causal_lm",
    "load_hf_tokenizer",
    "held_transformers_logs",
]

CONFIG_LIMIT = 16 << 20
"""Largest ``config.json`` read (real ones are a few KB)."""
METADATA_LIMIT = 64 << 20
"""Largest tokenizer or other metadata file in a model directory (the largest real ``tokenizer.json`` is ~35 MB)."""
HF_LOAD: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
"""What every ``from_pretrained``/``from_config`` call passes: no network, never the directory's code."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "special_tokens_map.json",
)
"""A directory with none of these has no tokenizer."""
NO_CODE = "driftscope never runs code from a model directory"

_CODE_KEYS = ("auto_map", "custom_pipelines")
_METADATA = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_SIZE_KEY = re.compile(r"^(num|n)_|_(size|dim|layers|heads|embeddings|positions)$")
"""Config keys that hold a count or a size (``hidden_size``, ``num_hidden_layers``, ``n_embd``, ...)."""
_MODULE_COUNT = re.compile(r"(^|_)(layers?|experts?)$")
"""Config keys whose value is a number of modules to build (``num_hidden_layers``, ``n_layer``, ``num_experts``)."""
_SLACK = 16 << 20
"""Values a config may describe beyond what the weight files hold (buffers, heads initialized afresh)."""


def check_model_dir(path: str | os.PathLike[str], *, config_required: bool = True) -> dict[str, Any] | None:
    """The parsed ``config.json`` of the model directory ``path``, after every check above.

    Without ``config_required`` a directory with no ``config.json`` (a tokenizer alone) passes
    and gives None. A directory that fails a check raises :class:`ModelError` naming the file.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelError(f"{path}: not a directory; a HF model directory holds config.json and the weights")
    config_path = root / "config.json"
    config = None
    if os.path.lexists(config_path):
        config = _read_object(config_path, CONFIG_LIMIT, "model config")
        if not isinstance(config.get("model_type"), str) or not config["model_type"]:
            raise ModelError(f'{config_path}: no "model_type" string (the architecture family, e.g. "llama")')
        _check_values(config_path, config)
    elif config_required:
        raise ModelError(f"{path}: not a HF model directory (no config.json)")
    for name, what in (("tokenizer_config.json", "tokenizer config"), ("special_tokens_map.json", "tokenizer map")):
        if os.path.lexists(root / name):  # both feed the tokenizer's arguments
            obj = _read_object(root / name, METADATA_LIMIT, what)
            _check_values(root / name, obj)
            _check_paths(root, root / name, obj)
    _check_entries(root)
    return config


def _check_paths(root: Path, path: Path, obj: dict[str, Any]) -> None:
    """Refuse a ``*_file`` value that names an existing file outside the model directory: transformers would open
    it (``tokenizer_file`` in ``special_tokens_map.json`` goes straight to the tokenizer), and driftscope reads
    nothing outside the directory it was given. A stale path of another machine, which exists nowhere, is left."""
    inside = root.resolve()
    for dotted, key, value in _walk(obj):
        if not (key.endswith("_file") and isinstance(value, str) and value):
            continue
        target = Path(value) if os.path.isabs(value) else root / value
        try:
            real = target.resolve()
            exists = real.exists()
        except (OSError, RuntimeError, ValueError):
            continue
        if exists and not real.is_relative_to(inside):
            raise ModelError(
                f"{path}: {printable(dotted)} names {printable(value)!r}, outside the model directory; "
                "driftscope reads nothing outside the directory it was given (remove the entry)"
            )


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    """Whether the directory holds any of :data:`TOKENIZER_FILES`."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _check_entries(root: Path) -> None:
    """No FIFO, socket or device in the directory, no metadata file over :data:`METADATA_LIMIT` (never opened)."""
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                try:
                    st = os.stat(entry.path)  # through a symlink: an HF cache snapshot links every file
                except (OSError, ValueError):
                    continue  # a dangling link: the loader names it if it needs the file
                where = root / entry.name
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    raise ModelError(
                        f"{printable(str(where))}: {file_kind(st.st_mode)} in the model directory; "
                        "refusing to load it (only regular files are read)"
                    )
                if stat.S_ISREG(st.st_mode) and entry.name.endswith(_METADATA) and st.st_size > METADATA_LIMIT:
                    raise ModelError(
                        f"{printable(str(where))}: {st.st_size} bytes, over the {METADATA_LIMIT >> 20} "
                        "MiB limit of a model directory's metadata file"
                    )
    except OSError as e:
        raise ModelError(f"{root}: cannot list the model directory ({e.strerror})") from None


def _read_object(path: Path, limit: int, what: str) -> dict[str, Any]:
    """A JSON object read with the untrusted-file helpers (non-blocking, size-capped, bounded parse)."""
    try:
        raw = parse_json(read_regular_file(path, limit, what), str(path), what)
    except CorruptDumpError as e:
        raise ModelError(str(e)) from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _walk(obj: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(dotted key, key, value) of every key in ``obj`` and its nested objects, without recursion."""
    stack: list[tuple[str, dict[str, Any]]] = [("", obj)]
    while stack:
        prefix, d = stack.pop()
        for key, value in d.items():
            yield prefix + key, key, value
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))


def _check_values(path: Path, obj: dict[str, Any]) -> None:
    """Refuse custom code anywhere in ``obj``, and a negative size or count (reported deep in a layer otherwise)."""
    for dotted, key, value in _walk(obj):
        if key in _CODE_KEYS and value:
            raise ModelError(
                f"{path}: names custom code ({printable(dotted)}: {show(value)}); {NO_CODE} (remove "
                f'"{key}" to load the architecture transformers ships, if it has one)'
            )
        if isinstance(value, int) and not isinstance(value, bool) and value < 0 and _SIZE_KEY.search(key):
            raise ModelError(f"{path}: {printable(dotted)} is {value}; a size or count must be >= 0")


def _weights(root: Path) -> tuple[int, int] | None:
    """(tensors, values) the weight files hold: counted in safetensors headers, bounded by size otherwise.

    None when the directory has no weight file (the loader then says so). A ``.bin`` counts one
    value per byte and one tensor per KiB, both more than it can hold.
    """
    tensors = values = 0
    found = False
    for entry in sorted(os.listdir(root)):
        path = root / entry
        if entry.endswith(".safetensors") and path.is_file():
            n, v = _safetensors_size(path)
        elif entry.endswith((".bin", ".pt", ".pth")) and path.is_file():
            size = path.stat().st_size
            n, v = max(1, size >> 10), size
        else:
            continue
        found, tensors, values = True, tensors + n, values + v
    return (tensors, values) if found else None


def _safetensors_size(path: Path) -> tuple[int, int]:
    """(tensors, values) of one safetensors file, from its header alone (read as a dump's is)."""
    try:
        with os.fdopen(os.open(path, READ_FLAGS), "rb") as f:
            header, _, _ = read_safetensors_header(f, path)
    except OSError as e:
        raise ModelError(f"{path}: cannot read the weights ({e.strerror})") from None
    except CorruptDumpError as e:
        raise ModelError(str(e)) from None
    shapes = (
        [v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
        if isinstance(header, dict)
        else []
    )
    shapes = [s for s in shapes if isinstance(s, list) and all(type(d) is int and d >= 0 for d in s)]
    return len(shapes), sum(math.prod(s) for s in shapes)


def _check_fits(root: Path, raw: dict[str, Any], skeleton: Any) -> None:
    """Refuse a config that describes far more than the weight files hold, before anything is allocated.

    ``skeleton`` builds the model on the meta device (no memory); a module count (layers,
    experts) above the files' tensor count is refused before it is built at all.
    """
    held = _weights(root)
    if held is None:
        return  # no weights to compare with: the loader says so
    tensors, values = held
    packed = 8 if raw.get("quantization_config") else 1  # a quantized file packs up to 8 values in one (int4 in int32)
    for dotted, key, value in _walk(raw):
        if type(value) is int and _MODULE_COUNT.search(key) and value > max(256, tensors):
            raise ModelError(
                f"{root / 'config.json'}: {printable(dotted)} is {value}, but the weight files hold "
                f"{tensors} tensors; refusing to build a model the weights cannot fill"
            )
    model = skeleton()
    described = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    if described > packed * values + values // 4 + _SLACK:
        raise ModelError(
            f"{root / 'config.json'}: describes a model of {described:,} values, but the weight files "
            f"hold {values:,}; refusing to allocate it (a size edited by hand?)"
        )


@contextlib.contextmanager
def held_transformers_logs(held: list[logging.LogRecord]) -> Iterator[None]:
    """Hold transformers' log lines and progress bars while loading: replayed on success, dropped on failure.

    A failed load is then one line (its reason is in the error), while a loaded model still
    shows transformers' warnings (say, weights that were missing and got initialized).
    """
    from transformers.utils import logging as hf_logging

    root = hf_logging.get_logger()
    handler = logging.Handler()
    handler.emit = held.append  # type: ignore[method-assign]
    handlers, bars = root.handlers[:], hf_logging.is_progress_bar_enabled()
    for h in handlers:
        root.removeHandler(h)
    root.addHandler(handler)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        root.removeHandler(handler)
        for h in handlers:
            root.addHandler(h)
        if bars:
            hf_logging.enable_progress_bar()
    for record in held:  # only after a successful load, as plain text (the load report is coloured)
        record.msg, record.args = _plain(record.getMessage()), ()
        root.handle(record)


def _plain(text: str) -> str:
    """``text`` without terminal colours, other control characters but newline and tab escaped."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", _ANSI.sub("", text))


def load_config(path: str | os.PathLike[str]) -> Any:
    """The directory's ``PretrainedConfig`` (checked first; transformers' own classes only)."""
    check_model_dir(path)
    from transformers import AutoConfig

    try:
        with held_transformers_logs([]):
            return AutoConfig.from_pretrained(str(path), **HF_LOAD)
    except Exception as e:  # noqa: BLE001 - the load boundary
        raise ModelError(f"{path}: cannot read its config ({error_reason(e)})") from None


def load_causal_lm(path: str | os.PathLike[str], *, dtype: Any, attn: str) -> Any:
    """The directory's causal LM in ``dtype`` (a ``torch.dtype``), checked first and built by transformers.

    Anything transformers raises while building it is a :class:`ModelError` naming the
    directory, with the first row of transformers' load report when it printed one.
    """
    raw = check_model_dir(path)  # before transformers is imported: a refusal costs no import
    assert raw is not None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    held: list[logging.LogRecord] = []
    try:  # anything transformers raises while building this directory's model is about the model
        with held_transformers_logs(held):
            config = AutoConfig.from_pretrained(str(path), **HF_LOAD)

            def skeleton() -> Any:  # on a copy: building may set attributes of the config
                with torch.device("meta"):
                    return AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=False)

            _check_fits(Path(path), raw, skeleton)
            return AutoModelForCausalLM.from_pretrained(
                str(path), config=config, dtype=dtype, attn_implementation=attn, **HF_LOAD
            )
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - the load boundary: no driftscope code runs inside
        detail = _load_report_row(held)
        raise ModelError(f"{path}: cannot load model ({error_reason(e)}{'; ' + detail if detail else ''})") from None


def load_hf_tokenizer(path: str | os.PathLike[str]) -> Any | None:
    """The directory's transformers tokenizer (checked first), or None when it has no tokenizer files."""
    check_model_dir(path, config_required=False)
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        with held_transformers_logs([]):
            return AutoTokenizer.from_pretrained(str(path), **HF_LOAD)
    except Exception as e:  # noqa: BLE001 - the load boundary, as for the model
        raise ModelError(
            f"{path}: cannot load its tokenizer ({error_reason(e)}); fix or remove the tokenizer files"
        ) from None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*(MISMATCH|MISSING|UNEXPECTED)\s*\|\s*(.*?)\s*$")


def _load_report_row(held: list[logging.LogRecord]) -> str | None:
    """The first weight row of transformers' load report (its errors say "look at the above report")."""
    for record in held:
        for line in _ANSI.sub("", record.getMessage()).splitlines():
            m = _REPORT_ROW.match(line.strip())
            if m:
                return f"{m[1]} {m[2]}{': ' + m[3] if m[3] else ''}"
    return None
