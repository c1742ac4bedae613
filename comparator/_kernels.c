/*
 * comparator._kernels -- fast per-row difference statistics of two dumps.
 *
 * row_stats(x, y, dtype, rows, cols, out[, exps]) reads two raw row-major
 * blocks of safetensors dtype F64/F32/F16/BF16, widens a, b to double,
 * d = a - b, and writes out[r] = (sum d^2, sum a^2, sum b^2, sum a*b,
 * mismatches) per row; it returns (max |d|, sum |d|, nan_x, inf_x, nan_y,
 * inf_y) for the block.  Pairs with a NaN/Inf stay out of the sums: NaN/NaN
 * and equal infinities are "equal", any other such pair is a mismatch.
 *
 * Range: squares of finite F64 values can overflow or underflow double, so
 * an F64 row whose sums leave a safe range is redone scaled, as in a scaled
 * sum of squares (LAPACK dnrm2): a by 2^-kx, b by 2^-ky (their largest
 * finite |value| then lies in [0.5, 1)) and d by 2^-max(kx, ky).  Powers of
 * two are exact, so no ratio changes.  With exps (int32 rows x 2) the row
 * keeps that scale: exps[r] = (kx, ky), and the true sums are out[r][0] *
 * 4^max(kx,ky), out[r][1] * 4^kx, out[r][2] * 4^ky, out[r][3] * 2^(kx+ky)
 * (rows not redone get (0, 0)); the return then has two more items: e,
 * with the true sum |d| = (2nd item) * 2^e, and the number of rows redone
 * (0: every exps[r] is (0, 0)).  Without exps the true sums are written,
 * rounded to double (inf where they exceed its range).  F32/F16/BF16 squares
 * always fit in double, so those rows never need it and pay nothing.
 *
 * Speed: hidden states are almost always finite, so each row is reduced
 * branch-free with SIMD lanes as independent accumulators, and NaN/Inf
 * simply propagate into sum a^2 / sum b^2.  Only a row whose sums come out
 * non-finite (or, for F64, outside the safe range) is redone by the exact
 * per-element path.  (A finite f32/f16/bf16 squared in double cannot
 * overflow, so a non-finite sum proves a non-finite element.)  GCC does not
 * vectorise strict-IEEE reductions (that needs reassociation), so the lanes
 * are written with intrinsics:
 * SSE2 (x86-64 baseline) or AVX2+F16C, chosen at run time; other targets
 * get plain C.  The GIL is released; row_stats_many(units, threads) runs a
 * tensor's row ranges on a few POSIX threads of its own, so a caller makes
 * one call per tensor and no Python thread hand-off (elsewhere: serially).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(_WIN32) && !defined(__STDC_NO_ATOMICS__)
#define HAVE_PTHREADS 1
#include <pthread.h>
#include <stdatomic.h>
#endif
#define MAX_THREADS 64      /* row_stats_many's bound on its threads */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>
#endif

/* float16 -> float32 for all 65536 bit patterns, filled by the first F16
 * call (under the GIL, before any thread reads it), so that importing the
 * module costs nothing.  Every half value is exactly representable in
 * float32; 256 KiB fits L2. */
static float f16_table[65536];
static int f16_ready;

static float f16_decode(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15), exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v;
    if (exp == 0)            /* zero or subnormal: man * 2^-24 */
        v = ldexp((double)man, -24);
    else if (exp == 31)      /* inf or nan */
        v = man ? (double)NAN : (double)INFINITY;
    else                     /* normal: 1.man * 2^(exp-15) */
        v = ldexp((double)(man | 0x400), (int)exp - 25);
    return (float)(sign ? -v : v);
}

