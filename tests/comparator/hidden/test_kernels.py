"""comparator.hidden.kernels: the C kernel (every ISA it has) against the numpy reference."""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comparator.hidden import kernels
from comparator.hidden.kernels import HAVE_EXTENSION, BlockStats, row_stats, row_stats_reference

DTYPES = ["F64", "F32", "F16", "BF16"]
ISAS: tuple[str, ...] = kernels._kernels.ISAS if HAVE_EXTENSION else ()
needs_ext = pytest.mark.skipif(not HAVE_EXTENSION, reason="comparator._kernels not built")
NAN, INF = float("nan"), float("inf")
# (x, y) special pairs; None keeps the finite random value.
SPECIALS = [
    (NAN, NAN),
    (NAN, None),
    (None, NAN),
    (INF, INF),
    (-INF, -INF),
    (INF, -INF),
    (INF, None),
    (None, -INF),
    (NAN, INF),
    (-INF, NAN),
]


@contextlib.contextmanager
def use_isa(isa: str | None) -> Iterator[None]:
    """Run the C kernel with a forced instruction set (None: the reference only)."""
    if isa is None:
        yield
        return
    kernels._kernels._set_isa(isa)
    try:
        yield
    finally:
        kernels._kernels._set_isa(None)


def to_storage(v: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values -> raw storage array (bf16: truncated float32 bits)."""
    if dtype == "BF16":
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype({"F64": np.float64, "F32": np.float32, "F16": np.float16}[dtype])


def make_pair(
    rows: int,
    cols: int,
    dtype: str,
    seed: int,
    scale: float = 1.0,
    specials: list[tuple[int, tuple[float | None, float | None]]] = (),
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * scale
    y = x + rng.standard_normal((rows, cols)) * scale * 1e-2
    same = rng.random((rows, cols)) < 0.2  # some exactly equal pairs and some zeros
    y[same] = x[same]
    x[rng.random((rows, cols)) < 0.05] = 0.0
    for pos, (sx, sy) in specials:
        if rows * cols:
            r, c = divmod(pos % (rows * cols), cols)
            if sx is not None:
                x[r, c] = sx
            if sy is not None:
                y[r, c] = sy
    return to_storage(x, dtype), to_storage(y, dtype)


def assert_same(c: BlockStats, r: BlockStats) -> None:
    """Sums agree to ~1e-12 relative (inf/nan must match), max and counts exactly."""
    assert c.row.shape == r.row.shape and c.row.dtype == np.float64
    np.testing.assert_allclose(c.row[:, :3], r.row[:, :3], rtol=1e-12, atol=0)
    # sum a*b may cancel: measure its error against sqrt(sum a^2 * sum b^2) (Cauchy-Schwarz)
    scale = np.sqrt(r.row[:, 1] * r.row[:, 2])
    fin = np.isfinite(r.row[:, 3]) & np.isfinite(scale)
    assert np.all(np.abs(c.row[fin, 3] - r.row[fin, 3]) <= 1e-12 * scale[fin])
    np.testing.assert_array_equal(c.row[~fin, 3], r.row[~fin, 3])
    np.testing.assert_array_equal(c.row[:, 4], r.row[:, 4])
    assert c.max_abs == r.max_abs
    assert c.sum_abs == pytest.approx(r.sum_abs, rel=1e-12, abs=0)
    assert (c.nan_x, c.inf_x, c.nan_y, c.inf_y) == (r.nan_x, r.inf_x, r.nan_y, r.inf_y)


# -- reference semantics (always run) -------------------------------------------------------


def test_reference_semantics_by_hand() -> None:
    x = np.array([[1.0, NAN, INF, INF, NAN, 2.0, -INF]], dtype=np.float32)
    y = np.array([[0.5, NAN, INF, -INF, 1.0, 2.0, 3.0]], dtype=np.float32)
    s = row_stats_reference(x, y, "F32")
    # finite pairs: (1, .5) and (2, 2); NaN/NaN and inf/inf equal; inf/-inf, NaN/1, -inf/3 mismatch
    np.testing.assert_array_equal(s.row, [[0.25, 5.0, 4.25, 4.5, 3.0]])
    assert (s.max_abs, s.sum_abs) == (0.5, 0.5)
    assert (s.nan_x, s.inf_x, s.nan_y, s.inf_y) == (2, 3, 1, 2)


def widen(v: np.ndarray, dtype: str) -> np.ndarray:
    """Raw storage -> float64 by torch (bf16 bits read as torch.bfloat16), apart from the library's to_float64."""
    if dtype == "BF16":
        return torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).double().numpy()
    return v.astype(np.float64)


