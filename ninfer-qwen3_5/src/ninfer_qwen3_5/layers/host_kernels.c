/* NInfer's host-expert kernel: one MoE layer's routed sum on the CPU, for the (token, expert) pairs of a call sorted by
 * expert, reading the expert banks as stored (bf16, fp32, q4_g64_fp16, q8_g32_fp16):
 *
 *   out[token(p)] += weight(p) * down_e(round(silu(round(g)) * round(u))),  (g, u) = round(gate_up_e @ x(p))
 *
 * with e = e(p), every product summed in fp32, "round" to bf16 when the wider of the activation and weight dtypes
 * is bf16 (the reference's roundings; none for fp32 or quantized banks, which the reference decodes to fp32), and
 * the pairs' weighted outputs added in pair order, as the reference's index_add_ does.
 *
 * Built at first use by host_native.py with the host's C compiler (-O3 -march=native -fopenmp); GCC/Clang vector
 * extensions, so the compiler picks the host's widest vectors, except for the bf16 dot products below, which only
 * AVX-512 intrinsics reach.
 *
 * Why a kernel of our own: a decode step's pairs are a few tokens per expert. torch's GEMMs wake the thread team per
 * expert and a dequantizing bank decodes whole experts to fp32 first; here one parallel region covers every expert
 * of the call, each expert's weights are read once for all of its tokens (token tiles of up to TILE), and quantized
 * codes are expanded in registers (q4 through a 16-entry table of its code values, q8 by widening).
 *
 * Work split, in one OpenMP parallel region: the inputs' layout per pair; the gate_up projection as items (expert
 * group, block of RB rows) statically over the threads, each item taking the group's pairs a tile at a time and a
 * row's dot products for the tile's tokens (dense rows four at a time, quantized rows with their codes prefetched:
 * either way a core keeps enough of its reads in flight); the SwiGLU per pair; the down projection the same way; the weighted sum
 * by column ranges, each in pair order. Dot products are fp32 per 16-lane vector, then across the lanes: equal to
 * the fp64 reference within fp32 accumulation-order tolerance.
 *
 * bf16 dot products (BF16_DOT below): where the CPU has AVX512-BF16 and a projection's inputs are all bf16 values
 * (a bf16 model's activations, and a bf16 bank's rounded SwiGLU), the bf16, q4 and q8 rows multiply bf16 operands
 * with VDPBF16PS, 32 products an instruction into 16 fp32 lanes, instead of widening every weight to fp32 first.
 * A product of two bf16 values (8 significant bits each) is exact in fp32 and the instruction sums in fp32, so the
 * result differs from the fp32 path only in the order of its fp32 additions; q4 and q8 codes are small integers,
 * exact in bf16, and their group scales are applied in fp32 as before. (The instruction also flushes subnormals to
 * zero, in its inputs, products and sums: values below 1.2e-38, far inside the tolerance.) Inputs that are not all
 * bf16 values (fp32 activations, a quantized bank's fp32 SwiGLU) take the fp32 path: the check is per projection and
 * call, on the values themselves.
 *
 * Layouts (all row-major, contiguous):
 *   bank       rows of one expert follow each other; expert e's row r at (e * rows + r)
 *   bf16/fp32  [E * rows, K] elements
 *   q4_g64     base [E * rows, gpr * 32] bytes (byte j of a group: lane 2j in the low nibble, lane 2j+1 in the high,
 *              4-bit two's complement), scales [E * rows, gpr] fp16
 *   q8_g32     base [E * rows, gpr * 32] int8 codes, scales [E * rows, gpr] fp16
 *   x          [pairs, K] fp32, the pairs' inputs (prepared here: padded to gpr * group lanes for the groupwise
 *              formats; for q4 each group's 64 lanes stored as its 32 even lanes then its 32 odd lanes)
 *   first      [groups + 1]: group g's pairs are first[g] .. first[g + 1] - 1, all routed to expert[g]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
/* Unaligned, aliasing views for loads: a memcpy into a vector can become two scalar loads whose bytes are then
 * converted one at a time. */
typedef uint8_t v16u8_un __attribute__((vector_size(16), aligned(1), may_alias));
typedef float v16f_un __attribute__((vector_size(64), aligned(1), may_alias));
typedef uint16_t v16u16_un __attribute__((vector_size(32), aligned(1), may_alias));

static inline v16u8 load_u8(const void *p) { return *(const v16u8_un *)p; }

