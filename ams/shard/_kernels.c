/* The sparse optimizer's row update as one loop over the pushed rows (ams/shard/optim.py).
 *
 * Why C: in numpy and torch the update is a gather of the rows, a gather of their momentum,
 * four or five passes of float32 arithmetic over the gathered copies, two passes checking
 * finiteness, and two scatters. Each pass over an (m, dim) float32 copy leaves the cache, and
 * each gathered row waits on memory alone. Here each row is read once, updated in registers
 * while the rows a few places ahead are already being fetched, and written once: back into the
 * table (with a copy of the old row kept, to put back if a later row of the push comes out
 * non-finite and the push is refused) or, for a table whose pushes move rows to new slots,
 * into staging buffers that ams.shard.optim scatters to them.
 *
 * The arithmetic is ams.shard.optim.SparseMomentumSGD's, in float32, rounded once to the stored
 * dtypes (round to nearest even), so the results equal the torch path's up to the rounding of
 * a fused multiply-add. Pointers and sizes are checked by the Python caller
 * (ams.shard.optim._compiled_update); nothing here may be called with other arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

enum { DT_FLOAT32 = 0, DT_FLOAT16 = 1, DT_BFLOAT16 = 2 };

/* Rows fetched ahead of the one being updated: enough to cover memory latency with a few
 * rows' loads in flight, few enough that they are still in cache when their turn comes. */
#define AHEAD 8

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The row loops vectorize to 8 floats at a time with AVX2 and FMA (x86-64-v3); the loader
 * picks the clone the CPU runs. */
#define UPDATE_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define UPDATE_CLONES
#endif

static inline size_t dtype_size(int dtype) { return dtype == DT_FLOAT32 ? 4 : 2; }

static inline float as_float(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline uint32_t as_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* float16 bits -> float32, exact for every input (subnormals, infinities, nans). Integer
 * arithmetic and selects, which compilers vectorize, where a cast to _Float16 is one value at
 * a time before AVX512-FP16. */
static inline float half_to_float(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7FFFu) << 13;    /* exponent and mantissa, in place */
    uint32_t exponent = o & 0x0F800000u;
    o += (uint32_t)(127 - 15) << 23;                /* rebias */
    o += exponent == 0x0F800000u ? (uint32_t)(128 - 16) << 23 : 0u;  /* inf, nan */
    /* a subnormal: let the float unit normalize it */
    float subnormal = as_float(o + (1u << 23)) - as_float(113u << 23);
    float x = exponent == 0 ? subnormal : as_float(o);
    return as_float(as_bits(x) | (uint32_t)(h & 0x8000u) << 16);
}

/* float32 -> float16 bits, rounded to nearest even; above float16's range an infinity, a nan
 * stays a nan. */
static inline uint16_t float_to_half(float x) {
    uint32_t f = as_bits(x);
    uint32_t sign = f & 0x80000000u;
    f ^= sign;
    /* subnormal or zero: adding a float whose last mantissa bit is worth the smallest
     * float16 subnormal makes the float unit round at the right place */
    const float subnormal_magic = as_float((uint32_t)((127 - 15) + (23 - 10) + 1) << 23);
    uint32_t subnormal = as_bits(as_float(f) + subnormal_magic) - as_bits(subnormal_magic);
    /* normal: rebias, then add half an ulp less one plus the ulp's parity (ties to even) */
    uint32_t normal = (f + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((f >> 13) & 1u)) >> 13;
    uint32_t o = f < (113u << 23) ? subnormal : normal;
    o = f >= (143u << 23) ? (f > 0x7F800000u ? 0x7E00u : 0x7C00u) : o;
    return (uint16_t)(o | sign >> 16);
}

/* The i-th value of a row stored as dtype, widened to float32. */
static inline float load_value(int dtype, const void *row, int64_t j) {
    if (dtype == DT_FLOAT32) return ((const float *)row)[j];
    if (dtype == DT_FLOAT16) return half_to_float(((const uint16_t *)row)[j]);
    return as_float((uint32_t)((const uint16_t *)row)[j] << 16);
}

/* Store x as dtype (round to nearest even, as torch rounds); returns 1 when the stored value
 * is not finite (float16 overflows above 65504). */
static inline uint32_t store_value(int dtype, void *row, int64_t j, float x) {
    uint32_t u = as_bits(x);
    if (dtype == DT_FLOAT32) {
        ((float *)row)[j] = x;
        return (u & 0x7F800000u) == 0x7F800000u;
    }
    if (dtype == DT_FLOAT16) {
        uint16_t h = float_to_half(x);
        ((uint16_t *)row)[j] = h;
        return (h & 0x7C00u) == 0x7C00u;
    }
    /* a nan stays a nan: torch stores 0x7FC0 for every one */
    uint16_t b = (u & 0x7FFFFFFFu) > 0x7F800000u
                     ? (uint16_t)0x7FC0
                     : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    ((uint16_t *)row)[j] = b;
    return (b & 0x7F80u) == 0x7F80u;
}

