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

The file is untrusted: :func:`read_header` bounds ``n_ctx``, ``n_vocab`` (:data:`MAX_VOCAB`) and the
positions of all chunks (:data:`MAX_KLD_POSITIONS`) and checks the size they imply against the
file's before anything is sized from them; every read then lies inside that layout and takes at
most :data:`READ_BYTES` (rows are read with ``pread``, not memory-mapped, so a file cut short while
it is read is an error line, not a SIGBUS). A row whose stored scale or offset is not finite (NaN
logits in the model that wrote it, or damage) or whose scale is negative is refused, so it can never
pass as "the same NaN on both sides"; so is a file whose size changes during a pass.

Example::

    from comparator.logprobs.judge import compare_logprob_sources
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
from operator import itemgetter
from pathlib import Path
from typing import Final

import numpy as np

from comparator.logprobs.kl_stream import Distributions
from comparator.logprobs.sources.input_caps import MAX_KLD_POSITIONS, MAX_POSITIONS, MAX_VOCAB
from comparator.logprobs.types import UNKNOWN_TOKEN, SequenceLogprobs
from dumper.errors import CorruptDumpError, UsageError
from dumper.format.files import READ_FLAGS, file_kind

__all__ = [
    "MAGIC",
    "KLD_FLOOR",
    "READ_BYTES",
    "KldHeader",
    "KldFile",
    "is_kld_file",
    "read_header",
    "chunk_prompts",
    "write_kld",
]

MAGIC: Final = b"_logits_"
_HEADER = struct.Struct("<8sIii")
KLD_FLOOR: Final = -16.0
"""llama.cpp leaves a baseline token out of KL when its stored log-prob is not above this."""
RANGE: Final = 16.0
"""Nats below a row's top logit that a row stores; lower values are stored at the bottom."""
READ_BYTES: Final = 2 * (MAX_VOCAB + 4)
"""Most bytes one read of rows takes (4 MiB: one row of :data:`MAX_VOCAB`); the tokens, at most
``4 * MAX_KLD_POSITIONS`` = 8 MiB, are read at once when the file is opened."""
_PAGE: Final = 4096
"""Rows up to this size are scanned whole, a piece of rows per read; longer ones 10 bytes a row."""


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
    try:  # checked again on the open file: the path may have been swapped for a FIFO
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(MAGIC), 0) == MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def _check_header(p: Path, n_ctx: int, n_vocab: int, n_chunk: int) -> None:
    """The one place a header's sizes are bounded: before its layout is computed or anything sized from it."""
    if not 3 <= n_ctx <= MAX_POSITIONS:
        raise CorruptDumpError(
            f"{p}: n_ctx {n_ctx} is outside [3, {MAX_POSITIONS}] (llama-perplexity scores "
            "the tokens after the first n_ctx/2 of each chunk)"
        )
    if n_vocab < 1:
        raise CorruptDumpError(f"{p}: n_vocab {n_vocab} is not a positive vocabulary size")
    if n_vocab > MAX_VOCAB:
        raise CorruptDumpError(
            f"{p}: declares a vocabulary of {n_vocab}, over the limit {MAX_VOCAB} (real vocabularies reach about 262k)"
        )
    if n_chunk < 1:
        raise CorruptDumpError(f"{p}: n_chunk {n_chunk} is not a positive number of chunks")
    if n_ctx * n_chunk > MAX_KLD_POSITIONS:
        raise UsageError(
            f"{p}: {n_chunk} chunks of {n_ctx} tokens are {n_ctx * n_chunk} positions, over the "
            f"limit of {MAX_KLD_POSITIONS} a llama.cpp KL-divergence base file may hold"
        )