/* int8 codes to floats through 32-bit integers (a direct byte-to-float conversion is scalar code in some compilers),
 * widening code + 128, the byte with its top bit flipped: a byte widened straight from a load can be assembled one
 * at a time. */
static inline v16f i8_to_f(v16u8 b) {
    v16i32 v = __builtin_convertvector(b ^ 0x80, v16i32);
    return __builtin_convertvector(v - 128, v16f);
}

#define TILE 4   /* tokens whose dot products share one pass over a row */
#define RB 16    /* rows per work item */
/* How far ahead the groupwise rows prefetch their codes. A q4 or q8 row costs more instructions per byte than a
 * bf16 one, so a core has fewer loads in flight and the hardware prefetcher alone leaves it waiting on memory (bf16
 * rows: NEXT_ROWS below). Past a row's end it reaches into the next row of the item (rows are consecutive); a
 * prefetch never faults. */
#define PREFETCH_BYTES 2048
/* How many rows ahead the bf16 four-row reads prefetch the next four rows, a cache line of each per line they read
 * (0: none; host_native.py always sets it, from NINFER_HOST_ROW_PREFETCH or its default). A 2048-wide bf16 row is
 * one 4 KB page, where the hardware prefetcher stops, so without it each new row would start its stream cold. */
#ifndef NEXT_ROWS
#define NEXT_ROWS 0
#endif
/* The bf16 dot products of the module comment: 1 (default; host_native.py sets it from NINFER_HOST_BF16_DOT) uses
 * them where the compiler targets AVX512-BF16, 0 never. */
#ifndef BF16_DOT
#define BF16_DOT 1
#endif
#if BF16_DOT && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

static inline v16f load_f(const float *p) { return *(const v16f_un *)p; }

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* IEEE binary16 to binary32, subnormals included (a groupwise scale may be the smallest subnormal). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * 5.9604644775390625e-08f;   /* mant * 2^-24, exact */
        return sign ? -f : f;
    }
    bits = sign | (exp == 31 ? (0xffu << 23) | (mant << 13) : ((exp + 112u) << 23) | (mant << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v16f bf16_to_f(const uint16_t *p) {
    v16u16 h = *(const v16u16_un *)p;
    v16u32 w = __builtin_convertvector(h, v16u32) << 16;
    v16f f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* One row's dot products with the tile's tokens x[t] (t < tt), per format; out[t] gets the fp32 result. */
static inline __attribute__((always_inline)) void
row_dense(const void *w, int bf16, int64_t k, const float *const *x, int tt, float *out) {
    /* bf16 is a constant at every call: the compiler keeps one of the two loads. */
    const float *wf = w;
    const uint16_t *wh = w;
    v16f acc[TILE] = {{0}};
    float tail[TILE] = {0};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        v16f wv = bf16 ? bf16_to_f(wh + i) : load_f(wf + i);
        for (int t = 0; t < tt; t++) acc[t] += wv * load_f(x[t] + i);
    }
    for (; i < k; i++) {
        uint32_t bits = (uint32_t)(bf16 ? wh[i] : 0) << 16;
        float wi;
        memcpy(&wi, &bits, sizeof wi);
        wi = bf16 ? wi : wf[i];
        for (int t = 0; t < tt; t++) tail[t] += wi * x[t][i];
    }
    for (int t = 0; t < tt; t++) out[t] = hsum(acc[t]) + tail[t];
}

/* Four consecutive rows at once (w: the first; rows k apart), out[j][t] for row j: each row's dot products are
 * summed exactly as row_dense sums them (same lanes, same order), only interleaved, so that a core has four
 * streams of weights in flight instead of one; a single bf16 row's stream leaves it waiting on memory. */
static inline __attribute__((always_inline)) void
rows4_dense(const void *w, int bf16, int64_t k, const float *const *x, int tt, float out[4][TILE]) {
    const float *wf = w;
    const uint16_t *wh = w;
    v16f acc[4][TILE] = {{{0}}};
    float tail[4][TILE] = {{0}};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        v16f wv[4];
        if (NEXT_ROWS && bf16 && (i & 31) == 0)   /* a 64-byte line is 32 bf16 weights: once per line */
            for (int j = NEXT_ROWS; j < NEXT_ROWS + 4; j++) __builtin_prefetch(wh + j * k + i, 0, 3);
        for (int j = 0; j < 4; j++) wv[j] = bf16 ? bf16_to_f(wh + j * k + i) : load_f(wf + j * k + i);
        for (int t = 0; t < tt; t++) {
            v16f xv = load_f(x[t] + i);
            for (int j = 0; j < 4; j++) acc[j][t] += wv[j] * xv;
        }
    }
    for (; i < k; i++)
        for (int j = 0; j < 4; j++) {
            uint32_t bits = (uint32_t)(bf16 ? wh[j * k + i] : 0) << 16;
            float wi;
            memcpy(&wi, &bits, sizeof wi);
            wi = bf16 ? wi : wf[j * k + i];
            for (int t = 0; t < tt; t++) tail[j][t] += wi * x[t][i];
        }
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < tt; t++) out[j][t] = hsum(acc[j][t]) + tail[j][t];
}

