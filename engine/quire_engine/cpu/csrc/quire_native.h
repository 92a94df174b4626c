/* What the native CPU kernels share: each kernel's entry point (so that a kernel calling another
 * is checked against its definition) and the inline math they all use.
 *
 * Compiled into one shared library by quire_engine/cpu/native.py, which also hashes this
 * header into the library's cache key.
 */
#ifndef QUIRE_NATIVE_H
#define QUIRE_NATIVE_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* What one K or V element of a pool is (native.py's KV_KINDS maps torch dtypes to these). An
 * 8-bit pool has beside it a float32 scale per token and KV head (kernels/kv_quant.py owns the
 * format; csrc/kv_quant.c writes it, csrc/kv_quant.h reads it). */
enum quire_kv_kind {
    QUIRE_KV_F32 = 0,  /* float32, no scales */
    QUIRE_KV_INT8 = 1, /* int8 */
    QUIRE_KV_E4M3 = 2, /* float8_e4m3fn */
    QUIRE_KV_E5M2 = 3, /* float8_e5m2 */
    QUIRE_KV_BF16 = 4, /* bfloat16, no scales (a bf16 model's pool; paged decode only) */
};

/* csrc/paged_decode.c: k, v are pools of `kind` elements; k_scale, v_scale their scales (NULL
 * for QUIRE_KV_F32 and QUIRE_KV_BF16). Returns 0, 1 when scratch could not be allocated, 2 for an unknown kind. */
int quire_paged_decode(const float *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
                       const float *k_scale, const float *v_scale, int64_t kind,
                       const int64_t *rows, const int32_t *tables, int64_t table_stride,
                       const int64_t *lens, int64_t n, int64_t block_size, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                       float softcap, float *out, int64_t num_threads);

/* csrc/kv_quant.c: `rows` rows of d floats at x quantized into `kind` (an 8-bit kind) at data,
 * each row's scale into scales[row]; fixed > 0: that scale for every row, else dynamic. */
void quire_kv_quantize(const float *x, int64_t rows, int64_t d, int64_t kind, float fixed,
                       void *data, float *scales);

/* csrc/skinny_linear.c */
void quire_skinny_linear(const float *x, int64_t x_stride, int64_t M, const float *w,
                         const float *bias, int64_t N, int64_t K, float *y, int64_t y_stride,
                         int64_t num_threads);

/* csrc/decoder_decode.c: one decode step of a Llama-shaped decoder stack.
 *
 * One layer's row of the layer table: the address of each of its tensors, in this order (0 for
 * an absent bias). quire_layer_field_names[f] is the name of field f (its enum name in lower
 * case without the F_), exported with quire_layer_field_count so that the loader (native.py)
 * checks its own list against this one, name by name, before it calls anything. */
enum quire_layer_field {
    F_INPUT_NORM, /* [hidden] */
    F_Q,          /* [heads * head_dim, hidden] */
    F_Q_BIAS,     /* [heads * head_dim] or 0 */
    F_K,          /* [kv_heads * head_dim, hidden] */
    F_K_BIAS,     /* [kv_heads * head_dim] or 0 */
    F_V,          /* [kv_heads * head_dim, hidden] */
    F_V_BIAS,     /* [kv_heads * head_dim] or 0 */
    F_O,          /* [hidden, heads * head_dim] */
    F_O_BIAS,     /* [hidden] or 0 */
    F_POST_NORM,  /* [hidden] */
    F_GATE,       /* [inter, hidden] */
    F_GATE_BIAS,  /* [inter] or 0 */
    F_UP,         /* [inter, hidden] */
    F_UP_BIAS,    /* [inter] or 0 */
    F_DOWN,       /* [hidden, inter] */
    F_DOWN_BIAS,  /* [hidden] or 0 */
    F_K_CACHE,    /* the layer's K pool of kv_kind elements (written at `slots`, then read) */
    F_V_CACHE,    /* the layer's V pool */
    F_K_SCALE,    /* an 8-bit pool's K scales [num_blocks, block_size, kv_heads], else 0 */
    F_V_SCALE,    /* its V scales, else 0 */
    QUIRE_LAYER_FIELDS
};
extern const char *const quire_layer_field_names[QUIRE_LAYER_FIELDS];
extern const int64_t quire_layer_field_count;

/* The arguments of quire_decoder_decode, mirrored field for field by native.DecoderArgs (a
 * ctypes.Structure). The library exports every field's name, in order, with its offset
 * (quire_decoder_arg_names, quire_decoder_arg_offsets, quire_decoder_arg_count) and the size of
 * the whole (quire_decoder_args_size): the loader refuses a library whose layout differs from its
 * mirror.
 *
 * Every tensor is fp32 and C-contiguous unless stated (the pools: of kv_kind). Ownership: the caller owns every array and
 * keeps it alive for the call; the call reads the weights, writes the step's K/V into the pools
 * and the logits, and keeps no pointer after it returns. Who checks what: the caller
 * (cpu/decoder.py) checks every shape and every index (token ids inside the embedding, rope rows
 * inside cos/sin, block ids and slots inside the pools, each length inside its table row) and
 * that 1 <= n; this code trusts them and checks only layer_fields. */