static inline void prefetch_row(const char *row, size_t nbytes) {
    for (size_t b = 0; b < nbytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

/* Whole float16 rows to and from float32. The x86 instructions (F16C) convert 8 values at a
 * time where the integer arithmetic above takes a dozen instructions for them; the CPU is
 * asked once whether it has them (have_f16c, set when the module loads). */
static int have_f16c;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_F16C_CODE 1

__attribute__((target("avx,f16c"))) static void half_row_to_float_f16c(
        float *dst, const uint16_t *src, int64_t dim) {
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8)
        _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
    for (; j < dim; j++) dst[j] = half_to_float(src[j]);
}

__attribute__((target("avx,f16c"))) static uint32_t float_row_to_half_f16c(
        uint16_t *dst, const float *src, int64_t dim) {
    const __m128i exponent = _mm_set1_epi16(0x7C00);
    __m128i bad = _mm_setzero_si128();
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + j), h);
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent));
    }
    uint32_t tail_bad = 0;
    for (; j < dim; j++) tail_bad |= store_value(DT_FLOAT16, dst, j, src[j]);
    return (uint32_t)(_mm_movemask_epi8(bad) != 0) | tail_bad;
}
#endif

static inline void half_row_to_float(float *dst, const void *src, int64_t dim) {
#ifdef HAVE_F16C_CODE
    if (have_f16c) {
        half_row_to_float_f16c(dst, (const uint16_t *)src, dim);
        return;
    }
#endif
    for (int64_t j = 0; j < dim; j++) dst[j] = load_value(DT_FLOAT16, src, j);
}

/* Returns 1 when a stored value is not finite. */
static inline uint32_t float_row_to_half(void *dst, const float *src, int64_t dim) {
#ifdef HAVE_F16C_CODE
    if (have_f16c) return float_row_to_half_f16c((uint16_t *)dst, src, dim);
#endif
    uint32_t bad = 0;
    for (int64_t j = 0; j < dim; j++) bad |= store_value(DT_FLOAT16, dst, j, src[j]);
    return bad;
}

/* One row: w <- w * c; v <- g + momentum * v + weight_decay * w (v is g + weight_decay * w
 * without state); w <- w - lr * v. Returns bit 0 when the stored row is not finite, bit 1
 * when the stored state is not. Inlined with constant dtypes, so each (row, state) dtype pair
 * gets its own branch-free loop that the compiler vectorizes. */
static inline __attribute__((always_inline)) int update_row(
        int rows_dtype, int state_dtype, int with_state, const void *row, const void *st,
        const float *g, float c, int64_t dim, float momentum, float weight_decay, float lr,
        void *out_row, void *out_st) {
    uint32_t bad_row = 0, bad_state = 0;
    for (int64_t j = 0; j < dim; j++) {
        float w = load_value(rows_dtype, row, j) * c;
        float v = with_state ? g[j] + momentum * load_value(state_dtype, st, j) + weight_decay * w
                             : g[j] + weight_decay * w;
        if (with_state) bad_state |= store_value(state_dtype, out_st, j, v);
        bad_row |= store_value(rows_dtype, out_row, j, w - lr * v);
    }
    return (bad_row != 0) | ((bad_state != 0) << 1);
}

/* update_row with its (row, state) dtype pair picked at run time: float32 and bfloat16 only. */
static inline __attribute__((always_inline)) int update_row_any(
        int rd, int sd, int with_state, const void *row_in, const void *st_in, const float *g,
        float c, int64_t dim, float momentum, float weight_decay, float lr, void *row_out,
        void *st_out) {
#define UPDATE_ROW(RD, SD, WS)                                                                 \
    update_row(RD, SD, WS, row_in, st_in, g, c, dim, momentum, weight_decay, lr, row_out, st_out)
    if (!with_state)
        return rd == DT_FLOAT32 ? UPDATE_ROW(DT_FLOAT32, DT_FLOAT32, 0)
                                : UPDATE_ROW(DT_BFLOAT16, DT_FLOAT32, 0);
    if (rd == DT_FLOAT32)
        return sd == DT_FLOAT32 ? UPDATE_ROW(DT_FLOAT32, DT_FLOAT32, 1)
                                : UPDATE_ROW(DT_FLOAT32, DT_BFLOAT16, 1);
    return sd == DT_FLOAT32 ? UPDATE_ROW(DT_BFLOAT16, DT_FLOAT32, 1)
                            : UPDATE_ROW(DT_BFLOAT16, DT_BFLOAT16, 1);
#undef UPDATE_ROW
}