/* A row's fp16 group scales as floats (the compiler's half type where it has one: one conversion instruction). */
static inline void row_scales(const uint16_t *sc, int64_t n, float *out) {
#ifdef __FLT16_MAX__
    typedef _Float16 half_alias __attribute__((may_alias));   /* the scales are stored as 16-bit words */
    const half_alias *h = (const half_alias *)sc;
    for (int64_t g = 0; g < n; g++) out[g] = (float)h[g];
#else
    for (int64_t g = 0; g < n; g++) out[g] = half_to_float(sc[g]);
#endif
}

/* q4: each nibble's code (4-bit two's complement) looked up in a 16-entry table of its float values. */
static inline __attribute__((always_inline)) void
row_q4(const uint8_t *w, const uint16_t *sc, int64_t gpr, const float *const *x, int tt, float *out) {
    v16f acc[TILE] = {{0}};
    const v16f codes = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
    const v16u8 low = (v16u8){0} + 0x0f;
    float s[gpr];
    row_scales(sc, gpr, s);
    for (int64_t g = 0; g < gpr; g++) {
        if ((g & 1) == 0) __builtin_prefetch(w + g * 32 + PREFETCH_BYTES, 0, 0);   /* a cache line per 2 groups */
        v16u8 b0 = load_u8(w + g * 32), b1 = load_u8(w + g * 32 + 16);
        v16f l0 = __builtin_shuffle(codes, __builtin_convertvector(b0 & low, v16i32));
        v16f h0 = __builtin_shuffle(codes, __builtin_convertvector(b0 >> 4, v16i32));
        v16f l1 = __builtin_shuffle(codes, __builtin_convertvector(b1 & low, v16i32));
        v16f h1 = __builtin_shuffle(codes, __builtin_convertvector(b1 >> 4, v16i32));
        for (int t = 0; t < tt; t++) {
            const float *xg = x[t] + g * 64;   /* even lanes 0..31, then odd lanes 0..31 */
            v16f d = l0 * load_f(xg) + l1 * load_f(xg + 16) + h0 * load_f(xg + 32) + h1 * load_f(xg + 48);
            acc[t] += s[g] * d;
        }
    }
    for (int t = 0; t < tt; t++) out[t] = hsum(acc[t]);
}

static inline __attribute__((always_inline)) void
row_q8(const int8_t *w, const uint16_t *sc, int64_t gpr, const float *const *x, int tt, float *out) {
    v16f acc[TILE] = {{0}};
    float s[gpr];
    row_scales(sc, gpr, s);
    for (int64_t g = 0; g < gpr; g++) {
        if ((g & 1) == 0) __builtin_prefetch(w + g * 32 + PREFETCH_BYTES, 0, 0);
        v16u8 b0 = load_u8(w + g * 32), b1 = load_u8(w + g * 32 + 16);
        v16f c0 = i8_to_f(b0), c1 = i8_to_f(b1);
        for (int t = 0; t < tt; t++) {
            const float *xg = x[t] + g * 32;
            acc[t] += s[g] * (c0 * load_f(xg) + c1 * load_f(xg + 16));
        }
    }
    for (int t = 0; t < tt; t++) out[t] = hsum(acc[t]);
}

#if HAVE_BF16_DOT
static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
/* The first n < 32 values (a row's tail; a masked-off lane is never read, so a row's end is never overrun). */
static inline __m512bh load_bh_head(const uint16_t *p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
}

/* nr (1, 4 or 8) consecutive bf16 rows (w: the first; rows k apart) against the tile's bf16 inputs xb[t]:
 * out[j][t]. As rows4_dense, several rows at once keep several streams of weights in flight; each row's sum is the
 * same whatever nr. With NEXT_ROWS set, the rows after these (NEXT_ROWS ahead, or nr if more) are prefetched. */