def read_header(path: str | os.PathLike[str]) -> KldHeader:
    """The header of a base file, bounded and checked against the file's size before anything else is read.

    Raises CorruptDumpError (exit 2), naming the file, for a missing magic, sizes out of bounds
    (checked first, so an absurd vocabulary is named as such), a truncated file or sizes that
    do not describe it; UsageError for more positions than one source may hold.
    """
    p = Path(path)
    fd = _open(p)
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if raw[: len(MAGIC)] != MAGIC:
        raise CorruptDumpError(f"{p}: not a llama.cpp KL-divergence base file (no {MAGIC.decode()} magic)")
    if len(raw) < _HEADER.size:
        raise CorruptDumpError(f"{p}: truncated llama.cpp KL-divergence base file: {size} bytes, no full header")
    _, n_ctx, n_vocab, n_chunk = _HEADER.unpack(raw)
    _check_header(p, n_ctx, n_vocab, n_chunk)
    h = KldHeader(str(p), n_ctx, n_vocab, n_chunk)
    if size != h.size:
        why = "truncated" if size < h.size else "trailing bytes"
        raise CorruptDumpError(
            f"{p}: {why}: {size} bytes, but n_ctx {n_ctx}, n_vocab {n_vocab} and n_chunk "
            f"{n_chunk} make a llama.cpp KL-divergence base file of {h.size} bytes"
        )
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
        assert self._fd is not None and n <= max(READ_BYTES, 4 * MAX_KLD_POSITIONS)
        raw = os.pread(self._fd, n, offset)
        if len(raw) != n:
            raise CorruptDumpError(f"{self.path}: truncated while it was read (offset {offset})")
        return raw

    def _words(self, row: int, n: int) -> np.ndarray:
        """``n`` rows from file row ``row`` (``chunk * rows + r``) as uint16 words [n, row_bytes / 2]."""
        h = self.header
        raw = self._read(n * h.row_bytes, h.offset(0, row))
        return np.frombuffer(raw, dtype="<u2").reshape(n, h.row_bytes // 2)

    def _check_heads(self, heads: np.ndarray, row: int) -> None:
        """Raise unless every (scale, min_log_prob) [n, 2] of the file rows from ``row`` on is finite, scale >= 0."""
        bad = np.flatnonzero(~np.all(np.isfinite(heads), axis=1) | (heads[:, 0] < 0))
        if bad.size:
            chunk, r = divmod(row + int(bad[0]), self.header.rows)
            scale, low = (float(x) for x in heads[bad[0]])
            raise CorruptDumpError(
                f"{self.path}: chunk {chunk} row {r}: stored scale {scale} and min_log_prob "
                f"{low} are not a log-probability row (NaN logits in the model that wrote it, or "
                "a damaged file)"
            )

    def _read_tokens(self) -> np.ndarray:
        h = self.header
        tok = np.frombuffer(self._read(4 * h.n_ctx * h.n_chunk, _HEADER.size), dtype="<i4").astype(np.int64)
        bad = np.flatnonzero((tok < 0) | (tok >= h.n_vocab))
        if bad.size:
            c, pos = divmod(int(bad[0]), h.n_ctx)
            raise CorruptDumpError(
                f"{self.path}: chunk {c} position {pos}: token id {int(tok[bad[0]])} is outside "
                f"the vocabulary [0, {h.n_vocab})"
            )
        return tok.reshape(h.n_chunk, h.n_ctx)

    def _check_size(self, when: str) -> None:
        assert self._fd is not None
        if os.fstat(self._fd).st_size != self.header.size:
            raise CorruptDumpError(f"{self.path}: changed size {when}")

    @contextmanager
    def open(self) -> Iterator[KldFile]:
        """Open the file for a pass (re-entrant); it must have the size its header implies before and after."""
        if self._fd is not None:
            yield self
            return
        self._fd = _open(self.path)
        try:
            self._check_size("since its header was read")
            yield self
            self._check_size("while it was read")
        finally:
            os.close(self._fd)
            self._fd = None

    def _chunk(self, request: str) -> int | None:
        ok = request.isascii() and request.isdigit() and len(request) <= 10 and request == str(int(request))
        c = int(request) if ok else -1
        return c if 0 <= c < self.header.n_chunk else None

    def positions(self, request: str) -> np.ndarray | None:
        if self._chunk(request) is None:
            return None
        return np.arange(self.header.first + 1, self.header.n_ctx, dtype=np.int64)

    def rows(self, request: str, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``request`` at ``index`` (in ``[0, rows)``), read a run of consecutive rows at a
        time in pieces of at most :data:`READ_BYTES`; ``out`` (or a new array) is [len(index), V]."""
        c = self._chunk(request)
        h = self.header
        if c is None or (index.size and not (0 <= int(index.min()) and int(index.max()) < h.rows)):
            raise IndexError(
                f"{self.path}: request {request!r} rows {index.tolist()[:4]}... are not among its "
                f"{h.n_chunk} chunks of {h.rows} rows"
            )
        if out is None:
            out = np.empty((index.size, h.n_vocab), dtype=np.float64)
        step = max(1, READ_BYTES // h.row_bytes)
        cuts = np.flatnonzero(np.diff(index) != 1) + 1  # one run of reads per run of consecutive rows
        for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), index.size], strict=True):
            for a in range(start, stop, step):
                b, lo = min(a + step, stop), int(index[a])
                words = self._words(c * h.rows + lo, b - a)
                head = np.ascontiguousarray(words[:, :4]).view("<f4").astype(np.float64)  # [n, 2]: scale, min_log_prob
                self._check_heads(head, c * h.rows + lo)
                block = out[a:b]
                block[:] = words[:, 4 : 4 + h.n_vocab]
                block *= head[:, :1]
                block += head[:, 1:2]
        return out

    def _scan(self, tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every row's (scale, min_log_prob) [n_chunk, rows, 2], checked, and, with ``tokens``, the
        stored code of its scored token [n_chunk, rows]: rows up to a page are read whole, a piece
        of :data:`READ_BYTES` at a time; longer ones 8 (or 10) bytes a row."""
        h = self.header
        n = h.n_chunk * h.rows
        heads = np.empty((n, 2), dtype=np.float64)
        codes = np.zeros(n, dtype=np.float64)
        scored = self.tokens[:, h.first + 1 :].reshape(-1)  # the token each file row predicts
        step = READ_BYTES // h.row_bytes if h.row_bytes <= _PAGE else 1
        with self.open():
            for lo in range(0, n, step):
                if step > 1:
                    hi = min(lo + step, n)
                    words = self._words(lo, hi - lo)
                    heads[lo:hi] = np.ascontiguousarray(words[:, :4]).view("<f4")
                    codes[lo:hi] = words[np.arange(hi - lo), 4 + scored[lo:hi]]
                    continue
                at = h.offset(0, lo)
                heads[lo] = struct.unpack("<ff", self._read(8, at))
                if tokens:
                    codes[lo] = struct.unpack("<H", self._read(2, at + 8 + 2 * int(scored[lo])))[0]
        self._check_heads(heads, 0)
        return heads.reshape(h.n_chunk, h.rows, 2), codes.reshape(h.n_chunk, h.rows)

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
        ids = np.unique(self.tokens[:, 1:])
        objs = [UNKNOWN_TOKEN, *ids.tolist()]  # one int object per distinct id, shared by all its positions
        where = np.searchsorted(ids, self.tokens) + 1
        where[:, 0] = 0
        return tuple(
            SequenceLogprobs(str(c), itemgetter(*where[c].tolist())(objs), lead + lp[c].tolist())
            for c in range(h.n_chunk)
        )


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
    out[:, 4 : 4 + x.shape[1]] = np.where(x > low[:, None], np.clip(code, 0, 65535), 0)
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
