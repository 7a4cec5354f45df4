/* The vocabulary passes of the sparse log-softmax on CPU, one row at a time: what the chunked PyTorch backend does
 * in eight (forward) and seven (backward) separate passes over a chunk, fused into loops that keep a row in L2.
 * Compiled at first use by offpolicy.ops.cpu_native with the machine's C compiler (-O3 -march=native, no
 * -ffast-math: IEEE arithmetic), written with GCC/Clang vector extensions: 16 fp32 lanes with AVX-512, 8 otherwise
 * (AVX2, NEON, or whatever the compiler maps them onto). It knows nothing of RL.
 *
 * Per row of V logits z (fp32, bf16 or fp16), with a = log2(e) / tau:
 *   stats: m = max z;  y_v = (z_v - m) a;  e_v = 2^y_v;  s = sum e_v;  t2 = sum e_v y_v   (entropy term t = ln2 t2)
 *          and, where q_out is not NULL, q = sum e_v^2 = sum e^(2 (x_v - m)), so that sum_v p_v^2 = q / s^2 (one
 *          more accumulator in the same pass; the max is known before the exponentials, so nothing is rescaled;
 *          e_v^2 >= 0 may underflow only where e_v < 2^-63, against the max term's 1). The row loop is compiled
 *          twice, with and without q (a constant flag after inlining), so the default pass is the same code.
 *          bytes: each logit read once from memory (the max) and once from L2 (a row is 0.3-0.6 MB).
 *   grad:  d_v = c 2^((z_v - shift) a) + sum_{j : id_j = v} g_j,   c = -G / tau,  shift = tau lse
 *          bytes: each logit read once, each gradient element written once; 16-bit outputs are assembled in an
 *          fp32 row first (L2), so each element is rounded once, a candidate's two terms added before.
 * Non-finite logits other than -inf (NaN, +inf) are not handled here: the stats pass flags such rows and the caller
 * recomputes them with the PyTorch backend; the gradient pass is only called on rows with finite mass, so that
 * y <= 0 in both passes (up to the rounding of lse).
 *
 * 2^y: y is clamped below at -127; y = n + f with n = round(y), |f| <= 1/2; 2^f by a degree-6 polynomial (a
 * near-minimax fit of the relative error, 1.9e-9; 9.6e-8 = 0.8 fp32 ulp after fp32 Horner evaluation), then n is
 * added to the exponent field. 2^-127 comes out as exactly +0 (so 2^-inf = 0, and 0 * y = 0 in the entropy sum);
 * for -127 < y < -126 the result is a subnormal within 2^-126 of the true value: an absolute error, in a row whose
 * largest term is 1, that no sum or 16-bit gradient can show.
 * Sums: fp32 lanes over blocks of 1024 elements (at most 128 adds per lane), block totals in double: a relative
 * error of about 130 fp32 ulps at worst, whatever V is.
 *
 * The boundary: offpolicy_abi() returns every exported prototype as text (stringified from the same macros that
 * declare the functions), which the loader compares with its ctypes declarations before any call;
 * offpolicy_dtypes() names the logits dtypes built. fp16 is built only where the compiler has _Float16 (GCC >= 12
 * on x86-64, Clang; -DOFFPOLICY_NO_FLOAT16 simulates a compiler without it): elsewhere fp16 logits take the
 * PyTorch backend and fp32/bf16 stay native. The gradient takes its scratch row's size in bytes, and checks it and
 * the candidate columns against V before anything is written: a short scratch row or a column outside [0, V)
 * returns an error code instead of writing out of bounds.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#include <immintrin.h>
#elif defined(__AVX__)
#define LANES 8
#include <immintrin.h>
#else
#define LANES 8
#endif

#define BLOCK 1024

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
#if defined(__FLT16_MAX__) && !defined(OFFPOLICY_NO_FLOAT16) /* the compiler has _Float16 */
#define HAVE_F16 1
typedef _Float16 vhf __attribute__((vector_size(2 * LANES)));
#else
#define HAVE_F16 0
#endif

/* The exported prototypes' parameters, used both to declare the functions and to build offpolicy_abi(). */
#define STATS_PARAMS                                                                                               \
    const void *z, int64_t z_stride, int64_t v, const int64_t *rows, int64_t n_rows, const float *a, float *m_out, \
        float *s_out, float *t_out, float *q_out, uint8_t *bad
#define GRAD_PARAMS                                                                                                \
    const void *z, int64_t z_stride, void *out, int64_t out_stride, int64_t v, const int64_t *rows, int64_t n_rows, \
        const float *shift, const float *a, const float *c, const int64_t *cols, const float *g, int64_t m_ids,    \
        float *scratch, int64_t scratch_bytes
#define TEXT_(...) #__VA_ARGS__
#define TEXT(...) TEXT_(__VA_ARGS__)
#define ABI_VERSION "3"