static inline __attribute__((always_inline)) void
rows_bf16_dot(const uint16_t *w, int64_t k, const uint16_t *const *xb, int tt, int nr, float out[8][TILE]) {
    __m512 acc[8][TILE];
    const int ahead = NEXT_ROWS > nr ? NEXT_ROWS : nr;
    for (int j = 0; j < nr; j++)
        for (int t = 0; t < tt; t++) acc[j][t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {   /* 32 weights: one 64-byte line of each row */
        __m512bh wv[8];
        if (NEXT_ROWS)
            for (int j = ahead; j < ahead + nr; j++) __builtin_prefetch(w + j * k + i, 0, 3);
        for (int j = 0; j < nr; j++) wv[j] = load_bh(w + j * k + i);
        for (int t = 0; t < tt; t++) {
            __m512bh xv = load_bh(xb[t] + i);
            for (int j = 0; j < nr; j++) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], wv[j], xv);
        }
    }
    if (i < k)
        for (int t = 0; t < tt; t++) {
            __m512bh xv = load_bh_head(xb[t] + i, k - i);
            for (int j = 0; j < nr; j++)
                acc[j][t] = _mm512_dpbf16_ps(acc[j][t], load_bh_head(w + j * k + i, k - i), xv);
        }
    for (int j = 0; j < nr; j++)
        for (int t = 0; t < tt; t++) out[j][t] = _mm512_reduce_add_ps(acc[j][t]);
}

/* bf16 bit patterns of the q4 codes 0..7, -8..-1, indexed by the nibble (lanes 16..31 unused). */
static const uint16_t Q4_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                     0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80};

/* row_q4 with bf16 inputs (laid out as prepare lays out x: a group's 32 even lanes, then its 32 odd lanes): the 32
 * bytes of a group widened to 16-bit lanes, each nibble looked up as its code's bf16 value. */
static inline __attribute__((always_inline)) void
row_q4_dot(const uint8_t *w, const uint16_t *sc, int64_t gpr, const uint16_t *const *xb, int tt, float *out) {
    __m512 acc[TILE];
    for (int t = 0; t < tt; t++) acc[t] = _mm512_setzero_ps();
    const __m512i table = _mm512_loadu_si512(Q4_BF16), low = _mm512_set1_epi16(0x0f);
    float s[gpr];
    row_scales(sc, gpr, s);
    for (int64_t g = 0; g < gpr; g++) {
        if ((g & 1) == 0) __builtin_prefetch(w + g * 32 + PREFETCH_BYTES, 0, 0);
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + g * 32)));
        __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low), table);
        __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
        for (int t = 0; t < tt; t++) {
            const uint16_t *xg = xb[t] + g * 64;
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), even, load_bh(xg));
            d = _mm512_dpbf16_ps(d, odd, load_bh(xg + 32));
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), d, acc[t]);
        }
    }
    for (int t = 0; t < tt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

/* row_q8 with bf16 inputs: a group's 32 int8 codes to fp32, then to bf16 (exact: |code| <= 128). */
static inline __attribute__((always_inline)) void
row_q8_dot(const int8_t *w, const uint16_t *sc, int64_t gpr, const uint16_t *const *xb, int tt, float *out) {
    __m512 acc[TILE];
    for (int t = 0; t < tt; t++) acc[t] = _mm512_setzero_ps();
    float s[gpr];
    row_scales(sc, gpr, s);
    for (int64_t g = 0; g < gpr; g++) {
        if ((g & 1) == 0) __builtin_prefetch(w + g * 32 + PREFETCH_BYTES, 0, 0);
        __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 32))));
        __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 32 + 16))));
        __m512bh c = _mm512_cvtne2ps_pbh(c1, c0);   /* lanes 0..15 from c0, 16..31 from c1 */
        for (int t = 0; t < tt; t++) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), c, load_bh(xb[t] + g * 32));
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(s[g]), d, acc[t]);
        }
    }
    for (int t = 0; t < tt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}
#endif

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q4 = 2, FMT_Q8 = 3 };

