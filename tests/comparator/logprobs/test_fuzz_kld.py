"""Fuzzing the llama.cpp KL-divergence base file reader: damaged real base files through the real CLI.

A base file is written once by :func:`comparator.logprobs.sources.llama_kld.write_kld` from the
real logits of the tiny-llama preset (2 chunks of 16 tokens, 384-token vocabulary). Each case
damages a copy at the header, token, row-head, row-word or byte level and runs ``python -m
comparator logprobs BASE DAMAGED --logprob-threshold max_abs_err=0 --quiet`` (either side) in-process
(:func:`tests.fuzzing.run_main`); with that threshold any change to a compared logprob fails.
Properties, besides :func:`tests.fuzzing.check_outcome` (exit 0, 1 or 2, no traceback, one
``error:`` line, no control character, nothing under ``outside/`` opened, traced memory bounded):

* no read leaves the declared layout: a file whose size never changes never reads as
  "truncated while it was read";
* a changed header never exits 0; bounds come before sizes, so a vocabulary over
  :data:`~comparator.logprobs.sources.input_caps.MAX_VOCAB` is named as such, sizes agreeing or not;
* a token changed past position 0 exits 2 (a mismatch, or an id outside the vocabulary);
  position 0 is never compared (llama-perplexity feeds BOS there), so a valid id there exits 0;
* a NaN, infinite or negative stored scale or offset exits 2; any other change of a row's
  offset, of its scale where its scored token's code is not 0, or of that code, exits 1;
* a file cut short or grown exits 2.

The explicit tests below run the largest hostile headers in a child and measure its peak RSS.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.cli.main import main
from comparator.logprobs.sources.input_caps import MAX_KLD_POSITIONS, MAX_VOCAB
from comparator.logprobs.sources.llama_kld import MAGIC, KldFile, KldHeader, is_kld_file, read_header, write_kld
from dumper.errors import CorruptDumpError
from tests.conftest import prompt_ids, tiny_llama
from tests.fuzzing import FUZZ, LIMIT, Outcome, check_outcome, deadline, run_child, run_main

N_CTX, N_CHUNK = 16, 2
ARGS = ("--logprob-threshold", "max_abs_err=0", "--quiet")
_FIELDS = {"n_ctx": (8, "<I"), "n_vocab": (12, "<i"), "n_chunk": (16, "<i")}


@dataclass
class Box:
    """The pristine base file, its decoded layout, a sentinel ``outside/`` and the path cases write."""

    base: Path
    bad: Path
    outside: Path
    raw: bytes
    h: KldHeader
    tokens: np.ndarray  # [n_chunk, n_ctx]
    heads: np.ndarray  # [file rows, 2] float32: scale, min_log_prob
    codes: np.ndarray  # [file rows]: the stored code of each row's scored token

    def __repr__(self) -> str:  # hypothesis prints the fixture with a falsifying example
        return f"Box({self.base})"

    def run(self, data: bytes, on_target: bool, size: int | None = None) -> Outcome:
        """The CLI on ``data`` written as the damaged file (grown sparse to ``size`` when given)."""
        self.bad.write_bytes(data)
        if size is not None:
            os.truncate(self.bad, size)
        pair = (self.base, self.bad) if on_target else (self.bad, self.base)
        o = run_main(main, ["logprobs", *pair, *ARGS])
        check_outcome(o, outside=self.outside)
        assert "while it was read" not in o.err, o.err  # the file never changed: nothing read past its layout
        return o


def real_logits_file(path: Path) -> None:
    """A base file of the tiny-llama preset's float32 logits on real text, 2 chunks of 16 tokens."""
    model, tok = tiny_llama()
    ids = prompt_ids(tok, N_CTX * N_CHUNK).reshape(N_CHUNK, N_CTX)
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    write_kld(path, ids.numpy(), (logits[c, N_CTX // 2 : N_CTX - 1] for c in range(N_CHUNK)))


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> Box:
    root = tmp_path_factory.mktemp("kld-fuzz")
    (root / "case").mkdir()
    (root / "outside").mkdir()
    base = root / "case" / "base.kld"
    real_logits_file(base)
    raw = base.read_bytes()
    (root / "outside" / "base.kld").write_bytes(raw)  # a valid copy: a reader that wandered there would pass
    k = KldFile(base)
    h = k.header
    words = np.frombuffer(raw, dtype="<u2", offset=h.data_offset).reshape(-1, h.row_bytes // 2)
    scored = k.tokens[:, h.first + 1 :].reshape(-1)
    return Box(
        base,
        root / "case" / "bad.kld",
        root / "outside",
        raw,
        h,
        k.tokens.copy(),
        words[:, :4].copy().view("<f4"),
        words[np.arange(scored.size), 4 + scored].copy(),
    )


def test_the_base_file_passes_and_a_real_divergence_fails(box, tmp_path):
    """The oracle is sharp: an unchanged copy exits 0, a bfloat16 run of the same model exits 1."""
    assert (box.h.n_ctx, box.h.n_vocab, box.h.n_chunk, box.h.rows) == (N_CTX, 384, N_CHUNK, 7)
    assert np.all(box.heads[:, 0] > 0) and np.count_nonzero(box.codes) > 10
    assert box.run(box.raw, on_target=True).code == 0
    model, _ = tiny_llama(dtype="bfloat16")
    with torch.no_grad():
        logits = model(torch.as_tensor(box.tokens)).logits.float().numpy()
    write_kld(tmp_path / "bf16.kld", box.tokens, (logits[c, N_CTX // 2 : N_CTX - 1] for c in range(N_CHUNK)))
    o = run_main(main, ["logprobs", box.base, tmp_path / "bf16.kld", *ARGS])
    assert check_outcome(o) == 1, o.err


def _int_field(name: str, value: int) -> bytes:
    """``value`` as the header stores ``name`` (n_ctx uint32, the others int32), wrapped to 32 bits."""
    v = value % (1 << 32)
    return struct.pack(_FIELDS[name][1], v if _FIELDS[name][1] == "<I" or v < 1 << 31 else v - (1 << 32))


def _header_values(box: Box) -> st.SearchStrategy[int]:
    h = box.h
    return st.one_of(
        st.sampled_from(
            [
                0,
                1,
                2,
                3,
                4,
                -1,
                -(1 << 31),
                (1 << 31) - 1,
                (1 << 32) - 1,
                MAX_VOCAB,
                MAX_VOCAB + 1,
                (1 << 31) - 2,
                MAX_KLD_POSITIONS,
                MAX_KLD_POSITIONS + 1,
                h.n_ctx + 1,
                h.n_ctx - 1,
                2 * h.n_ctx,
                h.n_vocab + 1,
                h.n_vocab - 1,
                2 * h.n_vocab,
                h.n_chunk + 1,
            ]
        ),
        st.integers(-(1 << 31), (1 << 32) - 1),
    )


@pytest.mark.slow
@settings(FUZZ, max_examples=250)
@given(data=st.data(), field=st.sampled_from(["magic", *_FIELDS]), resize=st.booleans(), on_target=st.booleans())
def test_mutated_header(box, data, field, resize, on_target):
    """A changed header never exits 0; with ``resize`` the file is grown (sparse) or cut to the size the
    header implies, so only the bounds can refuse it; an absurd vocabulary is named, never "truncated"."""
    raw = bytearray(box.raw)
    if field == "magic":
        at = data.draw(st.integers(0, 7))
        raw[at] = data.draw(st.integers(0, 255))
    else:
        at, _ = _FIELDS[field]
        raw[at : at + 4] = _int_field(field, data.draw(_header_values(box)))
    if raw[:20] == box.raw[:20]:
        return
    _, n_ctx, n_vocab, n_chunk = struct.unpack("<8sIii", bytes(raw[:20]))
    size = None
    if resize and field != "magic":
        implied = KldHeader("", n_ctx, n_vocab, n_chunk).size
        if 20 <= implied <= (1 << 26) or (n_vocab > MAX_VOCAB and 0 < implied < 1 << 42):
            size = implied
            raw = raw[:size]
    o = box.run(bytes(raw), on_target, size)
    assert o.code != 0, (field, n_ctx, n_vocab, n_chunk, o.err)
    if field != "magic" and 3 <= n_ctx <= MAX_KLD_POSITIONS and n_vocab > MAX_VOCAB:
        assert f"{box.bad}: declares a vocabulary of {n_vocab}, over the limit {MAX_VOCAB}" in o.err, o.err
    if field == "magic":
        assert o.code == 2, o.err  # no longer a base file: read as JSONL, which binary is not


@settings(FUZZ, max_examples=120)
@given(data=st.data(), on_target=st.booleans())
def test_mutated_token(box, data, on_target):
    h = box.h
    c, p = data.draw(st.integers(0, h.n_chunk - 1)), data.draw(st.integers(0, h.n_ctx - 1))
    old = int(box.tokens[c, p])
    new = data.draw(
        st.one_of(
            st.sampled_from([-1, h.n_vocab, h.n_vocab + 1, (1 << 31) - 1, -(1 << 31)]), st.integers(0, h.n_vocab - 1)
        )
    )
    if new == old:
        return
    at = 20 + 4 * (c * h.n_ctx + p)
    o = box.run(box.raw[:at] + struct.pack("<i", new) + box.raw[at + 4 :], on_target)
    if not 0 <= new < h.n_vocab:
        assert o.code == 2 and f"chunk {c} position {p}: token id {new} is outside the vocabulary" in o.err, o.err
    elif p == 0:
        assert o.code == 0, o.err  # llama-perplexity feeds BOS at position 0, whatever the file holds
    else:
        assert o.code == 2 and "token mismatch" in o.err, o.err


_F32 = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e30, -1e30, 1e-40, -1e-40]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)


@pytest.mark.slow
@settings(FUZZ, max_examples=200)
@given(data=st.data(), which=st.sampled_from(["scale", "min_log_prob"]), on_target=st.booleans())
def test_mutated_row_head(box, data, which, on_target):
    h = box.h
    row = data.draw(st.integers(0, h.n_chunk * h.rows - 1))
    old = box.heads[row, 0 if which == "scale" else 1]
    near = [float(old) * 2, float(np.nextafter(old, np.float32(1)))]  # one float32 step away
    new = np.float32(data.draw(st.one_of(_F32, st.sampled_from(near))))
    if new.tobytes() == old.tobytes():
        return
    at = h.data_offset + row * h.row_bytes + (0 if which == "scale" else 4)
    o = box.run(box.raw[:at] + new.tobytes() + box.raw[at + 4 :], on_target)
    c, r = divmod(row, h.rows)
    if not np.isfinite(new) or (which == "scale" and new < 0):
        assert o.code == 2 and f"chunk {c} row {r}: stored scale" in o.err, o.err
    elif which == "min_log_prob" or box.codes[row] > 0:
        assert o.code == 1, (which, float(old), float(new), o.err)  # the scored token's logprob moved


@pytest.mark.slow
@settings(FUZZ, max_examples=150)
@given(data=st.data(), scored=st.booleans(), on_target=st.booleans())
def test_mutated_row_word(box, data, scored, on_target):
    h = box.h
    row = data.draw(st.integers(0, h.n_chunk * h.rows - 1))
    c, r = divmod(row, h.rows)
    col = int(box.tokens[c, h.first + 1 + r]) if scored else data.draw(st.integers(0, h.n_vocab - 1))
    at = h.data_offset + row * h.row_bytes + 8 + 2 * col
    old = struct.unpack("<H", box.raw[at : at + 2])[0]
    new = data.draw(st.one_of(st.integers(0, 65535), st.integers(0, 15).map(lambda b: old ^ (1 << b))))
    if new == old:
        return
    o = box.run(box.raw[:at] + struct.pack("<H", new) + box.raw[at + 2 :], on_target)
    if col == int(box.tokens[c, h.first + 1 + r]):
        assert o.code == 1, o.err  # the scored token's logprob moved by scale * (new - old)


@pytest.mark.slow
@settings(FUZZ, max_examples=200)
@given(data=st.data(), on_target=st.booleans())
def test_mutated_bytes(box, data, on_target):
    """Random bytes anywhere: what the changed bytes decide (header, tokens past position 0, a
    non-finite row head) never exits 0."""
    raw = bytearray(box.raw)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if raw == box.raw:
        return
    o = box.run(bytes(raw), on_target)
    h = box.h
    tokens = np.frombuffer(bytes(raw), dtype="<i4", count=h.n_ctx * h.n_chunk, offset=20).reshape(h.n_chunk, h.n_ctx)
    heads = np.frombuffer(bytes(raw), dtype="<u2", offset=h.data_offset).reshape(-1, h.row_bytes // 2)[:, :4]
    heads = heads.copy().view("<f4")
    if raw[:20] != box.raw[:20] or np.any(tokens[:, 1:] != box.tokens[:, 1:]) or not np.all(np.isfinite(heads)):
        assert o.code != 0, o.err


@settings(FUZZ, max_examples=80)
@given(cut=st.integers(0, 20_000), junk=st.binary(min_size=1, max_size=64), grow=st.booleans(), on_target=st.booleans())
def test_cut_or_grown_file(box, cut, junk, grow, on_target):
    data = box.raw + junk if grow else box.raw[: cut % len(box.raw)]
    o = box.run(data, on_target)
    assert o.code == 2, o.err


# --------------------------------------------------------------------------- explicit hostile files


def _sparse(path: Path, n_ctx: int, n_vocab: int, n_chunk: int, *, uniform: bool = False) -> KldHeader:
    """A base file holding only its header and zero tokens, grown sparse to the size its header implies;
    with ``uniform`` each row stores the uniform distribution (scale 0, min_log_prob -ln V)."""
    h = KldHeader(str(path), n_ctx, n_vocab, n_chunk)
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIii", MAGIC, n_ctx, n_vocab, n_chunk) + bytes(4 * n_ctx * n_chunk))
        if uniform:
            for row in range(n_chunk * h.rows):
                f.seek(h.offset(0, row))
                f.write(struct.pack("<ff", 0.0, -math.log(n_vocab)))
        f.truncate(h.size)
    return h


def test_a_vocabulary_of_2_40_bytes_of_logits_is_refused_before_a_row_is_sized(tmp_path):
    """Sizes agree (a sparse 1 TiB file); the declared vocabulary alone refuses it, in bounded memory."""
    a, b = tmp_path / "a.kld", tmp_path / "b.kld"
    try:
        h = _sparse(a, 514, (1 << 31) - 2, 1)
        _sparse(b, 514, (1 << 31) - 2, 1)
    except OSError as e:  # a filesystem without sparse files this large
        pytest.skip(f"cannot make a sparse {1 << 40}-byte file here: {e}")
    assert h.size >= 1 << 40 and a.stat().st_size == h.size
    rc, err, rss = run_child("comparator", "logprobs", a, b, timeout=120)
    print(f"2^40-byte vocabulary header: exit {rc}, peak RSS {rss / 2**20:.0f} MiB")
    assert rc == 2 and err == (
        f"error: {a}: declares a vocabulary of {(1 << 31) - 2}, over the limit {MAX_VOCAB} "
        "(real vocabularies reach about 262k)"
    ), err
    assert rss < LIMIT, rss
    with pytest.raises(CorruptDumpError, match="declares a vocabulary"):
        read_header(a)


def test_the_largest_vocabulary_is_compared_in_bounded_memory(tmp_path):
    """Two files of MAX_VOCAB (56 MiB each, sparse) go through the whole KL pass under the limit; one more
    token is refused."""
    a, b = tmp_path / "a.kld", tmp_path / "b.kld"
    for p in (a, b):
        _sparse(p, N_CTX, MAX_VOCAB, N_CHUNK, uniform=True)
    rc, err, rss = run_child("comparator", "logprobs", a, b, "--json", tmp_path / "v.json", timeout=300)
    print(f"MAX_VOCAB ({MAX_VOCAB}) files compared: exit {rc}, peak RSS {rss / 2**20:.0f} MiB")
    assert rc == 0, err  # the same uniform rows on both sides
    assert rss < LIMIT, rss
    _sparse(b, N_CTX, MAX_VOCAB + 1, N_CHUNK)
    rc, err, _ = run_child("comparator", "logprobs", a, b)
    assert rc == 2 and f"{b}: declares a vocabulary of {MAX_VOCAB + 1}, over the limit" in err, err


def test_positions_over_the_limit_are_refused(box, tmp_path):
    a = tmp_path / "a.kld"
    n_chunk = MAX_KLD_POSITIONS // (2 * N_CTX) + 1
    _sparse(a, 2 * N_CTX, 2, n_chunk)
    o = run_main(main, ["logprobs", box.base, a])
    assert check_outcome(o) == 2 and o.err == (
        f"error: {a}: {n_chunk} chunks of {2 * N_CTX} tokens are "
        f"{n_chunk * 2 * N_CTX} positions, over the limit of "
        f"{MAX_KLD_POSITIONS} a llama.cpp KL-divergence base file may hold\n"
    )


@pytest.fixture
def alarm():
    """Fail a test that blocks for 20 s instead of hanging the suite."""
    with deadline(20):
        yield


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_a_device_at_the_path_is_refused_without_blocking(box, tmp_path, alarm, kind):
    path = tmp_path / "x.kld"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    what = "a FIFO" if kind == "fifo" else "a device"
    with pytest.raises(CorruptDumpError, match=f"^{path}: {what}, not a regular file; refusing to read it$"):
        KldFile(path)  # the library: opened non-blocking, refused on its fstat
    assert not is_kld_file(path)
    rc, err, rss = run_child("comparator", "logprobs", box.base, path, timeout=60)  # the CLI: refused on its stat
    assert rc == 2 and err == f"error: {path}: {what}, not a dump directory or a regular file; refusing to read it", err
    assert rss < LIMIT, rss


def test_a_file_that_shrinks_or_grows_while_it_is_read(box, tmp_path):
    """Sizes are checked at the start and the end of each pass; a read cut short is named."""
    p = tmp_path / "x.kld"
    p.write_bytes(box.raw)
    k = KldFile(p)
    with pytest.raises(CorruptDumpError, match="truncated while it was read"), k.open():
        os.truncate(p, len(box.raw) - 100)
        k.rows("1", np.arange(box.h.rows))
    with pytest.raises(CorruptDumpError, match="changed size since its header was read"):
        k.sequences()
    p.write_bytes(box.raw)
    with pytest.raises(CorruptDumpError, match="changed size while it was read"), k.open():
        k.rows("0", np.arange(2))
        with open(p, "ab") as f:
            f.write(b"\0" * 8)
    p.write_bytes(box.raw)
    with k.open():
        with pytest.raises(IndexError):  # a caller's index outside the layout is refused, never read
            k.rows("0", np.array([box.h.rows]))
        assert k.rows("0", np.arange(2)).shape == (2, box.h.n_vocab)


def test_the_same_nan_row_on_both_sides_never_passes(box, tmp_path):
    """NaN logits stored on both sides would be "no difference" for the verdict: the reader refuses them."""
    h = box.h
    at = h.data_offset + 3 * h.row_bytes + 4
    raw = box.raw[:at] + struct.pack("<f", math.nan) + box.raw[at + 4 :]
    (tmp_path / "a.kld").write_bytes(raw)
    (tmp_path / "b.kld").write_bytes(raw)
    o = run_main(main, ["logprobs", tmp_path / "a.kld", tmp_path / "b.kld"])
    assert check_outcome(o) == 2 and "chunk 0 row 3: stored scale" in o.err and "min_log_prob nan" in o.err, o.err