/* Scalar loaders: one raw element -> double (all conversions exact). */
static inline double ld1_f64(const double *p) { return *p; }
static inline double ld1_f32(const float *p) { return (double)*p; }
static inline double ld1_f16(const uint16_t *p) { return f16_table[*p]; }
static inline double ld1_bf16(const uint16_t *p)
{
    uint32_t u = (uint32_t)*p << 16;   /* bf16 is the top half of a float32 */
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

/* Per-call (per-thread) accumulators for the block-wide results.  sum_abs
 * holds the rows summed unscaled; the rescaled F64 rows add into
 * sc_sum * 2^sc_exp instead (see add_scaled). */
typedef struct {
    double max_abs, sum_abs;
    Py_ssize_t nan_x, inf_x, nan_y, inf_y;
    double sc_sum;
    int sc_exp;
    Py_ssize_t scaled;      /* rows redone scaled (their exps may be nonzero) */
} Totals;

/* (*s, *e) += v * 2^ev, keeping the larger exponent: s * 2^e stays a sum
 * that no overflow can reach (the smaller term may lose only what double
 * could not hold anyway). */
static void add_scaled(double *s, int *e, double v, int ev)
{
    if (v == 0.0)
        return;
    if (*s == 0.0) {
        *s = v;
        *e = ev;
    } else if (ev > *e) {
        *s = ldexp(*s, *e - ev) + v;
        *e = ev;
    } else {
        *s += ldexp(v, ev - *e);
    }
}

/*
 * range_ok_NAME(s, n): whether the unscaled sums s (sum d^2, a^2, b^2, a*b,
 * |d|) of a finite n-element row are exact to double rounding.  Always for
 * F32/F16/BF16.  For F64 each square or product that underflows is off by
 * at most 2^-1075, so sums >= n * 2^-1015 are off by at most 2^-60 of
 * themselves (sum a*b: of sqrt(sum a^2 * sum b^2)); sums <= 2^960 leave room
 * to add up many rows.  sum d^2 may also be exactly 0 (sum |d| == 0).
 */
#define SAFE_LO 0x1p-1015
#define SAFE_HI 0x1p960
static inline int range_ok_f64(const double *s, Py_ssize_t n)
{
    double lo = (double)n * SAFE_LO;
    return s[1] >= lo && s[1] <= SAFE_HI && s[2] >= lo && s[2] <= SAFE_HI &&
           (s[0] >= lo || s[4] == 0.0);
}
static inline int range_ok_f32(const double *s, Py_ssize_t n)
{
    (void)s; (void)n;
    return 1;
}
#define range_ok_f16 range_ok_f32
#define range_ok_bf16 range_ok_f32

/*
 * "Vector" ops of the portable fallback: one double per lane, spelled like
 * the intrinsics so that one template (DEFINE_FAST) serves every ISA.
 */
#define sc_setzero_pd() 0.0
#define sc_set1_pd(v) (v)
#define sc_add_pd(a, b) ((a) + (b))
#define sc_sub_pd(a, b) ((a) - (b))
#define sc_mul_pd(a, b) ((a) * (b))
#define sc_andnot_pd(s, v) ((void)(s), fabs(v))
#define sc_max_pd(a, b) ((a) > (b) ? (a) : (b))
#define sc_storeu_pd(p, v) (*(p) = (v))
#define NO_ATTR

/* Software prefetch distance for the two input streams: the hardware
 * prefetcher alone left one core at ~8.5 instead of ~13 GB/s from DRAM. */
#define PREFETCH_BYTES 2048
#ifdef __GNUC__
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif

/*
 * fast_ISA_NAME: reduce one row assuming every element is finite, W lanes
 * at a time, each lane its own accumulator (one vector per sum is enough:
 * a second set measured no faster, the loop is memory-bound).  max_pd(e, m)
 * is "e > m ? e : m".  Returns 0 if the row holds a non-finite element; the
 * slow path then recomputes it.  Defines block_ISA_NAME over rows, too.
 */
#define DEFINE_FAST(ISA, NAME, T, W, VT, P, VLOAD, ATTR)                       \
ATTR static int fast_##ISA##_##NAME(const T *restrict x, const T *restrict y,  \
                                    Py_ssize_t n, double *restrict o,          \
                                    Totals *t)                                 \
{                                                                              \
    const VT sign = P##set1_pd(-0.0);                                          \
    VT dd = P##setzero_pd(), aa = dd, bb = dd, ab = dd, ad = dd, md = dd;      \
    Py_ssize_t i = 0;                                                          \
    for (; i + W <= n; i += W) {                                               \
        PREFETCH((const char *)(x + i) + PREFETCH_BYTES);                      \
        PREFETCH((const char *)(y + i) + PREFETCH_BYTES);                      \
        VT a = VLOAD(x + i), b = VLOAD(y + i), d = P##sub_pd(a, b);            \
        VT e = P##andnot_pd(sign, d);                    /* |d| */             \
        dd = P##add_pd(dd, P##mul_pd(d, d));                                   \
        aa = P##add_pd(aa, P##mul_pd(a, a));                                   \
        bb = P##add_pd(bb, P##mul_pd(b, b));                                   \
        ab = P##add_pd(ab, P##mul_pd(a, b));                                   \
        ad = P##add_pd(ad, e);                                                 \
        md = P##max_pd(e, md);                                                 \
    }                                                                          \
    double l[6][W], s[5] = {0}, m = 0.0;                                       \
    P##storeu_pd(l[0], dd); P##storeu_pd(l[1], aa); P##storeu_pd(l[2], bb);    \
    P##storeu_pd(l[3], ab); P##storeu_pd(l[4], ad); P##storeu_pd(l[5], md);    \
    for (int k = 0; k < W; k++) {                                              \
        for (int j = 0; j < 5; j++)                                            \
            s[j] += l[j][k];                                                   \
        m = l[5][k] > m ? l[5][k] : m;                                         \
    }                                                                          \
    for (; i < n; i++) {                                  /* row tail */       \
        double a = ld1_##NAME(x + i), b = ld1_##NAME(y + i), d = a - b;        \
        double e = fabs(d);                                                    \
        s[0] += d * d; s[1] += a * a; s[2] += b * b; s[3] += a * b;            \
        s[4] += e; m = e > m ? e : m;                                          \
    }                                                                          \
    if (!isfinite(s[1]) || !isfinite(s[2]) || !range_ok_##NAME(s, n))          \
        return 0;                                                              \
    o[0] = s[0]; o[1] = s[1]; o[2] = s[2]; o[3] = s[3]; o[4] = 0.0;            \
    t->sum_abs += s[4];                                                        \
    if (m > t->max_abs) t->max_abs = m;                                        \
    return 1;                                                                  \
}                                                                              \
                                                                               \
ATTR static void block_##ISA##_##NAME(const void *xv, const void *yv,         \
                                      Py_ssize_t rows, Py_ssize_t cols,        \
                                      double *out, int32_t *exps, Totals *t)   \
{                                                                              \
    const T *x = (const T *)xv, *y = (const T *)yv;                            \
    for (Py_ssize_t r = 0; r < rows; r++)                                      \
        if (!fast_##ISA##_##NAME(x + r * cols, y + r * cols, cols,             \
                                 out + 5 * r, t))                              \
            slow_##NAME(x + r * cols, y + r * cols, cols, out + 5 * r,         \
                        exps ? exps + 2 * r : NULL, t);                        \
}