/* Lanes a scale covers (the groupwise formats); a dense row is one group of its whole length. */
static inline int64_t group_of(int fmt) { return fmt == FMT_Q4 ? 64 : 32; }
static inline int64_t padded(int fmt, int64_t k) {
    return fmt == FMT_Q4 || fmt == FMT_Q8 ? (k + 127) / 128 * 128 : k;   /* the groupwise rows' 128-lane padding */
}

static inline float round_bf16(float f) {   /* to the nearest bf16, ties to even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u)
        u = (u & 0xffff0000u) | ((u & 0xffffu) ? 0x00400000u : 0);   /* inf stays, NaN stays NaN */
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A pair's input row src[k] as the format's kernel reads it, in dst[padded(k)]; and, where dst_bf16 is not NULL,
 * the same lanes' upper halves (their bf16 values, if they are bf16 values) in dst_bf16[padded(k)]. Returns whether
 * every value of the row is a bf16 value (its lower half zero). */
static int prepare(int fmt, const float *src, int64_t k, float *dst, uint16_t *dst_bf16) {
    int64_t kp = padded(fmt, k);
    if (fmt != FMT_Q4) {
        memcpy(dst, src, k * sizeof *dst);
        memset(dst + k, 0, (kp - k) * sizeof *dst);
    } else {
        for (int64_t g = 0; g < kp / 64; g++)
            for (int j = 0; j < 32; j++) {
                int64_t even = g * 64 + 2 * j, odd = even + 1;
                dst[g * 64 + j] = even < k ? src[even] : 0.0f;
                dst[g * 64 + 32 + j] = odd < k ? src[odd] : 0.0f;
            }
    }
    if (!dst_bf16) return 0;
    uint32_t low = 0;
    for (int64_t i = 0; i < kp; i++) {
        uint32_t u;
        memcpy(&u, dst + i, sizeof u);
        low |= u & 0xffffu;
        dst_bf16[i] = (uint16_t)(u >> 16);
    }
    return low == 0;
}

/* The bf16 planes to pass a projection: xb where the build has the bf16 dot products, the bank is not fp32 and
 * every input was a bf16 value; else NULL (the fp32 path). */
static inline const uint16_t *dot_inputs(int fmt, int exact, const uint16_t *xb) {
    return HAVE_BF16_DOT && fmt != FMT_F32 && exact ? xb : NULL;
}

/* A buffer of n bf16 planes' lanes where the bf16 dot products may read them (the build has them and the bank is
 * not fp32), else NULL; *failed set when it could not be allocated. */
static uint16_t *dot_buffer(int fmt, int64_t n, int *failed) {
    uint16_t *b = HAVE_BF16_DOT && fmt != FMT_F32 ? malloc((size_t)(n + 1) * sizeof *b) : NULL;
    *failed = HAVE_BF16_DOT && fmt != FMT_F32 && !b;
    return b;
}

/* The tile's rows [r0, r1) of expert e, with a compile-time tile width so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
tile_rows(int fmt, const void *base, const uint16_t *scales, int64_t rows, int64_t k, int64_t e, int64_t r0,
          int64_t r1, const float *const *x, const uint16_t *const *xb, float *const *y, int tt) {
    float out[TILE];
    int64_t gpr = k / group_of(fmt);
    int64_t r = r0;
#if HAVE_BF16_DOT
    if (xb) {   /* bf16 dot products: bf16 rows 8 (up to 2 tokens: registers allow) or 4 at a time, then one
                 * by one; groupwise rows one by one */
        float outn[8][TILE];
        for (; fmt == FMT_BF16 && tt <= 2 && r + 8 <= r1; r += 8) {
            rows_bf16_dot((const uint16_t *)base + (e * rows + r) * k, k, xb, tt, 8, outn);
            for (int j = 0; j < 8; j++)
                for (int t = 0; t < tt; t++) y[t][r + j] = outn[j][t];
        }
        for (; fmt == FMT_BF16 && r + 4 <= r1; r += 4) {
            rows_bf16_dot((const uint16_t *)base + (e * rows + r) * k, k, xb, tt, 4, outn);
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < tt; t++) y[t][r + j] = outn[j][t];
        }
        for (; r < r1; r++) {
            int64_t row = e * rows + r;
            if (fmt == FMT_BF16) {
                rows_bf16_dot((const uint16_t *)base + row * k, k, xb, tt, 1, outn);
                for (int t = 0; t < tt; t++) out[t] = outn[0][t];
            } else if (fmt == FMT_Q4) {
                row_q4_dot((const uint8_t *)base + row * gpr * 32, scales + row * gpr, gpr, xb, tt, out);
            } else {
                row_q8_dot((const int8_t *)base + row * gpr * 32, scales + row * gpr, gpr, xb, tt, out);
            }
            for (int t = 0; t < tt; t++) y[t][r] = out[t];
        }
        return;
    }
