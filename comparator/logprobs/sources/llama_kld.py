"""llama.cpp KL-divergence base files as a logprob source, read row block by row block.

``llama-perplexity -m MODEL.gguf -f TEXT -c N_CTX --kl-divergence-base FILE`` writes the
log-probabilities of every scored token, and ``--kl-divergence --kl-divergence-base FILE``
compares another model against them (tools/perplexity/perplexity.cpp, ``perplexity`` and
``kl_divergence``). The file, little-endian::

    char[8]  "_logits_"
    uint32   n_ctx
    int32    n_vocab
    int32    n_chunk
    int32    tokens[n_chunk * n_ctx]       the text, chunk after chunk
    then, chunk after chunk, n_ctx - 1 - n_ctx/2 rows of 2*((n_vocab+1)/2) + 4 uint16 words:
      float32 scale, float32 min_log_prob, uint16 q[n_vocab] (one pad word if n_vocab is odd)

Row ``r`` of a chunk is the distribution at position ``n_ctx/2 + r``, predicting the token at
``n_ctx/2 + r + 1``: llama-perplexity scores only the second half of each chunk, the first half
being context. Log-probabilities are stored as ``scale * q + min_log_prob`` with ``scale =
range / 65535`` and the range at most 16 nats below the row's top token: each value is off by at
most ``scale / 2 <= 1.2e-4``, and tokens further down are stored at the bottom (``q = 0``).

Chunk ``c`` is request ``"c"`` with ``n_ctx`` positions (logprobs at the scored ones). Position 0
is ``UNKNOWN_TOKEN``: llama-perplexity feeds BOS there when the model adds one, whatever the
file holds. To compare a driftscope dump against a base file, dump the chunks' token ids (BOS
at position 0) as prompts in chunk order (:func:`chunk_prompts`).

:func:`write_kld` writes one from another engine's logits, for ``llama-perplexity --kl-divergence``
to compare a GGUF against. Only the header and the tokens are held; rows are read a block of a few MiB at a time and
reduced at once (:func:`comparator.logprobs.kl_stream.stream_kl`), so memory does not grow with the file.

Example::

    from comparator.logprobs.sources import compare_logprob_sources
    v = compare_logprob_sources("f32.kld", "q8_0.kld")    # two llama-perplexity base files
    v.kl_mean, v.llama.kl_mean_se, v.llama.same_top_rate, v.llama.ppl_ratio
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from dumper.errors import CorruptDumpError, UsageError
from dumper.format.files import READ_FLAGS, file_kind

from comparator.logprobs.sources.limits import MAX_POSITIONS, MAX_TOTAL_POSITIONS, TOKEN_ID_LIMIT
from comparator.logprobs.kl_stream import Distributions
from comparator.logprobs.types import UNKNOWN_TOKEN, SequenceLogprobs

__all__ = ["MAGIC", "KLD_FLOOR", "KldHeader", "KldFile", "is_kld_file", "read_header", "chunk_prompts", "write_kld"]

MAGIC: Final = b"_logits_"
_HEADER = struct.Struct("<8sIii")
KLD_FLOOR: Final = -16.0
"""llama.cpp leaves a baseline token out of KL when its stored log-prob is not above this."""
RANGE: Final = 16.0
"""Nats below a row's top logit that a row stores; lower values are stored at the bottom."""