/* Count one non-finite pair; returns whether it is a mismatch. */
static inline int count_nonfinite(double a, double b, int fa, int fb, Totals *t)
{
    int na = isnan(a) != 0, nb = isnan(b) != 0;
    t->nan_x += na; t->inf_x += !fa && !na;
    t->nan_y += nb; t->inf_y += !fb && !nb;
    return !((na && nb) || a == b);        /* NaN/NaN, +inf/+inf: equal */
}

/* slow_NAME: exact per-element semantics; also counts NaN/Inf.  The scale
 * exponents ex are not used: these dtypes never need scaling. */
#define DEFINE_SLOW(NAME, T)                                                   \
static void slow_##NAME(const T *x, const T *y, Py_ssize_t n, double *o,       \
                        int32_t *ex, Totals *t)                                \
{                                                                              \
    double s[4] = {0}, mism = 0.0;                                             \
    (void)ex;                                                                  \
    for (Py_ssize_t i = 0; i < n; i++) {                                       \
        double a = ld1_##NAME(x + i), b = ld1_##NAME(y + i);                   \
        int fa = isfinite(a), fb = isfinite(b);                                \
        if (fa && fb) {                                                        \
            double d = a - b, e = fabs(d);                                     \
            s[0] += d * d; s[1] += a * a; s[2] += b * b; s[3] += a * b;        \
            t->sum_abs += e;                                                   \
            if (e > t->max_abs) t->max_abs = e;                                \
            continue;                                                          \
        }                                                                      \
        mism += count_nonfinite(a, b, fa, fb, t);                              \
    }                                                                          \
    o[0] = s[0]; o[1] = s[1]; o[2] = s[2]; o[3] = s[3]; o[4] = mism;           \
}