#else
    (void)xb;
#endif
    if (fmt == FMT_F32 || fmt == FMT_BF16) {   /* dense rows four at a time, then one by one */
        float out4[4][TILE];
        for (; r + 4 <= r1; r += 4) {
            int64_t row = e * rows + r;
            if (fmt == FMT_F32) rows4_dense((const float *)base + row * k, 0, k, x, tt, out4);
            else rows4_dense((const uint16_t *)base + row * k, 1, k, x, tt, out4);
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < tt; t++) y[t][r + j] = out4[j][t];
        }
    }
    for (; r < r1; r++) {
        int64_t row = e * rows + r;
        switch (fmt) {
        case FMT_F32: row_dense((const float *)base + row * k, 0, k, x, tt, out); break;
        case FMT_BF16: row_dense((const uint16_t *)base + row * k, 1, k, x, tt, out); break;
        case FMT_Q4: row_q4((const uint8_t *)base + row * gpr * 32, scales + row * gpr, gpr, x, tt, out); break;
        default: row_q8((const int8_t *)base + row * gpr * 32, scales + row * gpr, gpr, x, tt, out); break;
        }
        for (int t = 0; t < tt; t++) y[t][r] = out[t];
    }
}

/* y[p, :rows] = W_{e(p)} x[p] for every pair, x prepared (padded length kp), with the bf16 dot products where xb
 * (x's bf16 planes, dot_inputs) is not NULL: a worksharing loop, run by the threads of the enclosing parallel
 * region. */
static void project(int fmt, const void *base, const uint16_t *scales, int64_t rows, int64_t kp,
                    const int64_t *expert, const int64_t *first, int64_t groups, const float *x, const uint16_t *xb,
                    float *y) {
    int64_t blocks = (rows + RB - 1) / RB;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < groups * blocks; item++) {
        int64_t g = item / blocks, r0 = (item % blocks) * RB, r1 = r0 + RB < rows ? r0 + RB : rows;
        for (int64_t p = first[g]; p < first[g + 1]; p += TILE) {
            int tt = first[g + 1] - p < TILE ? (int)(first[g + 1] - p) : TILE;
            const float *xt[TILE];
            const uint16_t *xbt[TILE];
            float *yt[TILE];
            for (int t = 0; t < tt; t++) {
                xt[t] = x + (p + t) * kp;
                xbt[t] = xb ? xb + (p + t) * kp : NULL;
                yt[t] = y + (p + t) * rows;
            }
            const uint16_t *const *xbs = xb ? xbt : NULL;
            switch (tt) {   /* constant tile widths: the accumulator loops unroll */
            case 4: tile_rows(fmt, base, scales, rows, kp, expert[g], r0, r1, xt, xbs, yt, 4); break;
            case 3: tile_rows(fmt, base, scales, rows, kp, expert[g], r0, r1, xt, xbs, yt, 3); break;
            case 2: tile_rows(fmt, base, scales, rows, kp, expert[g], r0, r1, xt, xbs, yt, 2); break;
            default: tile_rows(fmt, base, scales, rows, kp, expert[g], r0, r1, xt, xbs, yt, 1); break;
            }
        }
    }
}

static int known(int fmt) { return fmt >= FMT_F32 && fmt <= FMT_Q8; }

/* One projection: y[p] = W_{e(p)} x[p] ([pairs, rows]) for x [pairs, k]. Returns 0, -1 for an unknown format, -2
 * when out of memory. */
int ninfer_expert_rows(int fmt, const void *base, const uint16_t *scales, int64_t rows, int64_t k,
                       const int64_t *expert, const int64_t *first, int64_t groups, const float *x, float *y,
                       int threads) {
    if (!known(fmt)) return -1;
    int64_t pairs = first[groups], kp = padded(fmt, k);
    float *xp = malloc((size_t)(pairs * kp + 1) * sizeof *xp);
    int failed;
    uint16_t *xb = dot_buffer(fmt, pairs * kp, &failed);
    if (!xp || failed) {
        free(xp), free(xb);
        return -2;
    }
    int exact = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) reduction(&& : exact)
        for (int64_t p = 0; p < pairs; p++)
            exact = prepare(fmt, x + p * k, k, xp + p * kp, xb ? xb + p * kp : NULL) && exact;
        project(fmt, base, scales, rows, kp, expert, first, groups, xp, dot_inputs(fmt, exact, xb), y);
    }
    free(xp), free(xb);
    return 0;
}