const char *offpolicy_abi(void) {
    return ABI_VERSION ";void stats(" TEXT(STATS_PARAMS) ");int64_t grad(" TEXT(GRAD_PARAMS) ")";
}
const char *offpolicy_dtypes(void) { return HAVE_F16 ? "f32 bf16 f16" : "f32 bf16"; }

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* Loads and stores of LANES elements at p + i, unaligned. */
static inline vf load_f32(const void *p, int64_t i) { vf x; memcpy(&x, (const float *)p + i, sizeof x); return x; }
static inline vf load_bf16(const void *p, int64_t i) {
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
#if HAVE_F16
static inline vf load_f16(const void *p, int64_t i) {
#if defined(__AVX512F__) && LANES == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
#elif defined(__F16C__) && LANES == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    vhf h;
    memcpy(&h, (const _Float16 *)p + i, sizeof h);
    return __builtin_convertvector(h, vf);
#endif
}
#endif
static inline void store_f32(void *p, int64_t i, vf x) { memcpy((float *)p + i, &x, sizeof x); }
static inline void store_bf16(void *p, int64_t i, vf x) { /* round to nearest even; NaN stays NaN */
#if defined(__AVX512BF16__) && LANES == 16
    __m256bh h = _mm512_cvtneps_pbh((__m512)x);
    memcpy((uint16_t *)p + i, &h, sizeof h);
#else
    vu b = (vu)x;
    vu r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    r = (vu)((vi)r & ~(x != x)) | ((vu)(x != x) & 0x7FC0u);
    vh h = __builtin_convertvector(r, vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
#endif
}
#if HAVE_F16
static inline void store_f16(void *p, int64_t i, vf x) { /* round to nearest even */
#if defined(__AVX512F__) && LANES == 16
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && LANES == 8
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
    vhf h = __builtin_convertvector(x, vhf);
    memcpy((_Float16 *)p + i, &h, sizeof h);
#endif
}
#endif

/* max(a, b), and b where either is NaN (as x86's max instructions). */
#if defined(__AVX512F__) && LANES == 16
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__) && LANES == 8
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#else
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
#endif

/* 2^yc for -127 <= yc <= 127 (see the header). */
static inline vf vexp2(vf yc) {
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf r = (yc + magic) - magic;
    vf f = yc - r;
    vi n = __builtin_convertvector(r, vi);
    vf p = vsplat(1.534580979812015e-4f);
    p = p * f + 1.3399931200814743e-3f;
    p = p * f + 9.618488965286411e-3f;
    p = p * f + 5.5503287770217874e-2f;
    p = p * f + 2.4022646890558766e-1f;
    p = p * f + 6.931472057372317e-1f;
    p = p * f + 1.0f;
    return (vf)((vu)p + ((vu)n << 23)); /* unsigned: n < 0 wraps into the exponent field, no signed shift */
}

static inline vf lane_ids(void) {
    vf x;
    for (int j = 0; j < LANES; j++) x[j] = (float)j;
    return x;
}

/* The last v % LANES elements go through a LANES-wide buffer padded with -inf (its 2^y is 0). */
#define TAIL_LOAD(LOAD, ELEM, zr, i, v)                                                                            \
    ({                                                                                                             \
        ELEM buf_[LANES] = {0};                                                                                    \
        memcpy(buf_, (const ELEM *)(zr) + (i), (size_t)((v) - (i)) * sizeof(ELEM));                                \
        vselect(lane_ids() < vsplat((float)((v) - (i))), LOAD(buf_, 0), vsplat(-__builtin_inff()));               \
    })

static inline float hsum(vf x) { float s = 0.0f; for (int j = 0; j < LANES; j++) s += x[j]; return s; }
static inline float hmax(vf x) { float m = x[0]; for (int j = 1; j < LANES; j++) m = x[j] > m ? x[j] : m; return m; }

/* Row statistics of rows[0..n_rows): m[r], s[r], t2[r] (t in log2 units), q[r] (when q_out is not NULL), bad[r] = 1
 * if the row holds NaN or +inf (then s is NaN: y = NaN at a NaN logit, and z - m = NaN throughout when m = +inf; its
 * statistics are meaningless). NAME##_rows is the loop, specialised by WANT_Q (a constant once inlined). */
#define DEFINE_STATS(NAME, LOAD, ELEM)                                                                             \
    static inline __attribute__((always_inline)) void NAME##_rows(STATS_PARAMS, const int WANT_Q) {               \
        const int64_t v_main = v - v % LANES;                                                                      \
        const vf lowest = vsplat(-127.0f);                                                                         \
        for (int64_t k = 0; k < n_rows; k++) {                                                                     \
            const int64_t r = rows[k];                                                                             \
            const ELEM *zr = (const ELEM *)((const char *)z + r * z_stride);                                       \
            vf mx = vsplat(-__builtin_inff());                                                                     \
            for (int64_t i = 0; i < v_main; i += LANES) mx = vmax(LOAD(zr, i), mx);                                \
            if (v_main < v) mx = vmax(TAIL_LOAD(LOAD, ELEM, zr, v_main, v), mx);                                   \
            float mz = hmax(mx);                                                                                   \
            if (mz == -__builtin_inff()) mz = 0.0f;                                                                \
            const vf vm = vsplat(mz), va = vsplat(a[r]);                                                           \
            double s = 0.0, t = 0.0, q = 0.0;                                                                      \
            for (int64_t b0 = 0; b0 < v_main; b0 += BLOCK) {                                                       \
                const int64_t b1 = b0 + BLOCK < v_main ? b0 + BLOCK : v_main;                                      \
                vf sa = {0}, ta = {0}, qa = {0};                                                                   \
                for (int64_t i = b0; i < b1; i += LANES) {                                                         \
                    vf y = vmax(lowest, (LOAD(zr, i) - vm) * va); /* y <= 0; e = 0 at y = -127: no 0 * inf */      \
                    vf e = vexp2(y);                                                                               \
                    sa += e;                                                                                       \
                    ta += e * y;                                                                                   \
                    if (WANT_Q) qa += e * e;                                                                       \
                }                                                                                                  \
                s += hsum(sa);                                                                                     \
                t += hsum(ta);                                                                                     \
                if (WANT_Q) q += hsum(qa);                                                                         \
            }                                                                                                      \
            if (v_main < v) {                                                                                      \
                vf y = vmax(lowest, (TAIL_LOAD(LOAD, ELEM, zr, v_main, v) - vm) * va);                             \
                vf e = vexp2(y);                                                                               \
                s += hsum(e);                                                                                      \
                t += hsum(e * y);                                                                                  \
                if (WANT_Q) q += hsum(e * e);                                                                      \
            }                                                                                                      \
            bad[r] = (uint8_t)(s != s || mz == __builtin_inff());                                                  \
            m_out[r] = mz;                                                                                         \
            s_out[r] = (float)s;                                                                                   \
            t_out[r] = (float)t;                                                                                   \
            if (WANT_Q) q_out[r] = (float)q;                                                                       \
        }                                                                                                          \
    }                                                                                                              \
    void NAME(STATS_PARAMS) {                                                                                      \
        if (q_out) NAME##_rows(z, z_stride, v, rows, n_rows, a, m_out, s_out, t_out, q_out, bad, 1);              \
        else NAME##_rows(z, z_stride, v, rows, n_rows, a, m_out, s_out, t_out, q_out, bad, 0);                    \
    }