/* The power of two that brings m (> 0) into [0.5, 1), clamped so that
 * 2^-k is a double: subnormal m then lands in [2^-53, 0.5), still exact.
 * m == 0 gets the smallest, so that max(kx, ky) follows the other side. */
#define MIN_SCALE_EXP (-1021)
static int scale_exp(double m)
{
    int k = MIN_SCALE_EXP;
    if (m > 0.0)
        frexp(m, &k);
    return k < MIN_SCALE_EXP ? MIN_SCALE_EXP : k > 1023 ? 1023 : k;
}

/*
 * slow_f64: the exact semantics for an F64 row, scaled: pass 1 finds the
 * largest finite |a| and |b| over pairs that enter the sums, pass 2 sums
 * a*2^-kx, b*2^-ky and d*2^-k (k = max(kx, ky)), where no square can
 * overflow and an underflowing one is below 2^-1022 of the row's norm.
 * |d| itself is exact unscaled (it is inf only past double's range), so max
 * |d| and the row's sum |d| are taken unscaled; only a sum |d| that
 * overflows is taken from the scaled |d| instead.  ex: where (kx, ky) go,
 * or NULL: write the sums unscaled (rounded, maybe inf).
 */
static void slow_f64(const double *x, const double *y, Py_ssize_t n, double *o,
                     int32_t *ex, Totals *t)
{
    double mx = 0.0, my = 0.0, s[4] = {0}, sa = 0.0, ss = 0.0, ma = 0.0;
    double mism = 0.0;
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (isfinite(x[i]) && isfinite(y[i])) {
            double a = fabs(x[i]), b = fabs(y[i]);
            mx = a > mx ? a : mx;
            my = b > my ? b : my;
        } else {
            bad = 1;
        }
    int kx = scale_exp(mx), ky = scale_exp(my), k = kx > ky ? kx : ky;
    if (!bad && mx == 0.0 && my == 0.0)   /* an all-zero row: no pass 2 */
        n = 0;
    double fx = ldexp(1.0, -kx), fy = ldexp(1.0, -ky), f = ldexp(1.0, -k);
    for (Py_ssize_t i = 0; i < n; i++) {
        double a = x[i], b = y[i];
        int fa = isfinite(a), fb = isfinite(b);
        if (fa && fb) {
            double as = a * fx, bs = b * fy, d = a * f - b * f, e = fabs(a - b);
            s[0] += d * d; s[1] += as * as; s[2] += bs * bs; s[3] += as * bs;
            sa += e; ss += fabs(d); ma = e > ma ? e : ma;
        } else {
            mism += count_nonfinite(a, b, fa, fb, t);
        }
    }
    if (ex) {
        o[0] = s[0]; o[1] = s[1]; o[2] = s[2]; o[3] = s[3];
        ex[0] = kx; ex[1] = ky;
    } else {
        o[0] = ldexp(s[0], 2 * k); o[1] = ldexp(s[1], 2 * kx);
        o[2] = ldexp(s[2], 2 * ky); o[3] = ldexp(s[3], kx + ky);
    }
    o[4] = mism;
    t->scaled++;
    if (isfinite(sa)) {            /* as m * 2^e, m < 1: rows add up safely */
        int e;
        double m = frexp(sa, &e);
        add_scaled(&t->sc_sum, &t->sc_exp, m, e);
    } else {
        add_scaled(&t->sc_sum, &t->sc_exp, ss, k);
    }
    if (ma > t->max_abs) t->max_abs = ma;
}

DEFINE_SLOW(f32, float)
DEFINE_SLOW(f16, uint16_t)
DEFINE_SLOW(bf16, uint16_t)