@dataclass(frozen=True)
class KldHeader:
    """The header of a base file, with the layout it implies."""

    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int

    @property
    def first(self) -> int:
        """Position of a chunk's first scored row (llama-perplexity's ``first = n_ctx/2``)."""
        return self.n_ctx // 2

    @property
    def rows(self) -> int:
        """Scored rows per chunk."""
        return self.n_ctx - 1 - self.first

    @property
    def row_bytes(self) -> int:
        return 2 * (2 * ((self.n_vocab + 1) // 2) + 4)

    @property
    def data_offset(self) -> int:
        return _HEADER.size + 4 * self.n_ctx * self.n_chunk

    @property
    def size(self) -> int:
        """The file size this header implies."""
        return self.data_offset + self.n_chunk * self.rows * self.row_bytes

    def offset(self, chunk: int, row: int) -> int:
        return self.data_offset + (chunk * self.rows + row) * self.row_bytes


def _open(path: Path) -> int:
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        raise CorruptDumpError(f"{path}: cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptDumpError(f"{path}: {file_kind(mode)}, not a regular file; refusing to read it")
    return fd


def is_kld_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file starting with llama.cpp's ``_logits_`` magic."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return False
    try:
        return os.pread(fd, len(MAGIC), 0) == MAGIC
    finally:
        os.close(fd)


def _check_header(p: Path, n_ctx: int, n_vocab: int, n_chunk: int) -> None:
    if not 3 <= n_ctx <= MAX_POSITIONS:
        raise CorruptDumpError(f"{p}: n_ctx {n_ctx} is outside [3, {MAX_POSITIONS}] (llama-perplexity scores "
                               "the tokens after the first n_ctx/2 of each chunk)")
    if not 1 <= n_vocab < TOKEN_ID_LIMIT or n_chunk < 1:
        raise CorruptDumpError(f"{p}: n_vocab {n_vocab} or n_chunk {n_chunk} is not a positive size")
    if n_ctx * n_chunk > MAX_TOTAL_POSITIONS:
        raise UsageError(f"{p}: {n_chunk} chunks of {n_ctx} tokens are {n_ctx * n_chunk} positions, over the "
                         f"limit of {MAX_TOTAL_POSITIONS} one source may hold")


def read_header(path: str | os.PathLike[str]) -> KldHeader:
    """The header of a base file, checked against the file's size before anything else is read.

    Raises CorruptDumpError (exit 2), naming the file, for a missing magic, a truncated file or
    sizes that do not describe it.
    """
    p = Path(path)
    fd = _open(p)
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if raw[:len(MAGIC)] != MAGIC:
        raise CorruptDumpError(f"{p}: not a llama.cpp KL-divergence base file (no {MAGIC.decode()} magic)")
    if len(raw) < _HEADER.size:
        raise CorruptDumpError(f"{p}: truncated llama.cpp KL-divergence base file: {size} bytes, no full header")
    _, n_ctx, n_vocab, n_chunk = _HEADER.unpack(raw)
    _check_header(p, n_ctx, n_vocab, n_chunk)
    h = KldHeader(str(p), n_ctx, n_vocab, n_chunk)
    if size != h.size:
        why = "truncated" if size < h.size else "trailing bytes"
        raise CorruptDumpError(f"{p}: {why}: {size} bytes, but n_ctx {n_ctx}, n_vocab {n_vocab} and n_chunk "
                               f"{n_chunk} make a llama.cpp KL-divergence base file of {h.size} bytes")
    return h


class KldFile(Distributions):
    """A llama-perplexity base file: header and tokens held, rows read on demand."""

    floor = KLD_FLOOR

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.header = h = read_header(path)
        self.path = Path(path)
        self.vocab_size = h.n_vocab
        self._fd: int | None = None
        with self.open():
            self.tokens = self._read_tokens()  # [n_chunk, n_ctx] int64

    def _read(self, n: int, offset: int) -> bytes:
        assert self._fd is not None
        raw = os.pread(self._fd, n, offset)
        if len(raw) != n:
            raise CorruptDumpError(f"{self.path}: truncated while it was read (offset {offset})")
        return raw

    def _read_tokens(self) -> np.ndarray:
        h = self.header
        tok = np.frombuffer(self._read(4 * h.n_ctx * h.n_chunk, _HEADER.size), dtype="<i4").astype(np.int64)
        bad = np.flatnonzero((tok < 0) | (tok >= h.n_vocab))
        if bad.size:
            c, pos = divmod(int(bad[0]), h.n_ctx)
            raise CorruptDumpError(f"{self.path}: chunk {c} position {pos}: token id {int(tok[bad[0]])} is outside "
                                   f"the vocabulary [0, {h.n_vocab})")
        return tok.reshape(h.n_chunk, h.n_ctx)

    @contextmanager
    def open(self) -> Iterator[KldFile]:
        """Open the file for a pass (re-entrant); it must still have the size its header implies."""
        if self._fd is not None:
            yield self
            return
        self._fd = _open(self.path)
        try:
            if os.fstat(self._fd).st_size != self.header.size:
                raise CorruptDumpError(f"{self.path}: changed size since its header was read")
            yield self
        finally:
            os.close(self._fd)
            self._fd = None

    def _chunk(self, request: str) -> int | None:
        c = int(request) if request.isdigit() and request == str(int(request)) else -1
        return c if 0 <= c < self.header.n_chunk else None

    def positions(self, request: str) -> np.ndarray | None:
        if self._chunk(request) is None:
            return None
        return np.arange(self.header.first + 1, self.header.n_ctx, dtype=np.int64)

    def rows(self, request: str, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        c = self._chunk(request)
        assert c is not None
        h = self.header
        if out is None:
            out = np.empty((index.size, h.n_vocab), dtype=np.float64)
        cuts = np.flatnonzero(np.diff(index) != 1) + 1  # one read per run of consecutive rows
        for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), index.size], strict=True):
            lo = int(index[start])
            words = np.frombuffer(self._read((stop - start) * h.row_bytes, h.offset(c, lo)), dtype="<u2")
            words = words.reshape(stop - start, h.row_bytes // 2)
            head = np.ascontiguousarray(words[:, :4]).view("<f4").astype(np.float64)  # [n, 2]: scale, min_log_prob
            block = out[start:stop]
            block[:] = words[:, 4:4 + h.n_vocab]
            block *= head[:, :1]
            block += head[:, 1:2]
        return out

    def _scan(self, tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every row's (scale, min_log_prob) [n_chunk, rows, 2] and, with ``tokens``, the stored
        code of its scored token [n_chunk, rows]; 8 (or 10) bytes read per row."""
        h = self.header
        heads = np.empty((h.n_chunk, h.rows, 2), dtype=np.float64)
        codes = np.zeros((h.n_chunk, h.rows), dtype=np.float64)
        with self.open():
            for c in range(h.n_chunk):
                for r in range(h.rows):
                    at = h.offset(c, r)
                    heads[c, r] = struct.unpack("<ff", self._read(8, at))
                    if tokens:
                        at += 8 + 2 * int(self.tokens[c, h.first + 1 + r])
                        codes[c, r] = struct.unpack("<H", self._read(2, at))[0]
        return heads, codes

    def token_logprobs(self) -> np.ndarray:
        """Stored log-prob of each scored token [n_chunk, rows]."""
        heads, codes = self._scan(tokens=True)
        return heads[..., 0] * codes + heads[..., 1]

    def storage_error(self) -> tuple[float, int]:
        """``(bound, clamped)``: every stored log-prob within ``RANGE`` nats of its row's top lies
        within ``bound`` (half the largest step) of the exact value; ``clamped`` rows spanned the
        whole range, so their lower values may be stored above the truth."""
        scale = self._scan(tokens=False)[0][..., 0]
        return float(np.max(scale)) / 2, int(np.count_nonzero(scale * 65535 >= RANGE * (1 - 1e-6)))

    def sequences(self) -> tuple[SequenceLogprobs, ...]:
        """One request per chunk (``"0"``, ``"1"``, ...), positions 0..n_ctx-1, logprobs at the scored ones."""
        h = self.header
        lp = self.token_logprobs()
        lead: list[float | None] = [None] * (h.first + 1)
        return tuple(SequenceLogprobs(str(c), [UNKNOWN_TOKEN, *self.tokens[c, 1:].tolist()], lead + lp[c].tolist())
                     for c in range(h.n_chunk))


def chunk_prompts(kld: KldFile, bos: int | None) -> list[list[int]]:
    """The token ids llama-perplexity evaluated, one list per chunk: position 0 replaced by ``bos``
    (the model's BOS id when it adds one; None keeps the file's token). Write them as
    ``{"input_ids": [...]}`` lines for ``python -m dumper run --prompts``."""
    out = [row.tolist() for row in kld.tokens]
    if bos is not None:
        for r in out:
            r[0] = bos
    return out


def _quantize(logits: np.ndarray, words: int) -> np.ndarray:
    """llama-perplexity's row encoding of float logits [n, V], as uint16 words [n, words]."""
    x = np.asarray(logits, dtype=np.float32)
    top = x.max(axis=1)
    low = np.maximum(x.min(axis=1), top - np.float32(RANGE))
    lse = np.log(np.sum(np.exp((x - top[:, None]).astype(np.float64)), axis=1)).astype(np.float32)
    scale = (top - low) / np.float32(65535)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    out = np.zeros((x.shape[0], words), dtype="<u2")
    out[:, :4] = np.stack([scale, low - top - lse], axis=1).astype("<f4").view("<u2")
    code = np.rint(inv[:, None] * (x - low[:, None]))
    out[:, 4:4 + x.shape[1]] = np.where(x > low[:, None], np.clip(code, 0, 65535), 0)
    return out


def write_kld(path: str | os.PathLike[str], tokens: np.ndarray, logits: Iterable[np.ndarray]) -> KldHeader:
    """Write a base file as ``llama-perplexity --kl-divergence-base`` does, so that llama.cpp can
    compare a GGUF against another engine's distributions (``llama-perplexity --kl-divergence``).

    ``tokens`` is [n_chunk, n_ctx]; ``logits`` yields float blocks [rows, V] in file order: chunk
    after chunk, the rows at positions ``n_ctx/2 .. n_ctx-2`` of each (predicting the tokens
    after them), a block at a time so the whole never needs to be in memory.
    """
    tok = np.asarray(tokens)
    if tok.ndim != 2 or not np.issubdtype(tok.dtype, np.integer):
        raise UsageError(f"{path}: tokens must be an integer array [n_chunk, n_ctx], got {tok.dtype} {tok.shape}")
    written, h = 0, None
    with open(path, "wb") as f:
        for block in logits:
            if h is None:
                h = KldHeader(str(path), tok.shape[1], int(np.shape(block)[1]), tok.shape[0])
                _check_header(Path(path), h.n_ctx, h.n_vocab, h.n_chunk)
                f.write(_HEADER.pack(MAGIC, h.n_ctx, h.n_vocab, h.n_chunk) + tok.astype("<i4").tobytes())
            if np.ndim(block) != 2 or np.shape(block)[1] != h.n_vocab:
                raise UsageError(f"{path}: a logits block of shape {np.shape(block)}, expected [rows, {h.n_vocab}]")
            f.write(_quantize(block, h.row_bytes // 2).tobytes())
            written += np.shape(block)[0]
    if h is None or written != h.n_chunk * h.rows:
        expected = "rows" if h is None else f"{h.n_chunk * h.rows} rows"
        raise UsageError(f"{path}: {written} logits rows written, expected {expected} (n_ctx - 1 - n_ctx/2 per chunk)")
    return h