/* The routed sum (module comment) of x [pairs, hidden] into out [tokens, hidden] (added to what it holds), for
 * gate_up [E, 2 * inter, hidden] and down [E, hidden, inter] in format fmt, token[p] and weight[p] per pair;
 * round_bf16 != 0 rounds as a bf16 run does. Returns 0, -1 for an unknown format, -2 when out of memory. */
int ninfer_routed_sum(int fmt, const void *gu_base, const uint16_t *gu_scales, const void *dn_base,
                      const uint16_t *dn_scales, int64_t hidden, int64_t inter, const int64_t *expert,
                      const int64_t *first, int64_t groups, const float *x, const int64_t *token,
                      const float *weight, int round, float *out, int threads) {
    if (!known(fmt)) return -1;
    int64_t pairs = first[groups], kh = padded(fmt, hidden), ki = padded(fmt, inter);
    float *xp = malloc((size_t)(pairs * (kh + 2 * inter + ki + hidden) + 1) * sizeof *xp);
    int failed;
    uint16_t *xb = dot_buffer(fmt, pairs * (kh + ki), &failed);
    if (!xp || failed) {
        free(xp), free(xb);
        return -2;
    }
    float *h = xp + pairs * kh, *ap = h + pairs * 2 * inter, *y = ap + pairs * ki;
    uint16_t *ab = xb ? xb + pairs * kh : NULL;
    int x_exact = 1, act_exact = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) reduction(&& : x_exact)
        for (int64_t p = 0; p < pairs; p++)
            x_exact = prepare(fmt, x + p * hidden, hidden, xp + p * kh, xb ? xb + p * kh : NULL) && x_exact;
        project(fmt, gu_base, gu_scales, 2 * inter, kh, expert, first, groups, xp, dot_inputs(fmt, x_exact, xb), h);
#pragma omp for schedule(static) reduction(&& : act_exact)
        for (int64_t p = 0; p < pairs; p++) {
            float *hp = h + p * 2 * inter, act[inter];
            for (int64_t j = 0; j < inter; j++) {
                float g = round ? round_bf16(hp[j]) : hp[j], u = round ? round_bf16(hp[inter + j]) : hp[inter + j];
                float a = g / (1.0f + expf(-g)) * u;
                act[j] = round ? round_bf16(a) : a;
            }
            act_exact = prepare(fmt, act, inter, ap + p * ki, ab ? ab + p * ki : NULL) && act_exact;
        }
        project(fmt, dn_base, dn_scales, hidden, ki, expert, first, groups, ap, dot_inputs(fmt, act_exact, ab), y);
        /* Columns split over the threads; each column adds the pairs in order (the reference's index_add_). */
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < hidden; c0 += 64) {
            int64_t c1 = c0 + 64 < hidden ? c0 + 64 : hidden;
            for (int64_t p = 0; p < pairs; p++) {
                float *o = out + token[p] * hidden;
                const float *yp = y + p * hidden;
                for (int64_t c = c0; c < c1; c++) o[c] += (round ? round_bf16(yp[c]) : yp[c]) * weight[p];
            }
        }
    }
    free(xp), free(xb);
    return 0;
}

/* ninfer_routed_sum for a call's routing as the router gives it: ids [tokens, k] (int64 expert ids), skip (NULL or
 * one byte a pair, nonzero: left out), weights [tokens, k] fp32, x [tokens, hidden] fp32 or (x_bf16) bf16. The pairs
 * are sorted here, stably by expert (a counting sort: within an expert in flat pair order, the experts ascending,
 * as the Python side's expert_groups sorts them), and each pair's row of x widened to fp32 as it is gathered, so a
 * decode step's call costs one crossing from Python instead of a dozen small tensor operations. Returns 0, -1 for
 * an unknown format, -2 when out of memory, -3 for an expert id outside [0, experts). */