#define DEFINE_ISA(ISA, W, VT, P, LD, ATTR)                                    \
    DEFINE_FAST(ISA, f64, double, W, VT, P, LD##f64, ATTR)                     \
    DEFINE_FAST(ISA, f32, float, W, VT, P, LD##f32, ATTR)                      \
    DEFINE_FAST(ISA, f16, uint16_t, W, VT, P, LD##f16, ATTR)                   \
    DEFINE_FAST(ISA, bf16, uint16_t, W, VT, P, LD##bf16, ATTR)

DEFINE_ISA(scalar, 1, double, sc_, ld1_, NO_ATTR)

#ifdef HAVE_X86
/* SSE2 loaders, 2 elements -> __m128d.  bf16: interleaving zero words
 * below the raw bits gives (bits << 16) as float32. */
#define ld2_f64(p) _mm_loadu_pd(p)
#define ld2_f32(p) _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(p))))
#define ld2_f16(p) _mm_set_pd(f16_table[(p)[1]], f16_table[(p)[0]])
#define ld2_bf16(p) _mm_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(          \
    _mm_setzero_si128(), _mm_cvtsi32_si128(ld_u32(p)))))
static inline int ld_u32(const uint16_t *p) { int v; memcpy(&v, p, 4); return v; }
DEFINE_ISA(sse2, 2, __m128d, _mm_, ld2_, NO_ATTR)

/* AVX2 loaders, 4 elements -> __m256d; F16C converts halves in hardware. */
#define AVX2_ATTR __attribute__((target("avx2,f16c")))
#define ld4_f64(p) _mm256_loadu_pd(p)
#define ld4_f32(p) _mm256_cvtps_pd(_mm_loadu_ps(p))
#define ld4_f16(p) _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p))))
#define ld4_bf16(p) _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(       \
    _mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(p)))))
DEFINE_ISA(avx2, 4, __m256d, _mm256_, ld4_, AVX2_ATTR)
#endif

typedef void (*block_fn)(const void *, const void *, Py_ssize_t, Py_ssize_t,
                         double *, int32_t *, Totals *);

/* Kernels per ISA (rows) and dtype (columns: F64, F32, F16, BF16). */
static const char *const isa_names[] = {"scalar", "sse2", "avx2"};
static const block_fn kernels[][4] = {
    {block_scalar_f64, block_scalar_f32, block_scalar_f16, block_scalar_bf16},
#ifdef HAVE_X86
    {block_sse2_f64, block_sse2_f32, block_sse2_f16, block_sse2_bf16},
    {block_avx2_f64, block_avx2_f32, block_avx2_f16, block_avx2_bf16},
#endif
};
static int n_isa = 1;   /* ISAs this CPU supports (a prefix of the table) */
static int isa = 0;     /* ISA in use, the best one unless _set_isa() */

/* Check a buffer holds rows x cols items of type tname, suitably aligned. */
static int check_buf(const char *name, const Py_buffer *b, Py_ssize_t rows,
                     Py_ssize_t cols, size_t item, const char *tname)
{
    Py_ssize_t need = rows * cols * (Py_ssize_t)item;
    if (b->len < need) {
        PyErr_Format(PyExc_ValueError, "%s buffer too small: %zd bytes, need "
                     "%zd for %zd x %zd %s", name, b->len, need, rows, cols, tname);
        return -1;
    }
    if ((uintptr_t)b->buf % item) {
        PyErr_Format(PyExc_ValueError, "%s buffer is not %zu-byte aligned",
                     name, item);
        return -1;
    }
    return 0;
}

/* One block (or row range) to reduce: its buffers, held while it runs. */
typedef struct {
    Py_buffer b[4];         /* x, y, out[, exps] */
    int nbuf;               /* buffers held */
    block_fn fn;
    Py_ssize_t rows, cols;
    int32_t *exps;
    Totals t;
} Unit;

static void unit_close(Unit *u)
{
    while (u->nbuf > 0)
        PyBuffer_Release(&u->b[--u->nbuf]);
}

/* Parse row_stats' arguments (x, y, dtype, rows, cols, out[, exps]) into u,
 * holding its buffers; -1 with an exception set (and nothing held) if bad. */