DEFINE_STATS(stats_f32, load_f32, float)
DEFINE_STATS(stats_bf16, load_bf16, uint16_t)
#if HAVE_F16
DEFINE_STATS(stats_f16, load_f16, _Float16)
#endif

/* The dense term c 2^((z - shift) a) of the gradient. */
static inline vf dense_grad(vf z, vf shift, vf a, vf c) { return c * vexp2(vmax(vsplat(-127.0f), (z - shift) * a)); }

/* Gradient of rows rows[0..n_rows): out[r, v] = c[r] 2^((z[r, v] - shift[r]) a[r]) + sum_{j: cols[r, j] = v} g[r, j]
 * (g is 0 at padding). scratch: scratch_bytes >= 4 V bytes, the fp32 row of a 16-bit output (unused for fp32). out
 * may be z (in place). Returns 0; 1 (nothing written) if the scratch row is shorter than V for a 16-bit output;
 * 2 (nothing written) if a column lies outside [0, V). */
#define DEFINE_GRAD(NAME, LOAD, STORE, ELEM, DIRECT)                                                               \
    int64_t NAME(GRAD_PARAMS) {                                                                                    \
        const int64_t v_main = v - v % LANES;                                                                      \
        if (!DIRECT && scratch_bytes < v * (int64_t)sizeof(float)) return 1;                                       \
        for (int64_t k = 0; k < n_rows; k++)                                                                       \
            for (int64_t j = 0; j < m_ids; j++)                                                                    \
                if ((uint64_t)cols[rows[k] * m_ids + j] >= (uint64_t)v) return 2;                                  \
        for (int64_t k = 0; k < n_rows; k++) {                                                                     \
            const int64_t r = rows[k];                                                                             \
            const ELEM *zr = (const ELEM *)((const char *)z + r * z_stride);                                       \
            ELEM *orow = (ELEM *)((char *)out + r * out_stride);                                                   \
            float *acc = DIRECT ? (float *)orow : scratch;                                                         \
            const vf vs = vsplat(shift[r]), va = vsplat(a[r]), vc = vsplat(c[r]);                                  \
            for (int64_t i = 0; i < v_main; i += LANES) store_f32(acc, i, dense_grad(LOAD(zr, i), vs, va, vc));    \
            if (v_main < v) {                                                                                      \
                vf d = dense_grad(TAIL_LOAD(LOAD, ELEM, zr, v_main, v), vs, va, vc);                               \
                memcpy(acc + v_main, &d, (size_t)(v - v_main) * sizeof(float));                                    \
            }                                                                                                      \
            for (int64_t j = 0; j < m_ids; j++) acc[cols[r * m_ids + j]] += g[r * m_ids + j];                     \
            if (!DIRECT) {                                                                                         \
                for (int64_t i = 0; i < v_main; i += LANES) STORE(orow, i, load_f32(acc, i));                     \
                if (v_main < v) {                                                                                  \
                    float tail[LANES] = {0};                                                                       \
                    ELEM packed[LANES];                                                                            \
                    memcpy(tail, acc + v_main, (size_t)(v - v_main) * sizeof(float));                              \
                    STORE(packed, 0, load_f32(tail, 0));                                                           \
                    memcpy(orow + v_main, packed, (size_t)(v - v_main) * sizeof(ELEM));                            \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

DEFINE_GRAD(grad_f32, load_f32, store_f32, float, 1)
DEFINE_GRAD(grad_bf16, load_bf16, store_bf16, uint16_t, 0)
#if HAVE_F16
DEFINE_GRAD(grad_f16, load_f16, store_f16, _Float16, 0)
#endif

/* ---- The support pass (mask replay over CSR rows of any width) ----
 * Row r owns the entries offsets[r] .. offsets[r + 1] of ids (its support S_r, any width 0 .. V). Work per row is
 * O(|S_r|) in the forward; in the backward O(|S_r|) plus one zeroing of the gradient row (a narrow row), or one
 * streaming write of the row (a wide row, below): no [N, K_max] padding, each id read once per pass.
 *   support_stats: x_e = z[r, ids[e]] gathered once into xe[e] (fp32, the caller's [nnz] output), then one vector
 *                  pass over the contiguous xe[offsets[r] ..] (in L1/L2): m = max x_e, s = sum 2^y_e,
 *                  t2 = sum 2^y_e y_e with y_e = (x_e - m) a, a = it log2(e) (as stats above), and one more over the
 *                  same copy, in place: xe[e] = (x_e - m) it - ln s, the support-normalised log-probabilities (ln by
 *                  ln_ge1, no libm; ln s is returned in ls_out). Rows without mass and skipped rows (skip[r], skip
 *                  may be NULL; not read) get xe = -inf and s = 0. bad[r] = 1 where an entry is NaN or +inf (the
 *                  caller recomputes such rows). An id outside [0, V) is never read (element 0 is, instead) and
 *                  makes the call return 2: the caller raises and discards the outputs.
 *                  Wide rows (mask not NULL and slot[r] >= 0, chosen by the caller): the same gather also writes
 *                  the row's membership byte mask mask[slot[r] V + v] = [v in S_r] (zeroed first; V bytes, at most
 *                  a quarter of the row's int64 ids at the caller's threshold |S_r| >= V / 2), then its count is compared
 *                  with |S_r|: a repeated id (a record not validated) sets slot[r] = -1, and the row's backward
 *                  takes the entry path, whose sum over entries the mask cannot express.
 *   support_grad:  narrow rows (and every row when gc is not NULL): the gradient row, zeroed, then at each entry e:
 *                  it (gc_e - G 2^(lp_e log2 e)) (gc NULL: 0), G = gt + sum_e gc_e the row's whole upstream
 *                  gradient, plus it gt at the token (for a 16-bit output folded into its entry when the token is
 *                  in the support, so each element is rounded once; for fp32 added after, the same rounding).
 *                  Wide rows with gc NULL (slot[r] >= 0): one streaming pass over V writes every element once,
 *                  d_v = [mask_v] it (0 - G 2^(((z_v - m) it - ln s) log2 e)) (+ it gt at the token), the exponent
 *                  computed as the forward's log-probability, so d equals the entry path's value; it reads the
 *                  logits row (4 or 2 bytes per id) and the mask (1 byte) instead of the ids (8) and the
 *                  log-probabilities (4) and a scatter. G = 0 skips the probability term (a row without gradient
 *                  never reads its log-probabilities or logits: NaN there cannot leak). An id or token outside
 *                  [0, V) is never written and makes the call return 2 (the caller raises). */
#define SUPPORT_STATS_PARAMS                                                                                       \
    const void *z, int64_t z_stride, int64_t v, const int64_t *rows, int64_t n_rows, const int64_t *offsets,       \
        const int64_t *ids, const uint8_t *skip, const float *it, float *xe, float *m_out, float *s_out,           \
        float *t_out, float *ls_out, uint8_t *bad, uint8_t *mask, int64_t *slot
#define SUPPORT_GRAD_PARAMS                                                                                        \
    void *out, int64_t out_stride, int64_t v, const int64_t *rows, int64_t n_rows, const int64_t *offsets,         \
        const int64_t *ids, const int64_t *tokens, const float *lp, const float *gc, const float *gt,              \
        const float *it, const void *z, int64_t z_stride, const uint8_t *mask, const int64_t *slot,                \
        const float *m, const float *ls
#define SUPPORT_ABI_VERSION "2"

const char *offpolicy_support_abi(void) {
    return SUPPORT_ABI_VERSION ";int64_t support_stats(" TEXT(SUPPORT_STATS_PARAMS) ");int64_t support_grad(" TEXT(
        SUPPORT_GRAD_PARAMS) ")";
}

/* ln(s) for s >= 1 (a row's sum, whose max term is 1), in double: s = 2^k f with f in [1, 2), ln f = 2 atanh(u)
 * with u = (f - 1) / (f + 1) < 1/3, the series to u^21 (truncation below 1e-12 relative). No libm. */
static inline double ln_ge1(double s) {
    uint64_t b;
    memcpy(&b, &s, sizeof b);
    const int64_t k = (int64_t)((b >> 52) & 0x7FF) - 1023;
    b = (b & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
    double f;
    memcpy(&f, &b, sizeof f);
    const double u = (f - 1.0) / (f + 1.0), u2 = u * u;
    double p = 1.0 / 21;
    for (int j = 19; j >= 1; j -= 2) p = p * u2 + 1.0 / j;
    return (double)k * 0.6931471805599453 + 2.0 * u * p;
}

/* The gather of one row's support: xr[j] = z[ids[j]] in fp32 (restrict: the compiler may use gather
 * instructions), the ids' range checked in the same loop (an id outside [0, V) reads element 0 and makes the
 * result nonzero), so the ids are read once; with mk not NULL, mk[ids[j]] = 1 in the same loop (in range only). */
#define DEFINE_GATHER(NAME, ELEM, CONV)                                                                            \
    static inline uint64_t NAME(float *restrict xr, const ELEM *restrict zr, const int64_t *restrict ids,         \
                                int64_t w, int64_t v) {                                                           \
        uint64_t bad = 0;                                                                                          \
        for (int64_t j = 0; j < w; j++) {                                                                          \
            const uint64_t u = (uint64_t)ids[j];                                                                   \
            bad |= u >= (uint64_t)v;                                                                               \
            xr[j] = CONV(zr[u < (uint64_t)v ? u : 0]);                                                             \
        }                                                                                                          \
        return bad;                                                                                                \
    }                                                                                                              \
    static inline uint64_t NAME##_mask(float *restrict xr, const ELEM *restrict zr, const int64_t *restrict ids,  \
                                       int64_t w, int64_t v, uint8_t *restrict mk) {                              \
        uint64_t bad = 0;                                                                                          \
        for (int64_t j = 0; j < w; j++) {                                                                          \
            const uint64_t u = (uint64_t)ids[j], at = u < (uint64_t)v ? u : 0;                                     \
            bad |= u >= (uint64_t)v;                                                                               \
            xr[j] = CONV(zr[at]);                                                                                  \
            mk[at] = 1; /* an id out of range marks element 0: the call fails, its outputs are discarded */        \
        }                                                                                                          \
        return bad;                                                                                                \
    }
static inline float conv_f32(float x) { return x; }
static inline float conv_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}
DEFINE_GATHER(gather_f32, float, conv_f32)
DEFINE_GATHER(gather_bf16, uint16_t, conv_bf16)
#if HAVE_F16
static inline float conv_f16(_Float16 h) { return (float)h; }
DEFINE_GATHER(gather_f16, _Float16, conv_f16)
#endif

/* The number of set bytes of a 0/1 mask of v bytes. */
static inline int64_t mask_count(const uint8_t *restrict mk, int64_t v) {
    int64_t n = 0;
    for (int64_t b0 = 0; b0 < v; b0 += 1 << 16) { /* uint32 lanes cannot overflow within a block */
        const int64_t b1 = b0 + (1 << 16) < v ? b0 + (1 << 16) : v;
        uint32_t c = 0;
        for (int64_t i = b0; i < b1; i++) c += mk[i];
        n += c;
    }
    return n;
}

/* One row's statistics and log-probabilities over its gathered copy xr[0 .. w) (fp32, in L1/L2), in place. */
static void support_row(float *xr, int64_t w, float ir, float *m_out, float *s_out, float *t_out, float *ls_out,
                        uint8_t *bad) {
    const int64_t w_main = w - w % LANES;
    const vf ninf = vsplat(-__builtin_inff()), pinf = vsplat(__builtin_inff()), lowest = vsplat(-127.0f);
    vf mx = ninf;
    vi odd = {0}; /* NaN or +inf */
    for (int64_t i = 0; i < w_main; i += LANES) {
        vf x = load_f32(xr, i);
        mx = vmax(x, mx);
        odd |= (x != x) | (x == pinf);
    }
    if (w_main < w) {
        vf x = TAIL_LOAD(load_f32, float, xr, w_main, w);
        mx = vmax(x, mx);
        odd |= (x != x) | (x == pinf);
    }
    int any_odd = 0;
    for (int j = 0; j < LANES; j++) any_odd |= odd[j] != 0;
    float mz = hmax(mx);
    if (mz == -__builtin_inff()) mz = 0.0f;
    const vf vm = vsplat(mz), va = vsplat(ir * 1.4426950408889634f);
    double s = 0.0, t = 0.0;
    for (int64_t b0 = 0; b0 < w_main; b0 += BLOCK) {
        const int64_t b1 = b0 + BLOCK < w_main ? b0 + BLOCK : w_main;
        vf sa = {0}, ta = {0};
        for (int64_t i = b0; i < b1; i += LANES) {
            vf y = vmax(lowest, (load_f32(xr, i) - vm) * va);
            vf ex = vexp2(y);
            sa += ex;
            ta += ex * y;
        }
        s += hsum(sa);
        t += hsum(ta);
    }
    if (w_main < w) {
        vf y = vmax(lowest, (TAIL_LOAD(load_f32, float, xr, w_main, w) - vm) * va);
        vf ex = vexp2(y);
        s += hsum(ex);
        t += hsum(ex * y);
    }
    *bad = (uint8_t)any_odd;
    *m_out = mz;
    *t_out = (float)t;
    /* the log-probabilities in place, while the copy is in cache (-inf without mass) */
    const float ls = s > 0.0 && !any_odd ? (float)ln_ge1(s) : __builtin_inff();
    *ls_out = ls;
    if (ls == __builtin_inff()) {
        for (int64_t j = 0; j < w; j++) xr[j] = -__builtin_inff();
        *s_out = any_odd ? (float)s : 0.0f;
        return;
    }
    *s_out = (float)s;
    const vf vi_ = vsplat(ir), vl = vsplat(ls);
    for (int64_t i = 0; i < w_main; i += LANES) store_f32(xr, i, (load_f32(xr, i) - vm) * vi_ - vl);
    for (int64_t j = w_main; j < w; j++) xr[j] = (xr[j] - mz) * ir - ls;
}

#define DEFINE_SUPPORT_STATS(NAME, GATHER, ELEM)                                                                   \
    int64_t NAME(SUPPORT_STATS_PARAMS) {                                                                           \
        uint64_t out_of_range = 0;                                                                                 \
        for (int64_t k = 0; k < n_rows; k++) {                                                                     \
            const int64_t r = rows[k], e0 = offsets[r], w = offsets[r + 1] - e0;                                    \
            float *xr = xe + e0;                                                                                   \
            uint8_t *mk = mask && slot[r] >= 0 ? mask + slot[r] * v : NULL;                                        \
            if (skip && skip[r]) {                                                                                 \
                for (int64_t j = 0; j < w; j++) xr[j] = -__builtin_inff();                                         \
                m_out[r] = s_out[r] = t_out[r] = 0.0f;                                                             \
                ls_out[r] = __builtin_inff();                                                                      \
                bad[r] = 0;                                                                                        \
                if (mk) slot[r] = -1;                                                                              \
                continue;                                                                                          \
            }                                                                                                      \
            const ELEM *zr = (const ELEM *)((const char *)z + r * z_stride);                                       \
            if (mk) {                                                                                              \
                memset(mk, 0, (size_t)v);                                                                          \
                out_of_range |= GATHER##_mask(xr, zr, ids + e0, w, v, mk);                                         \
                if (mask_count(mk, v) != w) slot[r] = -1; /* a repeated id: the entry path */                     \
            } else {                                                                                               \
                out_of_range |= GATHER(xr, zr, ids + e0, w, v);                                                    \
            }                                                                                                      \
            support_row(xr, w, it[r], m_out + r, s_out + r, t_out + r, ls_out + r, bad + r);                       \
        }                                                                                                          \
        return out_of_range ? 2 : 0;                                                                               \
    }

DEFINE_SUPPORT_STATS(support_stats_f32, gather_f32, float)
DEFINE_SUPPORT_STATS(support_stats_bf16, gather_bf16, uint16_t)
#if HAVE_F16
DEFINE_SUPPORT_STATS(support_stats_f16, gather_f16, _Float16)
#endif

static inline float ld1_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float ld1_bf16(const void *p, int64_t i) { return conv_bf16(((const uint16_t *)p)[i]); }
static inline void st1_f32(void *p, int64_t i, float x) { ((float *)p)[i] = x; }
static inline void st1_bf16(void *p, int64_t i, float x) { /* round to nearest even; NaN stays NaN */
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    ((uint16_t *)p)[i] = x != x ? (uint16_t)0x7FC0u : (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
#if HAVE_F16
static inline float ld1_f16(const void *p, int64_t i) { return (float)((const _Float16 *)p)[i]; }
static inline void st1_f16(void *p, int64_t i, float x) { ((_Float16 *)p)[i] = (_Float16)x; }
#endif

/* The first position of y among ids[0 .. w), or -1. */
static inline int64_t find_id(const int64_t *restrict ids, int64_t w, int64_t y) {
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) { /* a branch-free test of 8 ids (vectorised), then the exact position */
        int hit = 0;
        for (int q = 0; q < 8; q++) hit |= ids[j + q] == y;
        if (hit) break;
    }
    for (; j < w; j++)
        if (ids[j] == y) return j;
    return -1;
}

/* LANES mask bytes as lane selectors (all ones where the byte is nonzero): one widening load on x86 (the generic
 * vector conversion compiles to byte-by-byte inserts there). */
static inline vi mask_lanes(const uint8_t *mk, int64_t i) {
#if defined(__AVX512F__) && LANES == 16
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mk + i))) != 0;
#elif defined(__AVX2__) && LANES == 8
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mk + i))) != 0;
#else
    vi x;
    for (int j = 0; j < LANES; j++) x[j] = mk[i + j];
    return x != 0;
