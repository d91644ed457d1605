/* The sparse optimizer's row update as one loop over the pushed rows (ams/optim.py).
 *
 * Why C: in numpy and torch the update is a gather of the rows, a gather of their momentum,
 * four or five passes of float32 arithmetic over the gathered copies, two passes checking
 * finiteness, and two scatters. Each pass over an (m, dim) float32 copy leaves the cache, and
 * each gathered row waits on memory alone. Here each row is read once, updated in registers
 * while the rows a few places ahead are already being fetched, and written once: back into the
 * table (with a copy of the old row kept, to put back if a later row of the push comes out
 * non-finite and the push is refused) or, for a table whose pushes move rows to new slots,
 * into staging buffers that ams.optim scatters to them.
 *
 * The arithmetic is ams.optim.SparseMomentumSGD's, in float32, rounded once to the stored
 * dtypes (round to nearest even), so the results equal the torch path's up to the rounding of
 * a fused multiply-add. Pointers and sizes are checked by the Python caller
 * (ams.optim._compiled_update); nothing here may be called with other arguments.
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

/* In place, the row and its state are first copied to the out buffers (to restore them from if
 * the step is refused) and the update reads that copy: the table is then only written, never
 * read and written through one pointer, which would keep the compiler from vectorizing. */
#define UPDATE_CASE(RD, SD, WS)                                                                \
    do {                                                                                       \
        char *table_row = rows + positions[i] * row_bytes;                                    \
        char *table_st = WS ? state + positions[i] * state_bytes : NULL;                      \
        char *out_row = out_rows + i * row_bytes;                                              \
        char *out_st = WS ? out_state + i * state_bytes : NULL;                                \
        if (in_place) {                                                                        \
            memcpy(out_row, table_row, row_bytes);                                             \
            if (WS) memcpy(out_st, table_st, state_bytes);                                     \
            bad = update_row(RD, SD, WS, out_row, out_st, grads + i * dim, c, dim, momentum,  \
                             weight_decay, lr, table_row, table_st);                           \
        } else {                                                                               \
            bad = update_row(RD, SD, WS, table_row, table_st, grads + i * dim, c, dim,         \
                             momentum, weight_decay, lr, out_row, out_st);                     \
        }                                                                                      \
    } while (0)

#define STATE_CASES(RD)                                                                        \
    if (!state) UPDATE_CASE(RD, DT_FLOAT32, 0);                                                \
    else if (state_dtype == DT_FLOAT32) UPDATE_CASE(RD, DT_FLOAT32, 1);                        \
    else if (state_dtype == DT_FLOAT16) UPDATE_CASE(RD, DT_FLOAT16, 1);                        \
    else UPDATE_CASE(RD, DT_BFLOAT16, 1)

/* One momentum SGD step on the rows at positions[0..m). in_place 0: the new rows and state go
 * to out_rows / out_state (m, dim), the table is only read; 1: they are written to the table
 * and the old ones to out_rows / out_state. first_bad[0] / first_bad[1]: the first i whose
 * stored row / state is not finite, or -1. */
UPDATE_CLONES
static void momentum_sgd(int in_place, char *rows, int rows_dtype, char *state,
                         int state_dtype, const int64_t *positions, int64_t m, int64_t dim,
                         const float *grads, const double *catch_up, float momentum,
                         float weight_decay, float lr, char *out_rows, char *out_state,
                         int64_t *first_bad) {
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
        int bad;
        if (rows_dtype == DT_FLOAT32) {
            STATE_CASES(DT_FLOAT32);
        } else if (rows_dtype == DT_FLOAT16) {
            STATE_CASES(DT_FLOAT16);
        } else {
            STATE_CASES(DT_BFLOAT16);
        }
        if ((bad & 1) && first_bad[0] < 0) first_bad[0] = i;
        if ((bad & 2) && first_bad[1] < 0) first_bad[1] = i;
    }
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
    int64_t first_bad[2];
    Py_BEGIN_ALLOW_THREADS
    momentum_sgd(in_place, (char *)(uintptr_t)rows, rows_dtype, (char *)(uintptr_t)state,
                 state_dtype, (const int64_t *)(uintptr_t)positions, m, dim,
                 (const float *)(uintptr_t)grads, (const double *)(uintptr_t)catch_up,
                 momentum, weight_decay, lr, (char *)(uintptr_t)out_rows,
                 (char *)(uintptr_t)out_state, first_bad);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("LL", (long long)first_bad[0], (long long)first_bad[1]);
}

static PyMethodDef methods[] = {
    {"momentum_sgd", py_momentum_sgd, METH_VARARGS,
     "momentum_sgd(in_place, rows, rows_dtype, state, state_dtype, positions, m, dim, grads, "
     "catch_up, momentum, weight_decay, lr, out_rows, out_state)\n"
     "-> (first bad row, first bad state)\n"
     "Addresses are data pointers (0: none); use ams.optim, which checks them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "ams._kernels",
    .m_doc = "Compiled row kernels of the shard's sparse optimizer (see ams/optim.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
