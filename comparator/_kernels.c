/*
 * comparator._kernels -- fast per-row difference statistics of two dumps.
 *
 * row_stats(x, y, dtype, rows, cols, out) reads two raw row-major blocks of
 * safetensors dtype F64/F32/F16/BF16, widens a, b to double, d = a - b, and
 * writes out[r] = (sum d^2, sum a^2, sum b^2, sum a*b, mismatches) per row;
 * it returns (max |d|, sum |d|, nan_x, inf_x, nan_y, inf_y) for the block.
 * Pairs with a NaN/Inf stay out of the sums: NaN/NaN and equal infinities
 * are "equal", any other such pair is a mismatch.
 *
 * Speed: hidden states are almost always finite, so each row is reduced
 * branch-free with SIMD lanes as independent accumulators, and NaN/Inf
 * simply propagate into sum a^2 / sum b^2.  Only a row whose sums come out
 * non-finite is redone by the exact per-element path.  (A finite f32/f16/
 * bf16 squared in double cannot overflow, so a non-finite sum proves a
 * non-finite element; for F64, huge finite values also take the slow path,
 * with the same result.)  GCC does not vectorise strict-IEEE reductions
 * (that needs reassociation), so the lanes are written with intrinsics:
 * SSE2 (x86-64 baseline) or AVX2+F16C, chosen at run time; other targets
 * get plain C.  The GIL is released so callers can run blocks in threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
#include <immintrin.h>
#endif

/* float16 -> float32 for all 65536 bit patterns, filled at module init.
 * Every half value is exactly representable in float32; 256 KiB fits L2. */
static float f16_table[65536];

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

/* Per-call (per-thread) accumulators for the block-wide results. */
typedef struct {
    double max_abs, sum_abs;
    Py_ssize_t nan_x, inf_x, nan_y, inf_y;
} Totals;

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
    if (!isfinite(s[1]) || !isfinite(s[2]))                                    \
        return 0;                                                              \
    o[0] = s[0]; o[1] = s[1]; o[2] = s[2]; o[3] = s[3]; o[4] = 0.0;            \
    t->sum_abs += s[4];                                                        \
    if (m > t->max_abs) t->max_abs = m;                                        \
    return 1;                                                                  \
}                                                                              \
                                                                               \
ATTR static void block_##ISA##_##NAME(const void *xv, const void *yv,         \
                                      Py_ssize_t rows, Py_ssize_t cols,        \
                                      double *out, Totals *t)                  \
{                                                                              \
    const T *x = (const T *)xv, *y = (const T *)yv;                            \
    for (Py_ssize_t r = 0; r < rows; r++)                                      \
        if (!fast_##ISA##_##NAME(x + r * cols, y + r * cols, cols,             \
                                 out + 5 * r, t))                              \
            slow_##NAME(x + r * cols, y + r * cols, cols, out + 5 * r, t);     \
}

/* slow_NAME: exact per-element semantics; also counts NaN/Inf. */
#define DEFINE_SLOW(NAME, T)                                                   \
static void slow_##NAME(const T *x, const T *y, Py_ssize_t n, double *o,       \
                        Totals *t)                                             \
{                                                                              \
    double s[4] = {0}, mism = 0.0;                                             \
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
        int na = isnan(a) != 0, nb = isnan(b) != 0;                            \
        t->nan_x += na; t->inf_x += !fa && !na;                                \
        t->nan_y += nb; t->inf_y += !fb && !nb;                                \
        if (!((na && nb) || a == b))        /* NaN/NaN, +inf/+inf: equal */    \
            mism += 1.0;                                                       \
    }                                                                          \
    o[0] = s[0]; o[1] = s[1]; o[2] = s[2]; o[3] = s[3]; o[4] = mism;           \
}

DEFINE_SLOW(f64, double)
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
                         double *, Totals *);

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

PyDoc_STRVAR(row_stats_doc,
"row_stats(x, y, dtype, rows, cols, out) -> "
"(max_abs_diff, sum_abs_diff, nan_x, inf_x, nan_y, inf_y)\n\n"
"Per-row (sum d^2, sum a^2, sum b^2, sum a*b, mismatched non-finite) of two\n"
"raw C-contiguous rows x cols blocks of safetensors dtype F64/F32/F16/BF16,\n"
"written into the float64 buffer out (rows*5).  Releases the GIL.");

static PyObject *row_stats(PyObject *self, PyObject *args)
{
    static const char *const dtypes[] = {"F64", "F32", "F16", "BF16"};
    static const size_t items[] = {8, 4, 2, 2};
    PyObject *obj[3];  /* x, y, out */
    const char *dtype;
    Py_ssize_t rows, cols;
    int k = 0, got = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOsnnO:row_stats", &obj[0], &obj[1], &dtype,
                          &rows, &cols, &obj[2]))
        return NULL;
    while (k < 4 && strcmp(dtype, dtypes[k]))
        k++;
    if (k == 4)
        return PyErr_Format(PyExc_ValueError, "unsupported dtype '%s' "
                            "(want F64, F32, F16 or BF16)", dtype);
    if (rows < 0 || cols < 0)
        return PyErr_Format(PyExc_ValueError, "rows and cols must be >= 0");
    if (rows > PY_SSIZE_T_MAX / 40 || (cols && rows > PY_SSIZE_T_MAX / 8 / cols))
        return PyErr_Format(PyExc_OverflowError, "rows*cols is too large");

    Py_buffer b[3];
    PyObject *res = NULL;
    while (got < 3 && PyObject_GetBuffer(obj[got], &b[got],
                                         got == 2 ? PyBUF_WRITABLE : PyBUF_SIMPLE) == 0)
        got++;
    if (got == 3 && check_buf("x", &b[0], rows, cols, items[k], dtype) == 0 &&
        check_buf("y", &b[1], rows, cols, items[k], dtype) == 0 &&
        check_buf("out", &b[2], rows, 5, 8, "float64") == 0) {
        Totals t = {0.0, 0.0, 0, 0, 0, 0};
        block_fn fn = kernels[isa][k];
        Py_BEGIN_ALLOW_THREADS
        fn(b[0].buf, b[1].buf, rows, cols, (double *)b[2].buf, &t);
        Py_END_ALLOW_THREADS
        res = Py_BuildValue("(ddnnnn)", t.max_abs, t.sum_abs, t.nan_x,
                            t.inf_x, t.nan_y, t.inf_y);
    }
    while (got--)
        PyBuffer_Release(&b[got]);
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
    for (uint32_t h = 0; h < 65536; h++)
        f16_table[h] = f16_decode((uint16_t)h);
#ifdef HAVE_X86
    __builtin_cpu_init();   /* SSE2 is part of x86-64 */
    n_isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 3 : 2;
#endif
    isa = n_isa - 1;
    PyObject *m = PyModule_Create(&module);
    PyObject *all = Py_BuildValue("(sss)", isa_names[0], isa_names[1], isa_names[2]);
    PyObject *avail = all ? PyTuple_GetSlice(all, 0, n_isa) : NULL;
    if (m && PyModule_AddObjectRef(m, "ISAS", avail) < 0)  /* ISAs usable here */
        Py_CLEAR(m);
    Py_XDECREF(all);
    Py_XDECREF(avail);
    return m;
}