static int unit_open(PyObject *args, Unit *u)
{
    static const char *const dtypes[] = {"F64", "F32", "F16", "BF16"};
    static const size_t items[] = {8, 4, 2, 2};
    PyObject *obj[4] = {NULL, NULL, NULL, Py_None};  /* x, y, out, exps */
    const char *dtype;
    int k = 0, want;
    memset(u, 0, sizeof *u);
    if (!PyArg_ParseTuple(args, "OOsnnO|O:row_stats", &obj[0], &obj[1], &dtype,
                          &u->rows, &u->cols, &obj[2], &obj[3]))
        return -1;
    while (k < 4 && strcmp(dtype, dtypes[k]))
        k++;
    if (k == 4) {
        PyErr_Format(PyExc_ValueError, "unsupported dtype '%s' "
                     "(want F64, F32, F16 or BF16)", dtype);
        return -1;
    }
    if (u->rows < 0 || u->cols < 0) {
        PyErr_Format(PyExc_ValueError, "rows and cols must be >= 0");
        return -1;
    }
    if (u->rows > PY_SSIZE_T_MAX / 40 ||
        (u->cols && u->rows > PY_SSIZE_T_MAX / 8 / u->cols)) {
        PyErr_Format(PyExc_OverflowError, "rows*cols is too large");
        return -1;
    }
    want = obj[3] == Py_None ? 3 : 4;
    while (u->nbuf < want && PyObject_GetBuffer(obj[u->nbuf], &u->b[u->nbuf],
                                                u->nbuf >= 2 ? PyBUF_WRITABLE : PyBUF_SIMPLE) == 0)
        u->nbuf++;
    if (u->nbuf < want ||
        check_buf("x", &u->b[0], u->rows, u->cols, items[k], dtype) ||
        check_buf("y", &u->b[1], u->rows, u->cols, items[k], dtype) ||
        check_buf("out", &u->b[2], u->rows, 5, 8, "float64") ||
        (want == 4 && check_buf("exps", &u->b[3], u->rows, 2, 4, "int32"))) {
        unit_close(u);
        return -1;
    }
    u->exps = want == 4 ? (int32_t *)u->b[3].buf : NULL;
    u->fn = kernels[isa][k];
    if (k == 2 && !f16_ready) {
        for (uint32_t h = 0; h < 65536; h++)
            f16_table[h] = f16_decode((uint16_t)h);
        f16_ready = 1;
    }
    return 0;
}

/* Reduce one unit; touches only its own buffers and totals (no GIL needed). */
static void unit_run(Unit *u)
{
    Totals t = {0.0, 0.0, 0, 0, 0, 0, 0.0, 0, 0};
    if (u->exps)
        memset(u->exps, 0, (size_t)u->rows * 2 * sizeof *u->exps);
    u->fn(u->b[0].buf, u->b[1].buf, u->rows, u->cols, (double *)u->b[2].buf,
          u->exps, &t);
    add_scaled(&t.sc_sum, &t.sc_exp, t.sum_abs, 0);
    u->t = t;
}

static PyObject *unit_result(const Unit *u)
{
    const Totals *t = &u->t;
    if (u->exps)
        return Py_BuildValue("(ddnnnnin)", t->max_abs, t->sc_sum, t->nan_x,
                             t->inf_x, t->nan_y, t->inf_y, t->sc_exp, t->scaled);
    return Py_BuildValue("(ddnnnn)", t->max_abs, ldexp(t->sc_sum, t->sc_exp),
                         t->nan_x, t->inf_x, t->nan_y, t->inf_y);
}

/* Run n units on up to `threads` threads (this one included), each pulling
 * the next unit from a shared counter; without threads support, serially. */
#if defined(HAVE_PTHREADS)
typedef struct {
    Unit *units;
    size_t n;
    atomic_size_t next;
} Work;

static void *work_loop(void *arg)
{
    Work *w = (Work *)arg;
    size_t i;
    while ((i = atomic_fetch_add(&w->next, 1)) < w->n)
        unit_run(&w->units[i]);
    return NULL;
}

static void run_units(Unit *units, size_t n, int threads)
{
    pthread_t tid[MAX_THREADS];
    int started = 0, helpers = threads - 1;
    Work w = {units, n, 0};
    if ((size_t)helpers > n - 1)
        helpers = n > 0 ? (int)(n - 1) : 0;
    while (started < helpers && pthread_create(&tid[started], NULL, work_loop, &w) == 0)
        started++;          /* a thread that cannot start leaves its share to the others */
    work_loop(&w);
    while (started--)
        pthread_join(tid[started], NULL);
}
#else
static void run_units(Unit *units, size_t n, int threads)
{
    (void)threads;
    for (size_t i = 0; i < n; i++)
        unit_run(&units[i]);
}
#endif