def by_definition(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Per row of two float64 arrays: exact sums (math.fsum) of d^2, a^2, b^2, a*b over the pairs where both
    sides are finite, and the count of the other pairs that are not equal (NaN/NaN and equal infinities are);
    and every |d| of a finite pair."""
    rows, diffs = [], []
    for ra, rb in zip(a.tolist(), b.tolist(), strict=True):
        pairs = [(p, q) for p, q in zip(ra, rb, strict=True) if math.isfinite(p) and math.isfinite(q)]
        others = [(p, q) for p, q in zip(ra, rb, strict=True) if not (math.isfinite(p) and math.isfinite(q))]
        unequal = [1 for p, q in others if not (p == q or (math.isnan(p) and math.isnan(q)))]
        rows.append(
            [
                math.fsum((p - q) ** 2 for p, q in pairs),
                math.fsum(p * p for p, _ in pairs),
                math.fsum(q * q for _, q in pairs),
                math.fsum(p * q for p, q in pairs),
                len(unequal),
            ]
        )
        diffs += [abs(p - q) for p, q in pairs]
    return np.array(rows), diffs


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_without_extension(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """Without the extension, row_stats gives the statistics their definition gives: sums over finite pairs,
    hence rel_diff = |x-y|^2 / (|x|^2 + |y|^2) per token and per tensor; NaN/Inf left out and counted."""
    rows, cols = 7, 33
    # every special pair, and one more NaN and Inf in x: the four counts differ (rows 0..4)
    extra = [(NAN, None), (INF, None)]
    specials = list(zip([0, 17, 34, 40, 45, 70, 88, 99, 120, 131, 150, 160], SPECIALS + extra, strict=True))
    x, y = make_pair(rows, cols, dtype, seed=11, specials=specials)
    x[5] = y[5] = 0  # a row of zeros on both sides
    x[6] = 0  # a row of zeros on one side only: rel_diff 1 by the definition
    monkeypatch.setattr(kernels, "_kernels", None)
    s = row_stats(x, y, dtype)
    a, b = widen(x, dtype), widen(y, dtype)
    want, diffs = by_definition(a, b)
    assert s.row.shape == (rows, 5)
    np.testing.assert_allclose(s.row[:, :3], want[:, :3], rtol=1e-12, atol=0)
    # sum a*b may cancel: its error against sqrt(sum a^2 * sum b^2) (Cauchy-Schwarz)
    assert np.all(np.abs(s.row[:, 3] - want[:, 3]) <= 1e-12 * np.sqrt(want[:, 1] * want[:, 2]))
    np.testing.assert_array_equal(s.row[:, 4], want[:, 4])
    assert want[:5, 4].sum() > 0 and not want[5:, 4].any()  # the specials made mismatches, where they were put
    np.testing.assert_array_equal(s.row[5, :4], 0.0)
    # rel_diff per token and per tensor, from the fallback's sums and from the definition
    live = want[:, 1] + want[:, 2] > 0
    token = s.row[live, 0] / (s.row[live, 1] + s.row[live, 2])
    np.testing.assert_allclose(token, want[live, 0] / (want[live, 1] + want[live, 2]), rtol=1e-12)
    assert token[-1] == pytest.approx(1.0, rel=1e-12) and (token[:-1] < 0.5).all()  # y near x elsewhere
    tensor = s.row[:, 0].sum() / (s.row[:, 1].sum() + s.row[:, 2].sum())
    assert tensor == pytest.approx(want[:, 0].sum() / (want[:, 1].sum() + want[:, 2].sum()), rel=1e-12)
    assert s.max_abs == max(diffs) and s.sum_abs == pytest.approx(math.fsum(diffs), rel=1e-12)
    counts = (np.isnan(a).sum(), np.isinf(a).sum(), np.isnan(b).sum(), np.isinf(b).sum())
    assert (s.nan_x, s.inf_x, s.nan_y, s.inf_y) == counts and len(set(counts)) == 4


def test_empty_blocks() -> None:
    for shape in [(0, 5), (3, 0)]:
        x = np.zeros(shape, np.float32)
        s = row_stats(x, x, "F32")
        assert s.row.shape == (shape[0], 5) and not s.row.any()
        assert (s.max_abs, s.sum_abs, s.nan_x, s.inf_x, s.nan_y, s.inf_y) == (0.0, 0.0, 0, 0, 0, 0)


def test_wrapper_copies_strided_and_byteswapped_input() -> None:
    x, y = make_pair(6, 20, "F32", 4, specials=[(7, (INF, None))])
    xs = np.asfortranarray(x)  # not C-contiguous
    ys = y.astype(">f4")  # non-native byte order
    assert_same(row_stats(xs, ys, "F32"), row_stats_reference(x, y, "F32"))


def test_wrapper_rejects_bad_input() -> None:
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="shape"):
        row_stats(x, np.zeros((3, 2), np.float32), "F32")
    with pytest.raises(TypeError):
        row_stats(x, x, "BF16")
    with pytest.raises(ValueError, match="dtype"):
        row_stats(x, x, "I32")


# -- C kernel against the reference -----------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [0, 1, 3, 4, 5, 7, 8, 9, 17, 1023, 1025])
@pytest.mark.parametrize("rows", [1, 3])
def test_matches_reference_shapes(isa: str, dtype: str, rows: int, cols: int) -> None:
    # specials land in the SIMD body and in the row tail, in different rows
    specials = list(zip([0, cols - 1, cols + 2, 2 * cols + cols // 2, 5], SPECIALS[::2], strict=False))
    x, y = make_pair(rows, cols, dtype, seed=cols * 7 + rows, specials=specials)
    with use_isa(isa):
        assert_same(row_stats(x, y, dtype, threads=1), row_stats_reference(x, y, dtype))


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 6),
    cols=st.integers(0, 70),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-3, 1.0, 60.0]),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=6),
)
def test_matches_reference_random(
    isa: str,
    dtype: str,
    rows: int,
    cols: int,
    seed: int,
    scale: float,
    specials: list[tuple[int, tuple[float | None, float | None]]],
) -> None:
    x, y = make_pair(rows, cols, dtype, seed, scale, specials)
    with use_isa(isa):
        assert_same(row_stats(x, y, dtype, threads=1), row_stats_reference(x, y, dtype))


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_explicit_nonfinite_cases(isa: str) -> None:
    x = np.array([[1.0, NAN, INF, INF, NAN, 2.0, -INF, 4.0, 5.0]], dtype=np.float32)
    y = np.array([[0.5, NAN, INF, -INF, 1.0, 2.0, 3.0, 4.0, 5.0]], dtype=np.float32)
    with use_isa(isa):
        s = row_stats(x, y, "F32")
    np.testing.assert_array_equal(s.row, [[0.25, 46.0, 45.25, 45.5, 3.0]])
    assert (s.max_abs, s.sum_abs, s.nan_x, s.inf_x, s.nan_y, s.inf_y) == (0.5, 0.5, 2, 3, 1, 2)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_f64_overflow_is_handled_like_reference(isa: str) -> None:
    x, y = make_pair(4, 13, "F64", 1)
    x[1, 2], x[2, 11] = 1e200, -1e200  # finite, but squares overflow: slow path, inf sums
    with use_isa(isa):
        assert_same(row_stats(x, y, "F64"), row_stats_reference(x, y, "F64"))


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_inputs_are_exactly_zero(isa: str, dtype: str) -> None:
    x, _ = make_pair(3, 37, dtype, 5)
    with use_isa(isa):
        s = row_stats(x, x.copy(), dtype)
    assert np.all(s.row[:, 0] == 0.0) and s.max_abs == 0.0 and s.sum_abs == 0.0
    np.testing.assert_array_equal(s.row[:, 1], s.row[:, 2])
    np.testing.assert_array_equal(s.row[:, 1], s.row[:, 3])


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pos", [0, 5, 10])  # SIMD body and row tail of 11 columns
def test_single_ulp_float32_is_exact(isa: str, pos: int) -> None:
    x = np.full((2, 11), 3.0, np.float32)
    y = x.copy()
    y[1, pos] = np.nextafter(np.float32(3.0), np.float32(4.0))  # 3 + 2^-22
    with use_isa(isa):
        s = row_stats(x, y, "F32")
    assert s.row[0, 0] == 0.0 and s.row[1, 0] == 2.0**-44
    assert s.max_abs == 2.0**-22 and s.sum_abs == 2.0**-22


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_conversions_match_torch(isa: str, dtype: str) -> None:
    # every bit pattern, repeated over 8 columns (SIMD loads); y = 1.0, so sum a*b = 8a exactly
    bits = np.arange(1 << 16, dtype=np.uint16)
    tdtype = torch.float16 if dtype == "F16" else torch.bfloat16
    want = torch.from_numpy(bits.view(np.int16)).view(tdtype).double().numpy()
    one = np.uint16(0x3C00 if dtype == "F16" else 0x3F80)
    x = np.repeat(bits, 8).reshape(-1, 8)
    if dtype == "F16":
        x, y = x.view(np.float16), np.full(x.shape, one, np.uint16).view(np.float16)
    else:
        y = np.full(x.shape, one, np.uint16)
    with use_isa(isa):
        s = row_stats(x, y, dtype)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(s.row[fin, 3], 8 * want[fin])
    np.testing.assert_array_equal(s.row[fin, 1], 8 * want[fin] ** 2)
    np.testing.assert_array_equal(s.row[~fin, 4], 8.0)
    assert s.nan_x == 8 * np.isnan(want).sum() and s.inf_x == 8 * np.isinf(want).sum()
    assert s.nan_y == s.inf_y == 0


@needs_ext
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_merge_like_one_call(threads: int) -> None:
    x, y = make_pair(
        301,
        700,
        "F32",
        3,
        specials=[(10, (NAN, None)), (150_000, (INF, INF)), (200_000, (None, -INF)), (210_000, (NAN, NAN))],
    )
    assert_same(row_stats(x, y, "F32", threads=threads), row_stats_reference(x, y, "F32"))


@needs_ext
def test_raw_call_accepts_readonly_buffers(tmp_path) -> None:
    x, y = make_pair(4, 10, "F32", 2)
    path = tmp_path / "x.bin"
    path.write_bytes(x.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        y.setflags(write=False)
        out = np.empty((4, 5))
        res = kernels._kernels.row_stats(memoryview(mm), y, "F32", 4, 10, out)
    ref = row_stats_reference(x, y, "F32")
    np.testing.assert_allclose(out, ref.row, rtol=1e-12)
    assert res[0] == ref.max_abs and res[2:] == (0, 0, 0, 0)


@needs_ext
def test_raw_call_validates_buffers() -> None:
    k = kernels._kernels.row_stats
    x = np.zeros((4, 8), np.float32)
    out = np.empty((4, 5))
    with pytest.raises(ValueError, match="x buffer too small"):
        k(x[:3], x, "F32", 4, 8, out)
    with pytest.raises(ValueError, match="y buffer too small"):
        k(x, x[:3], "F32", 4, 8, out)
    with pytest.raises(ValueError, match="need 256 for 4 x 8 F64"):
        k(x, x, "F64", 4, 8, out)
    with pytest.raises(ValueError, match="out buffer too small"):
        k(x, x, "F32", 4, 8, out[:3])
    with pytest.raises(ValueError, match="aligned"):
        k(memoryview(bytes(129))[1:], x, "F32", 4, 8, out)
    with pytest.raises(ValueError, match="dtype"):
        k(x, x, "F8", 4, 8, out)
    with pytest.raises(ValueError, match=">= 0"):
        k(x, x, "F32", -1, 8, out)
    with pytest.raises(BufferError):
        k(x, x, "F32", 4, 8, out.tobytes())  # out must be writable


@needs_ext
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_many_units_match_one_call_each(threads: int) -> None:
    """row_stats_many runs its units on its own threads: each unit's result and rows are those of
    a row_stats call on that unit alone, bit for bit, whatever the thread count (F16 included,
    whose table the first F16 unit fills)."""
    k = kernels._kernels
    units, alone = [], []
    for i, dtype in enumerate(["F32", "F16", "BF16", "F64", "F32", "F16"]):
        x, y = make_pair(7 + i, 33, dtype, seed=i, scale=1e200 if dtype == "F64" else 1.0)
        x[i % 7, 3] = np.nan if dtype != "BF16" else x[i % 7, 3]
        out, exps = np.full((x.shape[0], 5), -1.0), np.full((x.shape[0], 2), -7, np.int32)
        units.append((x, y, dtype, x.shape[0], 33, out, exps))
        out1, exps1 = np.empty_like(out), np.empty_like(exps)
        alone.append((k.row_stats(x, y, dtype, x.shape[0], 33, out1, exps1), out1, exps1))
    results = k.row_stats_many(units, threads)
    assert len(results) == len(units)
    for res, unit, (res1, out1, exps1) in zip(results, units, alone, strict=True):
        assert res == res1
        np.testing.assert_array_equal(unit[5], out1)
        np.testing.assert_array_equal(unit[6], exps1)
    assert k.row_stats_many([], threads) == []


@needs_ext
def test_many_units_refuse_bad_input() -> None:
    """A bad unit or thread count is refused before any unit runs (nothing written), naming the problem."""
    k = kernels._kernels
    x = np.zeros((4, 8), np.float32)
    out = np.full((4, 5), 7.0)
    good = (x, x, "F32", 4, 8, out)
    assert k.MAX_THREADS == 64
    for threads in (0, 65):
        with pytest.raises(ValueError, match="threads must be in 1..64"):
            k.row_stats_many([good], threads)
    with pytest.raises(TypeError, match="unit 1 is not a tuple"):
        k.row_stats_many([good, [x, x, "F32", 4, 8, out]], 2)
    with pytest.raises(ValueError, match="out buffer too small"):
        k.row_stats_many([good, (x, x, "F32", 4, 8, out[:3])], 2)
    with pytest.raises(TypeError, match="sequence"):
        k.row_stats_many(5, 2)
    assert (out == 7.0).all()  # the good unit never ran