/* The old row and state kept for a refused step. float32 ones are written past the cache
 * (non-temporal stores), since they are read again only when a push is refused: through the
 * cache, each saved line is first read from memory and then evicts a table line that a later
 * row of the push may need. 2-byte rows, whose update spends more on converting, measured no
 * faster for it and are copied; so is any row whose destination or size is not 32-byte
 * aligned. */
static int have_avx;

#ifdef HAVE_F16C_CODE
__attribute__((target("avx"))) static void save_row_avx(char *dst, const char *src,
                                                        size_t nbytes) {
    for (size_t b = 0; b < nbytes; b += 32)
        _mm256_stream_si256((__m256i *)(dst + b), _mm256_loadu_si256((const __m256i *)(src + b)));
}
#endif

static inline void save_row(int dtype, char *dst, const char *src, size_t nbytes) {
    (void)dtype; /* only x86 streams */
#ifdef HAVE_F16C_CODE
    if (dtype == DT_FLOAT32 && have_avx && ((uintptr_t)dst % 32) == 0 && nbytes % 32 == 0) {
        save_row_avx(dst, src, nbytes);
        return;
    }
#endif
    memcpy(dst, src, nbytes);
}

/* One pushed row: the table's row and state (table_row, table_st) and the out buffers' (out_row,
 * out_st; see momentum_sgd), and a scratch of 4 * dim floats. Returns update_row's bits.
 *
 * In place, the row and its state are first saved to the out buffers (to restore them from if
 * the step is refused), then updated in the table where they lie: in and out are one pointer,
 * which the vectorizer takes as an element-wise loop (two pointers that might overlap would
 * make it fall back to one value at a time). float16 goes through float32 copies in the
 * scratch, converted a row at a time. */
static inline __attribute__((always_inline)) int update_one(
        int in_place, int rows_dtype, int state_dtype, int with_state, char *table_row,
        char *table_st, char *out_row, char *out_st, size_t row_bytes, size_t state_bytes,
        const float *g, float c, int64_t dim, float momentum, float weight_decay, float lr,
        float *scratch) {
    const void *row_in = table_row, *st_in = table_st;
    void *row_out = out_row, *st_out = out_st;
    int rd = rows_dtype, sd = with_state ? state_dtype : DT_FLOAT32;
    if (in_place) {
        save_row(rows_dtype, out_row, table_row, row_bytes);
        if (with_state) save_row(state_dtype, out_st, table_st, state_bytes);
        if (rd != DT_FLOAT16 && sd != DT_FLOAT16)
            return update_row_any(rd, sd, with_state, table_row, table_st, g, c, dim, momentum,
                                  weight_decay, lr, table_row, table_st);
        row_out = table_row, st_out = table_st;
    }
    void *half_row = NULL, *half_st = NULL;
    if (rd == DT_FLOAT16) {
        half_row_to_float(scratch, row_in, dim);
        half_row = row_out, row_in = scratch, row_out = scratch + dim, rd = DT_FLOAT32;
    }
    if (sd == DT_FLOAT16) {
        half_row_to_float(scratch + 2 * dim, st_in, dim);
        half_st = st_out, st_in = scratch + 2 * dim, st_out = scratch + 3 * dim;
        sd = DT_FLOAT32;
    }
    int bad = update_row_any(rd, sd, with_state, row_in, st_in, g, c, dim, momentum,
                             weight_decay, lr, row_out, st_out);
    /* a float32 value that float16 cannot hold becomes inf only here */
    if (half_row) bad = (bad & ~1) | (int)float_row_to_half(half_row, row_out, dim);
    if (half_st) bad = (bad & ~2) | (int)float_row_to_half(half_st, st_out, dim) << 1;
    return bad;
}

/* One momentum SGD step on the rows at positions[0..m). in_place 0: the new rows and state go
 * to out_rows / out_state (m, dim), the table is only read; 1: they are written to the table
 * and the old ones to out_rows / out_state. first_bad[0] / first_bad[1]: the first i whose
 * stored row / state is not finite, or -1. */
