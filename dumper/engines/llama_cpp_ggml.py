"""A llama.cpp model and context through llama-cpp-python's low-level ctypes API, with hidden-state capture.

llama.cpp names the tensors of its compute graph (``attn_norm-3`` is layer 3's RMSNorm output,
the input of its attention, i.e. HF's ``self_attn`` input; :data:`GGML_NODES` for the points inside
a layer). The context's ``cb_eval`` callback
is asked about every graph node before it runs (``ask=True``: do you want this tensor?) and,
for the ones we want, called again once it is computed (``ask=False``), when we copy it off
the backend with ``ggml_backend_tensor_get``. :class:`GgufSession` wraps that: one decode of a
token batch returns the captured tensors and every position's logits.

Example::

    with GgufSession.open("m.gguf", verbose=False) as s:
        s.new_context(n_ctx=64, n_batch=64, n_seqs=1, threads=2, kv_type=GGML_TYPE["f32"])
        got = s.decode(tokens, positions, seqs, want={("input", 0), ("mlp_output", 3)}, router={0, 3})
        got.hidden["mlp_output", 3], got.logits, got.router[3]["router.ids"]  # [n, hidden], [n, vocab], [n, k] int32

MoE routing comes from the tensors ``build_moe_ffn`` (src/llama-graph.cpp) names per layer
(:data:`ROUTER_STAGES`): the gate output ``ffn_moe_logits`` [E, n], the top-k ids ``ffn_moe_topk``
(an I32 view [k, n] of the descending ``ffn_moe_argsort``, read through its strides) and the
combine weights, whichever of ``ffn_moe_weights`` -> ``_softmax`` -> ``_norm`` -> ``_scaled``
is the graph's last (the one it multiplies the expert outputs by).
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dumper.errors import ModelError, UsageError
from dumper.format import ROUTER_IDS, ROUTER_LOGITS, ROUTER_SCORES, ROUTER_WEIGHTS
from dumper.format.files import READ_FLAGS, file_kind
from dumper.format.points import ATTN_OUTPUT, INPUT, MLP_INPUT, MLP_OUTPUT

__all__ = [
    "FLASH_ATTN",
    "GGML_TYPE",
    "GGML_NODES",
    "ROUTER_STAGES",
    "Decoded",
    "GgufSession",
    "check_gguf_file",
    "file_type_name",
]

GGML_TYPE = {"f32": 0, "f16": 1, "bf16": 30}
"""KV-cache dtypes this adapter offers (``--engine-arg kv=``) -> ggml type id."""
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
"""``--engine-arg flash_attn=`` -> llama_flash_attn_type."""
_NUMPY = {0: np.float32, 1: np.float16, 26: np.int32}
"""ggml types of captured tensors we can read (F32, F16, I32) -> numpy dtype."""
GGML_NODES: dict[str, tuple[str, ...]] = {
    INPUT: ("attn_norm",),
    ATTN_OUTPUT: ("attn_out",),
    MLP_INPUT: ("ffn_norm",),
    MLP_OUTPUT: ("ffn_out", "ffn_moe_out"),
}
"""The graph nodes (``{node}-{layer}``) each hidden-state capture point reads, the first the graph has: the RMSNorm
output before attention (HF's ``self_attn`` input), the attention output after ``wo`` (before the residual add),
the FFN norm's output and the FFN (or MoE block: ``ffn_moe_out`` where no shared expert adds an ``ffn_out``)
output before the residual add, as llama.cpp's Llama-family and MoE builders name them."""
ROUTER_STAGES: dict[str, tuple[str, ...]] = {
    ROUTER_LOGITS: ("ffn_moe_logits", "ffn_moe_logits_biased"),
    ROUTER_IDS: ("ffn_moe_topk",),
    ROUTER_WEIGHTS: ("ffn_moe_weights", "ffn_moe_weights_softmax", "ffn_moe_weights_norm", "ffn_moe_weights_scaled"),
    ROUTER_SCORES: ("ffn_moe_probs_biased",),
}
"""Routing part -> the graph names (``{name}-{layer}``) it may come from, in graph order: the last present wins.

Each stage is computed from the one before it, so the last one the graph has is what it
applies (``ffn_moe_logits_biased``: the gate's bias added; ``ffn_moe_probs_biased``: DeepSeek-V3's
selection scores, sigmoid plus the correction bias, before any group masking)."""
_REQUIRED = (ROUTER_LOGITS, ROUTER_IDS, ROUTER_WEIGHTS)


class Decoded(NamedTuple):
    """One decode's results: ``{(point, layer): [n, hidden]}``, logits [n, vocab], ``{layer: {part: [n, E|k]}}``."""

    hidden: dict[tuple[str, int], torch.Tensor]
    logits: torch.Tensor
    router: dict[int, dict[str, torch.Tensor]]


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h): type, buffer, ne[4], nb[4]."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def check_gguf_file(path: str) -> Path:
    """``path`` as a regular GGUF file (magic ``GGUF``); a one-line :class:`UsageError` otherwise.

    Opened non-blocking and checked with ``fstat`` before a byte is read, so a FIFO is refused, never waited on.
    """
    p = Path(path)
    try:
        fd = os.open(p, READ_FLAGS)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise UsageError(
                    f"{path}: a directory; --engine llama.cpp loads one .gguf file (convert an HF "
                    "checkpoint with llama.cpp's convert_hf_to_gguf.py)"
                )
            if not stat.S_ISREG(mode):
                raise UsageError(
                    f"{path}: {file_kind(mode)}, not a regular file; --engine llama.cpp loads one .gguf file"
                )
            magic = os.read(fd, 4)
        finally:
            os.close(fd)
    except OSError as e:
        raise UsageError(f"{path}: cannot read the model file ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise UsageError(
            f"{path}: not a GGUF file (--engine llama.cpp loads a .gguf; convert an HF checkpoint "
            "with llama.cpp's convert_hf_to_gguf.py)"
        )
    return p