struct quire_decoder_args {
    /* The model, fixed for the life of a DecoderStack. */
    const int64_t *layers;   /* int64 [num_layers, layer_fields]: addresses, as the enum above */
    int64_t layer_fields;    /* must equal QUIRE_LAYER_FIELDS (else the call returns 2) */
    int64_t num_layers;
    const int64_t *windows;  /* int64 [num_layers]: sliding window, 0 for none */
    const float *scales;     /* [num_layers]: softmax scale */
    const float *embed;      /* [vocab_rows, hidden] */
    const float *final_norm; /* [hidden] */
    const float *lm_head;    /* [vocab, hidden] */
    const float *lm_bias;    /* [vocab] or NULL */
    int64_t vocab;           /* logits per row */
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;        /* divides heads */
    int64_t head_dim;        /* even (RoPE rotates halves) */
    int64_t inter;           /* the MLP's width */
    float eps;               /* every RMSNorm's epsilon */
    int64_t block_size;      /* tokens per block of the pools */
    int64_t kv_kind;         /* enum quire_kv_kind of every layer's pools */
    const float *kv_fixed;   /* [num_layers, 2]: each layer's fixed (K, V) scales for an 8-bit
                              * pool, or NULL: dynamic per-token scales (csrc/kv_quant.c) */
    /* The step. */
    int64_t n;               /* sequences, one new token each */
    const int64_t *ids;      /* int64 [n]: token ids, each in 0 .. vocab_rows - 1 */
    const float *cos;        /* [rope_rows_total, head_dim]: the model's rotary cos */
    const float *sin;        /* [rope_rows_total, head_dim] */
    const int64_t *rope_rows; /* int64 [n]: token t's row in cos/sin */
    const int64_t *slots;    /* int64 [n]: block_id * block_size + offset of the new token */
    const int32_t *tables;   /* int32 [n, table_stride]: block ids, as quire_paged_decode */
    int64_t table_stride;
    const int64_t *lens;     /* int64 [n]: context length including the new token */
    float *logits;           /* [n, vocab], written */
    int64_t num_threads;     /* OpenMP threads for the matmuls and the attention */
};
extern const char *const quire_decoder_arg_names[];
extern const int64_t quire_decoder_arg_offsets[];
extern const int64_t quire_decoder_arg_count;
extern const int64_t quire_decoder_args_size;

/* Returns 0; 1 when scratch memory could not be allocated (the logits are not written, and the
 * K/V of some layers may be: the caller fails the step); 2 when args->layer_fields is not
 * QUIRE_LAYER_FIELDS or args->kv_kind is unknown (nothing is touched). */
int quire_decoder_decode(const struct quire_decoder_args *args);

/* exp(x) for x <= 0 (a softmax numerator), written so that the compiler vectorizes it: libm's
 * expf is a call per element, a quarter of this kernel's time. Range reduction x = n ln2 + r with
 * n = round(x / ln2) (adding and subtracting 1.5 * 2^23 rounds to nearest), |r| <= ln2 / 2, ln2
 * split in two constants (the high part exact in float); exp(r) by its degree-7 Taylor expansion
 * (truncation ~2e-9 relative at |r| = 0.35, below float rounding); 2^n assembled in the exponent
 * bits. Over every float in [-87, 0]: within 1 ulp of glibc's expf, relative error <= 1.1e-7.
 * Below -87.3 the result would be a denormal, so 0 (a weight under 1e-38 of the row's maximum);
 * NaN stays NaN, so a broken model still shows. The selects vectorize only when the compiler
 * may assume floating-point operations do not trap (-fno-trapping-math, set by native.py). */
static inline float exp_nonpositive(float x)
{
    const float clamped = x < -87.3f ? -87.3f : x;
    const float shifted = clamped * 1.44269504088896341f + 12582912.0f;
    const float n = shifted - 12582912.0f;
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* The low mantissa bits of `shifted` hold n (as 0x4B400000 + n): move it to the exponent. */
    union {
        float f;
        uint32_t i;
    } bits = {.f = shifted};
    /* Unsigned: for a NaN x the bits are garbage (discarded below), and signed overflow or a
     * shift of a negative value would be undefined behaviour. */
    bits.i = (bits.i - 0x4B400000u + 127u) << 23;
    const float value = p * bits.f;
    return x != x ? x : (x < -87.3f ? 0.0f : value);
}