#endif
}

/* The wide-row gradient: d_v over the whole row in one streaming write (see the header). The token's block is
 * done apart (its term added to one lane before the store), so the main loops index no lane by a variable. */
#define DEFINE_SUPPORT_STREAM(NAME, LOAD, STORE, ELEM)                                                             \
    static inline __attribute__((always_inline)) vf NAME##_block(const ELEM *zr, const uint8_t *mk, int64_t i,    \
                                                                 vf vm, vf vl, vf vg, vf vi_) {                    \
        const vf log2e = vsplat(1.4426950408889634f), lowest = vsplat(-127.0f), zero = {0};                        \
        const vf lp = (LOAD(zr, i) - vm) * vi_ - vl;                                                               \
        return vselect(mask_lanes(mk, i), (zero - vg * vexp2(vmax(lowest, lp * log2e))) * vi_, zero);              \
    }                                                                                                              \
    static void NAME(ELEM *restrict orow, const ELEM *restrict zr, const uint8_t *restrict mk, int64_t v,         \
                     float mz, float ls, float gr, float ir, int64_t y, float gy) {                                \
        const int64_t v_main = v - v % LANES, yb = y - y % LANES;                                                  \
        const vf vm = vsplat(mz), vl = vsplat(ls), vg = vsplat(gr), vi_ = vsplat(ir);                              \
        const int64_t end1 = yb < v_main ? yb : v_main;                                                            \
        for (int64_t i = 0; i < end1; i += LANES) STORE(orow, i, NAME##_block(zr, mk, i, vm, vl, vg, vi_));       \
        if (yb < v_main) {                                                                                         \
            vf d = NAME##_block(zr, mk, yb, vm, vl, vg, vi_);                                                      \
            d[y - yb] += gy;                                                                                       \
            STORE(orow, yb, d);                                                                                    \
        }                                                                                                          \
        for (int64_t i = yb + LANES; i < v_main; i += LANES)                                                       \
            STORE(orow, i, NAME##_block(zr, mk, i, vm, vl, vg, vi_));                                              \
        if (v_main < v) { /* the last v % LANES: through LANES-wide buffers (logits padded with -inf) */           \
            uint8_t mb[LANES] = {0};                                                                               \
            ELEM zb[LANES], packed[LANES];                                                                         \
            memcpy(mb, mk + v_main, (size_t)(v - v_main));                                                         \
            vf zt = TAIL_LOAD(LOAD, ELEM, zr, v_main, v);                                                          \
            vf d;                                                                                                  \
            {                                                                                                      \
                const vf log2e = vsplat(1.4426950408889634f), lowest = vsplat(-127.0f), zero = {0};                \
                const vf lp = (zt - vm) * vi_ - vl;                                                                \
                d = vselect(mask_lanes(mb, 0), (zero - vg * vexp2(vmax(lowest, lp * log2e))) * vi_, zero);         \
                (void)zb;                                                                                          \
            }                                                                                                      \
            if (yb == v_main) d[y - yb] += gy;                                                                     \
            STORE(packed, 0, d);                                                                                   \
            memcpy(orow + v_main, packed, (size_t)(v - v_main) * sizeof(ELEM));                                    \
        }                                                                                                          \
    }

/* The entry path's values of LANES entries b .. b + LANES (all in the row). */
static inline vf entry_vals(const float *lp, const float *gc, int64_t b, vf vg, vf vi_, int with_p) {
    const vf log2e = vsplat(1.4426950408889634f), lowest = vsplat(-127.0f);
    const vf g = gc ? load_f32(gc, b) : (vf){0};
    return with_p ? (g - vg * vexp2(vmax(lowest, load_f32(lp, b) * log2e))) * vi_ : g * vi_;
}

#define DEFINE_SUPPORT_GRAD(NAME, LD1, ST1, LOAD, STORE, ELEM, DIRECT)                                             \
    DEFINE_SUPPORT_STREAM(NAME##_stream, LOAD, STORE, ELEM)                                                        \
    int64_t NAME(SUPPORT_GRAD_PARAMS) {                                                                            \
        uint64_t out_of_range = 0;                                                                                 \
        for (int64_t k = 0; k < n_rows; k++) {                                                                     \
            const int64_t r = rows[k], e0 = offsets[r], e1 = offsets[r + 1], y = tokens[r];                        \
            ELEM *restrict orow = (ELEM *)((char *)out + r * out_stride);                                          \
            if ((uint64_t)y >= (uint64_t)v) {                                                                      \
                memset(orow, 0, (size_t)v * sizeof(ELEM));                                                         \
                out_of_range = 1;                                                                                  \
                continue;                                                                                          \
            }                                                                                                      \
            double gd = gt[r];                                                                                     \
            if (gc)                                                                                                \
                for (int64_t e = e0; e < e1; e++) gd += gc[e];                                                     \
            const float gr = (float)gd, ir = it[r], gy = gt[r] * ir;                                               \
            if (!gc && gr == 0.0f) { /* no gradient: G = gt = 0, the token's term too */                            \
                memset(orow, 0, (size_t)v * sizeof(ELEM));                                                         \
                continue;                                                                                          \
            }                                                                                                      \
            if (!gc && mask && slot[r] >= 0) {                                                       \
                NAME##_stream(orow, (const ELEM *)((const char *)z + r * z_stride), mask + slot[r] * v, v, m[r],   \
                              ls[r], gr, ir, y, gy);                                                               \
                continue;                                                                                          \
            }                                                                                                      \
            memset(orow, 0, (size_t)v * sizeof(ELEM));                                                             \
            const vf vg = vsplat(gr), vi_ = vsplat(ir);                                                            \
            /* where the token's term goes: into its entry (16-bit: rounded once), or added after (fp32) */       \
            const int64_t at = !DIRECT && gy != 0.0f ? find_id(ids + e0, e1 - e0, y) : -1;                        \
            int64_t b = e0;                                                                                        \
            for (; b + LANES <= e1; b += LANES) {                                                                  \
                vf d = entry_vals(lp, gc, b, vg, vi_, gr != 0.0f);                                                 \
                if ((uint64_t)(at - (b - e0)) < (uint64_t)LANES) d[at - (b - e0)] += gy;                           \
                for (int j = 0; j < LANES; j++) {                                                                  \
                    const uint64_t id = (uint64_t)ids[b + j];                                                      \
                    if (id < (uint64_t)v) ST1(orow, id, LD1(orow, id) + d[j]);                                     \
                    else out_of_range = 1;                                                                         \
                }                                                                                                  \
            }                                                                                                      \
            if (b < e1) {                                                                                          \
                const int64_t nb = e1 - b;                                                                         \
                float lpb[LANES] = {0}, gcb[LANES] = {0};                                                          \
                if (gc) memcpy(gcb, gc + b, (size_t)nb * sizeof(float));                                           \
                if (gr != 0.0f) memcpy(lpb, lp + b, (size_t)nb * sizeof(float));                                  \
                vf d = entry_vals(lpb, gc ? gcb : NULL, 0, vg, vi_, gr != 0.0f);                                   \
                if ((uint64_t)(at - (b - e0)) < (uint64_t)LANES) d[at - (b - e0)] += gy;                           \
                for (int64_t j = 0; j < nb; j++) {                                                                 \
                    const uint64_t id = (uint64_t)ids[b + j];                                                      \
                    if (id < (uint64_t)v) ST1(orow, id, LD1(orow, id) + d[j]);                                     \
                    else out_of_range = 1;                                                                         \
                }                                                                                                  \
            }                                                                                                      \
            if (at < 0 && gy != 0.0f) ST1(orow, y, LD1(orow, y) + gy);                                             \
        }                                                                                                          \
        return out_of_range ? 2 : 0;                                                                               \
    }

DEFINE_SUPPORT_GRAD(support_grad_f32, ld1_f32, st1_f32, load_f32, store_f32, float, 1)
DEFINE_SUPPORT_GRAD(support_grad_bf16, ld1_bf16, st1_bf16, load_bf16, store_bf16, uint16_t, 0)
#if HAVE_F16
DEFINE_SUPPORT_GRAD(support_grad_f16, ld1_f16, st1_f16, load_f16, store_f16, _Float16, 0)
#endif