UPDATE_CLONES
static void momentum_sgd(int in_place, char *rows, int rows_dtype, char *state,
                         int state_dtype, const int64_t *positions, int64_t m, int64_t dim,
                         const float *grads, const double *catch_up, float momentum,
                         float weight_decay, float lr, char *out_rows, char *out_state,
                         float *scratch, int64_t *first_bad) {
    const size_t row_bytes = (size_t)dim * dtype_size(rows_dtype);
    const size_t state_bytes = state ? (size_t)dim * dtype_size(state_dtype) : 0;
    first_bad[0] = first_bad[1] = -1;
    for (int64_t i = 0; i < m && i < AHEAD; i++) {
        prefetch_row(rows + positions[i] * row_bytes, row_bytes);
        if (state) prefetch_row(state + positions[i] * state_bytes, state_bytes);
    }
    for (int64_t i = 0; i < m; i++) {
        if (i + AHEAD < m) {
            prefetch_row(rows + positions[i + AHEAD] * row_bytes, row_bytes);
            if (state) prefetch_row(state + positions[i + AHEAD] * state_bytes, state_bytes);
        }
        const float c = catch_up ? (float)catch_up[i] : 1.0f;
        int bad = update_one(in_place, rows_dtype, state_dtype, state != NULL,
                             rows + positions[i] * row_bytes,
                             state ? state + positions[i] * state_bytes : NULL,
                             out_rows + i * row_bytes, state ? out_state + i * state_bytes : NULL,
                             row_bytes, state_bytes, grads + i * dim, c, dim, momentum,
                             weight_decay, lr, scratch);
        if ((bad & 1) && first_bad[0] < 0) first_bad[0] = i;
        if ((bad & 2) && first_bad[1] < 0) first_bad[1] = i;
    }
#ifdef HAVE_F16C_CODE
    if (in_place && have_avx) _mm_sfence(); /* the saved rows reach memory before any read */
#endif
}

static PyObject *py_momentum_sgd(PyObject *self, PyObject *args) {
    unsigned long long rows, state, positions, grads, catch_up, out_rows, out_state;
    int in_place, rows_dtype, state_dtype;
    long long m, dim;
    float momentum, weight_decay, lr;
    (void)self;
    if (!PyArg_ParseTuple(args, "pKiKiKLLKKfffKK", &in_place, &rows, &rows_dtype, &state,
                          &state_dtype, &positions, &m, &dim, &grads, &catch_up, &momentum,
                          &weight_decay, &lr, &out_rows, &out_state))
        return NULL;
    if (rows_dtype < 0 || rows_dtype > 2 || state_dtype < 0 || state_dtype > 2 || m < 0 ||
        dim < 1) {
        PyErr_SetString(PyExc_ValueError, "momentum_sgd: bad dtype code or size");
        return NULL;
    }
    float *scratch = PyMem_RawMalloc((size_t)dim * 4 * sizeof(float));
    if (!scratch) return PyErr_NoMemory();
    int64_t first_bad[2];
    Py_BEGIN_ALLOW_THREADS
    momentum_sgd(in_place, (char *)(uintptr_t)rows, rows_dtype, (char *)(uintptr_t)state,
                 state_dtype, (const int64_t *)(uintptr_t)positions, m, dim,
                 (const float *)(uintptr_t)grads, (const double *)(uintptr_t)catch_up,
                 momentum, weight_decay, lr, (char *)(uintptr_t)out_rows,
                 (char *)(uintptr_t)out_state, scratch, first_bad);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    return Py_BuildValue("LL", (long long)first_bad[0], (long long)first_bad[1]);
}

static int cpu_has_avx(void) {
#ifdef HAVE_F16C_CODE
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx");
#else
    return 0;
#endif
}

static int cpu_has_f16c(void) {
#ifdef HAVE_F16C_CODE
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#else
    return 0;
#endif
}

static PyObject *py_use_f16c(PyObject *self, PyObject *args) {
    int on, before = have_f16c;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    have_f16c = on && cpu_has_f16c();
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"momentum_sgd", py_momentum_sgd, METH_VARARGS,
     "momentum_sgd(in_place, rows, rows_dtype, state, state_dtype, positions, m, dim, grads, "
     "catch_up, momentum, weight_decay, lr, out_rows, out_state)\n"
     "-> (first bad row, first bad state)\n"
     "Addresses are data pointers (0: none); use ams.shard.optim, which checks them."},
    {"use_f16c", py_use_f16c, METH_VARARGS,
     "use_f16c(on) -> whether it was on. Convert float16 rows with the CPU's F16C instructions "
     "(on where the CPU has them, from import) or with integer arithmetic (what other CPUs "
     "run; tests check both)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "ams.shard._kernels",
    .m_doc = "Compiled row kernels of the shard's sparse optimizer (see ams/shard/optim.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    have_f16c = cpu_has_f16c();
    have_avx = cpu_has_avx();
    return PyModule_Create(&module);
}