PyDoc_STRVAR(row_stats_doc,
"row_stats(x, y, dtype, rows, cols, out, exps=None) -> "
"(max_abs_diff, sum_abs_diff, nan_x, inf_x, nan_y, inf_y"
"[, sum_abs_exp, scaled_rows])\n\n"
"Per-row (sum d^2, sum a^2, sum b^2, sum a*b, mismatched non-finite) of two\n"
"raw C-contiguous rows x cols blocks of safetensors dtype F64/F32/F16/BF16,\n"
"written into the float64 buffer out (rows*5).  With exps (a writable int32\n"
"buffer, rows*2) F64 rows out of double's safe range stay scaled: exps[r] =\n"
"(kx, ky), true sums = out[r] * (4^max(kx,ky), 4^kx, 4^ky, 2^(kx+ky)), and\n"
"the true sum |d| is sum_abs_diff * 2^sum_abs_exp; scaled_rows counts\n"
"the rows that may have nonzero exps.  Releases the GIL.");

static PyObject *row_stats(PyObject *self, PyObject *args)
{
    Unit u;
    PyObject *res;
    (void)self;
    if (unit_open(args, &u) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    unit_run(&u);
    Py_END_ALLOW_THREADS
    res = unit_result(&u);
    unit_close(&u);
    return res;
}

PyDoc_STRVAR(row_stats_many_doc,
"row_stats_many(units, threads) -> list\n\n"
"row_stats(*unit) of every tuple in units, run on up to threads threads\n"
"(at most " Py_STRINGIFY(MAX_THREADS) ") that pull units from one shared counter, with the GIL\n"
"released throughout: one call per tensor, no Python thread hand-off.\n"
"Returns row_stats' result of each unit, in order.");

static PyObject *row_stats_many(PyObject *self, PyObject *args)
{
    PyObject *seq_obj, *seq, *res = NULL;
    int threads;
    Py_ssize_t n, opened = 0;
    Unit *units;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oi:row_stats_many", &seq_obj, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be in 1..%d, got %d",
                            MAX_THREADS, threads);
    seq = PySequence_Fast(seq_obj, "units must be a sequence of argument tuples");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    units = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *units);
    if (units == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    while (opened < n) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, opened);
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "unit %zd is not a tuple", opened);
            break;
        }
        if (unit_open(item, &units[opened]) < 0)
            break;
        opened++;
    }
    if (opened == n) {
        Py_BEGIN_ALLOW_THREADS
        run_units(units, (size_t)n, threads);
        Py_END_ALLOW_THREADS
        res = PyList_New(n);
        for (Py_ssize_t i = 0; res != NULL && i < n; i++) {
            PyObject *r = unit_result(&units[i]);
            if (r == NULL)
                Py_CLEAR(res);
            else
                PyList_SET_ITEM(res, i, r);
        }
    }
    while (opened--)
        unit_close(&units[opened]);
    PyMem_Free(units);
    Py_DECREF(seq);
    return res;
}

/* Testing hook: force an ISA (None: best available); returns the one used.
 * Not synchronised with running calls: switch only while none is running. */
static PyObject *set_isa(PyObject *self, PyObject *arg)
{
    const char *name = arg == Py_None ? isa_names[n_isa - 1] : PyUnicode_AsUTF8(arg);
    int k = 0;
    (void)self;
    if (name == NULL)
        return NULL;
    while (k < n_isa && strcmp(name, isa_names[k]))
        k++;
    if (k == n_isa)
        return PyErr_Format(PyExc_ValueError, "ISA '%s' is not available here", name);
    isa = k;
    return PyUnicode_FromString(isa_names[isa]);
}

static PyMethodDef methods[] = {
    {"row_stats", row_stats, METH_VARARGS, row_stats_doc},
    {"row_stats_many", row_stats_many, METH_VARARGS, row_stats_many_doc},
    {"_set_isa", set_isa, METH_O,
     "_set_isa(name or None) -> str: force 'scalar'/'sse2'/'avx2' (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Fast per-row difference statistics (see comparator.kernels).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
#ifdef HAVE_X86
    __builtin_cpu_init();   /* SSE2 is part of x86-64 */
    n_isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 3 : 2;
#endif
    isa = n_isa - 1;
    PyObject *m = PyModule_Create(&module);
    PyObject *all = Py_BuildValue("(sss)", isa_names[0], isa_names[1], isa_names[2]);
    PyObject *avail = all ? PyTuple_GetSlice(all, 0, n_isa) : NULL;
    if (m && (PyModule_AddObjectRef(m, "ISAS", avail) < 0  /* ISAs usable here */
              || PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0))
        Py_CLEAR(m);
    Py_XDECREF(all);
    Py_XDECREF(avail);
    return m;
}