def file_type_name(ftype: int) -> str:
    """llama.cpp's file type id as its short name (``7`` -> ``Q8_0``, ``0`` -> ``F32``)."""
    import llama_cpp

    for key, value in vars(llama_cpp).items():
        if key.startswith("LLAMA_FTYPE_") and value == ftype and key != "LLAMA_FTYPE_GUESSED":
            return key.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    return f"ftype{ftype}"


def _ggml_lib() -> ctypes.CDLL:
    """libggml with the argument types of the three ggml calls the capture makes."""
    from llama_cpp._ggml import libggml as lib

    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


_SILENT: list[Any] = []
"""The no-op log callback, made once and kept alive for the process (llama.cpp holds a raw pointer to it)."""


def _set_log(verbose: bool) -> None:
    """Route llama.cpp's and ggml's log to llama-cpp-python's stderr printer (verbose) or nowhere."""
    import llama_cpp
    from llama_cpp import _logger

    if verbose:
        _logger.set_verbose(True)
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
        return
    if not _SILENT:
        _SILENT.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
    llama_cpp.llama_log_set(_SILENT[0], ctypes.c_void_p(0))


class _Capture:
    """The ``cb_eval`` state: which tensors to copy in this decode, what was copied, the first error."""

    def __init__(self) -> None:
        self.lib = _ggml_lib()
        self.names: dict[str, tuple[str, Any, int]] = {}  # node name -> (part, rank or (point, rank), layer)
        self.n_tokens = 0
        self.got: dict[tuple[str, int], np.ndarray] = {}
        self.ranks: dict[tuple[str, int], int] = {}  # (point, layer) -> rank of the node ``got`` holds
        self.routed: dict[int, dict[str, tuple[int, np.ndarray]]] = {}
        self.error: str | None = None

    def start(self, n_tokens: int, hidden: set[tuple[str, int]], router: set[int]) -> None:
        """Ask for the ``(point, layer)`` nodes ``hidden`` (:data:`GGML_NODES`) and layers ``router``'s routing
        tensors in the next decode."""
        self.names = {
            f"{node}-{i}": ("hidden", (point, rank), i)
            for point, i in hidden
            for rank, node in enumerate(GGML_NODES[point])
        }
        self.ranks = {}
        for part, stages in ROUTER_STAGES.items():
            self.names.update({f"{name}-{i}": (part, rank, i) for rank, name in enumerate(stages) for i in router})
        self.n_tokens, self.got, self.routed, self.error = n_tokens, {}, {}, None

    def _read(self, t: int, name: str) -> np.ndarray:
        """Tensor ``t`` as a [tokens, width] array, read through its strides (``ffn_moe_topk`` is a view)."""
        head = _TensorHead.from_address(t)
        dtype = _NUMPY.get(head.type)
        ne, nb = list(head.ne), list(head.nb)
        outer = max([d for d in range(4) if ne[d] != 1], default=0)
        item = np.dtype(dtype).itemsize if dtype is not None else 1
        if dtype is None or any(b % item for b in nb) or (self.n_tokens > 1 and ne[outer] != self.n_tokens):
            raise ValueError(
                f"{name}: ggml type {head.type}, shape {ne} is not an f32/f16/i32 tensor [..., {self.n_tokens} tokens]"
            )
        raw = np.empty(self.lib.ggml_nbytes(t) // item, dtype=dtype)
        self.lib.ggml_backend_tensor_get(t, raw.ctypes.data, 0, raw.nbytes)
        view = np.lib.stride_tricks.as_strided(raw, shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
        return np.ascontiguousarray(view).reshape(self.n_tokens, -1)  # ggml ne[0] is the fastest axis

    def __call__(self, t: int, ask: bool, _user: Any) -> bool:
        try:
            name = (self.lib.ggml_get_name(t) or b"").decode(errors="replace")
            which = self.names.get(name)
            if ask or which is None:
                return which is not None
            part, rank, layer = which
            if part == "hidden":  # rank: (point, its node's rank among the point's names)
                point, first = rank
                if first <= self.ranks.get((point, layer), first):
                    self.got[point, layer], self.ranks[point, layer] = self._read(t, name), first
            elif rank >= self.routed.setdefault(layer, {}).get(part, (-1, None))[0]:
                self.routed[layer][part] = (rank, self._read(t, name))
            return True
        except Exception as e:  # noqa: BLE001 - an exception must not cross the C callback
            self.error = f"capture callback failed: {type(e).__name__}: {e}"
            return False

    def router_parts(self, path: Path) -> dict[int, dict[str, torch.Tensor]]:
        """The routing tensors copied per MoE layer, as the graph computed them (ids int32; the record casts them)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer, parts in sorted(self.routed.items()):
            missing = [p for p in _REQUIRED if p not in parts]
            if missing:
                raise ModelError(
                    f"{path}: llama.cpp's graph has no tensor {ROUTER_STAGES[missing[0]][0]}-{layer} "
                    "beside that layer's other MoE routing tensors (this architecture routes differently)"
                )
            out[layer] = {p: torch.from_numpy(a) for p, (_, a) in parts.items()}
        return out


class GgufSession:
    """A loaded GGUF model (extra buffer types off: no weight repacking) and, once made, one context."""

    def __init__(self, path: Path, model: Any) -> None:
        import llama_cpp

        self._ll = llama_cpp
        self.path, self.model = path, model
        self.ctx: Any = None
        self._cap = _Capture()
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._cap)  # kept alive as long as the context
        vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.n_layer = int(llama_cpp.llama_model_n_layer(model))
        self.n_embd = int(llama_cpp.llama_model_n_embd(model))
        self.ftype = int(llama_cpp.llama_model_ftype(model))
        self.arch = self.meta("general.architecture") or "unknown"
        experts = self.meta(f"{self.arch}.expert_count") or "0"
        self.n_expert = int(experts) if experts.isdigit() else 0
        """Experts per MoE layer (GGUF ``{arch}.expert_count``); 0: a dense model."""

    @classmethod
    def open(cls, path: str, *, verbose: bool = False) -> GgufSession:
        """Load ``path``: a :class:`UsageError` if it is no GGUF file, a :class:`ModelError` if llama.cpp refuses it."""
        import llama_cpp

        p = check_gguf_file(path)
        _set_log(verbose)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False  # ggml's repacked (AMX) q8_0 path dies with SIGILL on some CPUs
        model = llama_cpp.llama_model_load_from_file(os.fsencode(p), params)
        if not model:
            raise ModelError(
                f"{path}: llama.cpp cannot load this GGUF model (run with --engine-arg verbose=true to see its log)"
            )
        return cls(p, model)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (``general.architecture``), or None when the file lacks it."""
        buf = ctypes.create_string_buffer(512)
        n = self._ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode(errors="replace")

    def new_context(
        self,
        *,
        n_ctx: int,
        n_batch: int,
        n_seqs: int,
        threads: int,
        kv_type: int,
        flash_attn: int,
        capture: bool = True,
    ) -> None:
        """Make the context: every decode of up to ``n_batch`` tokens is one graph (``n_ubatch = n_batch``).

        ``capture=False`` leaves ``cb_eval`` unset: llama.cpp runs each graph whole, as without this tool
        (the reference that shows capture changes no logit).
        """
        ll = self._ll
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seqs
        p.n_threads = p.n_threads_batch = threads
        p.type_k = p.type_v = kv_type
        p.flash_attn_type = flash_attn
        p.kv_unified = True  # one KV stream: the batch is not reordered into per-sequence ubatches
        if capture:
            p.cb_eval, p.cb_eval_user_data = self._cb, None
        self.ctx = ll.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise ModelError(
                f"{self.path}: llama.cpp cannot make a context (n_ctx {n_ctx}, n_batch {n_batch}, "
                f"KV type {kv_type}, flash_attn {flash_attn})"
            )

    def clear(self) -> None:
        """Empty the KV cache (between prompt batches)."""
        self._ll.llama_memory_clear(self._ll.llama_get_memory(self.ctx), True)

    def decode(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        *,
        want: set[tuple[str, int]],
        router: set[int] | frozenset[int] = frozenset(),
    ) -> Decoded:
        """Decode one batch (token ``i`` at ``positions[i]`` of KV sequence ``seqs[i]``), logits for all.

        Copies the nodes [n, hidden] of the ``(point, layer)`` pairs in ``want`` (:data:`GGML_NODES`)
        and the routing tensors of the MoE layers among ``router`` (a dense layer has none: no entry).
        """
        ll, n = self._ll, len(tokens)
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            for i, (tok, pos, seq) in enumerate(zip(tokens, positions, seqs, strict=True)):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, 1
                batch.seq_id[i][0] = seq
            batch.n_tokens = n
            self._cap.start(n, set(want), set(router))
            rc = ll.llama_decode(self.ctx, batch)
            if self._cap.error is not None:
                raise ModelError(f"{self.path}: {self._cap.error}")
            if rc != 0:
                raise ModelError(f"{self.path}: llama_decode of {n} tokens failed (return code {rc})")
            logits = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(n, self.n_vocab)).copy()
        finally:
            ll.llama_batch_free(batch)
        missing = sorted(set(want) - set(self._cap.got))
        if missing:
            raise ModelError(
                f"{self.path}: llama.cpp's graph has no tensor {GGML_NODES[missing[0][0]][0]}-"
                f"{missing[0][1]} (this architecture names its layer's nodes differently)"
            )
        got = {k: torch.from_numpy(v).to(torch.float32) for k, v in self._cap.got.items()}
        return Decoded(got, torch.from_numpy(logits), self._cap.router_parts(self.path))

    def close(self) -> None:
        if self.ctx:
            self._ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self._ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> GgufSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