int ninfer_routed_sum_ids(int fmt, const void *gu_base, const uint16_t *gu_scales, const void *dn_base,
                          const uint16_t *dn_scales, int64_t hidden, int64_t inter, int64_t experts,
                          const int64_t *ids, const uint8_t *skip, const float *weights, int64_t tokens, int64_t k,
                          const void *x, int x_bf16, int round, float *out, int threads) {
    if (!known(fmt)) return -1;
    int64_t n = tokens * k, pairs = 0, groups = 0;
    int64_t *start = calloc((size_t)experts + 1, sizeof *start);
    if (!start) return -2;
    for (int64_t p = 0; p < n; p++) {
        if (skip && skip[p]) continue;
        if (ids[p] < 0 || ids[p] >= experts) {
            free(start);
            return -3;
        }
        if (start[ids[p]]++ == 0) groups++;
        pairs++;
    }
    if (pairs == 0) {
        free(start);
        return 0;
    }
    int64_t *meta = malloc((size_t)(2 * groups + 1 + pairs) * sizeof *meta);
    float *rows = malloc((size_t)(pairs * hidden + pairs) * sizeof *rows);
    if (!meta || !rows) {
        free(start), free(meta), free(rows);
        return -2;
    }
    int64_t *expert = meta, *first = meta + groups, *token = first + groups + 1;
    float *weight = rows + pairs * hidden;
    int64_t g = 0, at = 0;
    for (int64_t e = 0; e < experts; e++) {   /* counts to each expert's first slot, the groups in ascending order */
        int64_t c = start[e];
        start[e] = at;
        if (c) {
            expert[g] = e;
            first[g++] = at;
        }
        at += c;
    }
    first[groups] = pairs;
    for (int64_t p = 0; p < n; p++) {
        if (skip && skip[p]) continue;
        int64_t slot = start[ids[p]]++, t = p / k;
        token[slot] = t;
        weight[slot] = weights[p];
        float *dst = rows + slot * hidden;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + t * hidden;
            for (int64_t j = 0; j < hidden; j++) {
                uint32_t u = (uint32_t)src[j] << 16;
                memcpy(dst + j, &u, sizeof u);
            }
        } else {
            memcpy(dst, (const float *)x + t * hidden, (size_t)hidden * sizeof *dst);
        }
    }
    int status = ninfer_routed_sum(fmt, gu_base, gu_scales, dn_base, dn_scales, hidden, inter, expert, first, groups,
                                   rows, token, weight, round, out, threads);
    free(start), free(meta), free(rows);
    return status;
}

/* 1 if this build multiplies bf16 inputs with the bf16 dot products (module comment), else 0. */
int ninfer_bf16_dot(void) { return HAVE_BF16_DOT; }

/* A routed sum queued on a GPU stream as a host function (host_mailbox.py): the driver calls ninfer_host_job_run
 * with the job once the stream's earlier work is done, and the stream's later work waits for it to return, so a
 * captured CUDA graph keeps the host's share inside it as a host node. Every field is 8 bytes (host_mailbox.py
 * mirrors the layout). The device writes the call's token count to *count and its rows of ids, weights and x to
 * the mailbox before the node; the node writes the fp32 sum to out. A host function may make no CUDA call and
 * cannot return an error, so a failure is kept in status (the first one; 0 while none), which the Python side
 * reads; its out rows are then not the sum. */
typedef struct {
    int64_t fmt, x_bf16, round, threads;
    const void *gu_base;
    const uint16_t *gu_scales;
    const void *dn_base;
    const uint16_t *dn_scales;
    int64_t hidden, inter, experts, k, capacity;
    const int64_t *count, *ids;
    const uint8_t *skip; /* one byte a (token, choice) of the mailbox, nonzero: the device computes that pair */
    const float *weights;
    const void *x;
    float *out;
    int64_t status, calls;
} ninfer_host_job;

/* -4: a token count outside [0, capacity]. */
void ninfer_host_job_run(void *arg) {
    ninfer_host_job *j = arg;
    int64_t tokens = *(volatile const int64_t *)j->count;
    int status = -4;
    if (tokens >= 0 && tokens <= j->capacity) {
        memset(j->out, 0, (size_t)(tokens * j->hidden) * sizeof *j->out);
        status = ninfer_routed_sum_ids((int)j->fmt, j->gu_base, j->gu_scales, j->dn_base, j->dn_scales, j->hidden,
                                       j->inter, j->experts, j->ids, j->skip, j->weights, tokens, j->k, j->x,
                                       (int)j->x_bf16, (int)j->round, j->out, (int)j->threads);
    }
    if (status != 0 && j->status == 0) j->status = status;
    j->calls++;
}