/* Vectors of LANES floats for the kernels' inner loops (GCC/clang vector extensions): one
 * AVX-512 register where the CPU has them (16 lanes: half the instructions for the same floats),
 * else one AVX register or two NEON registers (8 lanes). The lane count sets the summation
 * order of every dot product (lane l sums elements l, l + LANES, ...), so results differ by
 * rounding between an AVX-512 and an AVX2 build; within one build the order depends on nothing
 * else (batch invariance holds). A source file defining QUIRE_LANES_8 before including this
 * header gets 8 lanes anyway (for A/B builds: each kernel's order is its own, so its files may
 * differ in this). */
#if defined(__AVX512F__) && !defined(QUIRE_LANES_8)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

/* Builds without the vector units or OpenMP (native.FLAG_SETS' fallbacks) are meant to compile
 * warning-free too: the helpers below pass 256-bit vectors between static inline functions only,
 * never across an ABI boundary (GCC's -Wpsabi note is moot), and without OpenMP its pragmas are
 * meant to be ignored (the kernels then run on one thread). */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#if defined(__GNUC__) && !defined(_OPENMP)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#endif

/* Every lane v. */
static inline vec vec_splat(float v)
{
    return (vec){0} + v;
}

static inline vec vec_load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* acc + a * b, one rounding per lane where the CPU has fused multiply-add, two elsewhere:
 * written out rather than left to the compiler's contraction (-ffp-contract), which may fuse in
 * one loop and not in another (in skinny_linear.c, that would break the batch invariance). */
static inline vec vec_madd(vec acc, vec a, vec b)
{
#if LANES == 16
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__AVX__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* acc + a * b on 8 lanes, as vec_madd (an AVX register also in an AVX-512 build). */
static inline vec8 vec8_madd(vec8 acc, vec8 a, vec8 b)
{
#if defined(__AVX__) && defined(__FMA__)
    return (vec8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline vec8 vec8_load(const float *p)
{
    vec8 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* With 16 lanes, the first step of every lane sum: lane i plus lane i + 8, as one vector of 8.
 * A kernel may keep a 16-lane accumulator as two 8-lane halves (lanes 0-7 and 8-15: the same
 * multiply-adds on the same lanes, so the same bits) and add them itself: `lo + hi`. */
static inline vec8 vec_fold(vec a)
{
#if LANES == 16
    const __m512 z = (__m512)a;
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
    return (vec8)_mm256_add_ps(_mm512_castps512_ps256(z), hi);
#else
    return a;
#endif
}

static inline float vec8_sum(vec8 a)
{
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static inline float lanes_sum(vec v)
{
    return vec8_sum(vec_fold(v));
}

/* vec8_sum of `count` vectors into s[0 .. count): with AVX four at a time, the same additions
 * in vector form (the low and high halves lane by lane, then two horizontal adds of adjacent
 * pairs), so the same bits as vec8_sum one by one. */
static inline __attribute__((always_inline)) void vec8_sums(const vec8 *a, const int count,
                                                            float *s)
{
    int c = 0;
#if defined(__AVX__)
    for (; c + 4 <= count; c += 4) {
        __m128 h[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m256 v = (__m256)a[c + i];
            h[i] = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        }
        _mm_storeu_ps(s + c, _mm_hadd_ps(_mm_hadd_ps(h[0], h[1]), _mm_hadd_ps(h[2], h[3])));
    }
#endif
    for (; c < count; c++)
        s[c] = vec8_sum(a[c]);
}

/* The lane sums of `count` (at most 32) accumulators into s[0 .. count), each in lanes_sum's
 * order. */
static inline __attribute__((always_inline)) void lanes_sums(const vec *acc, const int count,
                                                             float *s)
{
    vec8 folded[32];
#pragma GCC unroll 32
    for (int c = 0; c < count; c++)
        folded[c] = vec_fold(acc[c]);
    vec8_sums(folded, count, s);
}

/* Asks for the 64-byte line at p to be brought into the second-level cache, ahead of its use
 * (locality 2: prefetcht1 on x86, PRFM PLDL2KEEP on Arm). Both kernels stream data that the
 * hardware prefetcher does not fetch early enough on its own (W several rows at a time, K/V
 * blocks anywhere in the pool). L2 rather than L1 or non-temporal: a request into L1 holds one of
 * the core's few L1 miss buffers until its line arrives, one into L2 does not (measured: see
 * docs/benchmarks.md). A hint only: no effect on results. */
static inline void prefetch_l2(const void *p)
{
#if defined(__GNUC__)
    __builtin_prefetch(p, 0, 2);
#else
    (void)p;
#endif
}

/* Keeps v in a register. Without it GCC folds the load of an x vector into every multiply-add
 * that uses it, loading it NW times: 14 loads for the 12 multiply-adds of a 6 x 2 tile, and the
 * load ports, not the multiply-adds, bound the tile. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && LANES == 16
#define IN_REGISTER(v) __asm__("" : "+v"(v)) /* any of the 32 vector registers */
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v)) /* a 256-bit vector: an AVX register */
#else
#define IN_REGISTER(v) ((void)0)
#endif

#endif
