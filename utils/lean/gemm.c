/* Our GEMM kernels, built for the CPU they run on by `utils/lean/native.py` (cc -O3 -march=native -fopenmp
   -ffp-contract=off): bfloat16 weights (specdec_gemm, below: vector units, or the tile unit for bfloat16 activations
   where the CPU has AMX) and 4-bit weights (specdec_gemm_q4, at the end of the file). Each kernel has an AVX-512
   version, an AVX2 + FMA one and a plain C one (any other CPU: x86-64 without AVX2, aarch64, ...), chosen at
   compile time; the plain C ones take the AVX2 versions' steps lane for lane, so they give their bits. OpenMP is
   optional (without -fopenmp the pragmas are ignored and every call runs on one thread).

   y = x W^T (+ b) for bfloat16 weights W (out, in) and up to MAX_ROWS rows of x (rows, in); x, b and y in float32
   or bfloat16.

   Why our own: torch's fastest product for one row streams the weights at ~80% of what a `sum` reads, and a
   float32 model on an AVX2 machine reads its weights in float32 though most checkpoints hold exact bfloat16
   values; this kernel reads bfloat16 weights and multiplies in float32 whatever the activations' dtype.

   Width invariance by construction: every output is one fixed chain of fused multiply-adds per vector lane (the
   even elements of each KB-block, then its odd ones, block after block) and one fixed horizontal sum, whatever the
   number of rows, the thread count or the block an output falls in: a row's result is the same bits in a pass of
   one row and in a pass of thirty-two.

   Shape of the work: each thread takes whole blocks of JB weight rows; a block's rows are read chunk by chunk
   (KC elements), each chunk once from memory, prefetched PREFETCH bytes ahead into L1, then used by every group of
   RB activation rows while it sits in the cache. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* the intrinsics are used only under their ISA's #if below */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "specdec.h"

#if defined(__AVX2__)
/* 8 float32 -> bfloat16, rounded as f32_to_bf16 rounds (to nearest even, a NaN stays a NaN). */
static inline __m128i bf16_round8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  __m256i packed = _mm256_packus_epi32(rounded, rounded); /* per 128-bit half: its four values twice */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

#define MAX_ROWS SPECDEC_MAX_ROWS
#define JB 4
#define KC 512
#define PREFETCH 16384

#if defined(__AVX512F__)
#define KB 32 /* bfloat16 weights per step: one 64-byte load per weight row */
#define RB 4
typedef __m512 vf;
typedef __m512i vi;
static inline vi load_w(const uint16_t* p) { return _mm512_loadu_si512((const void*)p); }
static inline vf even_half(vi w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline vf odd_half(vi w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u))); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define KB 16
#define RB 2
typedef __m256 vf;
typedef __m256i vi;
static inline vi load_w(const uint16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vf even_half(vi w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline vf odd_half(vi w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))); }
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else /* plain C, any CPU: AVX2's steps lane for lane (8 float32 lanes, fmaf, its horizontal sum's tree) */
#define KB 16
#define RB 2
#define PLAIN_LANES (KB / 2)
typedef struct { float l[PLAIN_LANES]; } vf;
typedef struct { uint16_t h[KB]; } vi;
static inline vi load_w(const uint16_t* p) {
  vi w;
  memcpy(w.h, p, sizeof w.h);
  return w;
}
static inline vf even_half(vi w) { /* AVX2's 32-bit lane i holds weights 2i (low half) and 2i + 1 */
  vf v;
  for (int i = 0; i < PLAIN_LANES; i++) v.l[i] = bf16_to_f32(w.h[2 * i]);
  return v;
}
static inline vf odd_half(vi w) {
  vf v;
  for (int i = 0; i < PLAIN_LANES; i++) v.l[i] = bf16_to_f32(w.h[2 * i + 1]);
  return v;
}
static inline vf vzero(void) {
  vf v = {{0}};
  return v;
}
static inline vf vload(const float* p) {
  vf v;
  memcpy(v.l, p, sizeof v.l);
  return v;
}
static inline vf vfma(vf a, vf b, vf c) {
  for (int i = 0; i < PLAIN_LANES; i++) c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]);
  return c;
}
static inline float vsum(vf v) { /* AVX2's tree: halves added, then lanes 0 + 2 and 1 + 3, then those two */
  float s0 = v.l[0] + v.l[4], s1 = v.l[1] + v.l[5], s2 = v.l[2] + v.l[6], s3 = v.l[3] + v.l[7];
  return (s0 + s2) + (s1 + s3);
}
#endif

/* The input width must be a multiple of this (every build has a kernel). */
int specdec_block(void) { return KB; }

#define HALF (KB / 2)


/* acc[r][b] += weight row j0+b times activation row r0+r over elements [k0, k1); xp holds each KB-block of the
   activations as its even elements then its odd ones, in float32. */
static inline __attribute__((always_inline)) void chunk(const uint16_t* W, const float* xp, int in, int j0, int nj,
                                                        int r0, int nr, vf acc[RB][JB], int k0, int k1) {
  for (int k = k0; k < k1; k += KB)
    for (int b = 0; b < nj; b++) {
      const uint16_t* w_at = W + (size_t)(j0 + b) * in + k;
      __builtin_prefetch((const char*)w_at + PREFETCH, 0, 3);
      vi w = load_w(w_at);
      vf even = even_half(w), odd = odd_half(w);
      for (int r = 0; r < nr; r++) {
        const float* x_at = xp + (size_t)(r0 + r) * in + k;
        acc[r][b] = vfma(even, vload(x_at), acc[r][b]);
        acc[r][b] = vfma(odd, vload(x_at + HALF), acc[r][b]);
      }
    }
}

/* ---- bfloat16 activations on AMX (Intel's tile unit: Sapphire Rapids and later) ----
   The same y = x W^T (+ b) with bfloat16 x, on the tile unit: W's rows are read as they lie in memory (A tiles of
   16 weight rows x 32 inputs), the activations packed as B tiles (16 pairs of inputs x up to 16 rows, as many as
   the pass has), and a block of AMX_M weight rows is multiplied by every row at once. The unit does 8192
   multiply-adds an instruction, so sixteen rows cost what one does: the weights' reading alone (past sixteen, a
   second set of B tiles doubles the products). Width
   invariance: an output is one chain of tile products over its inputs in order, AMX_K at a time, whichever rows
   share the B tile; a row's column never meets another's. Used where the CPU has AMX and Linux lets this process
   use it (`specdec_amx`); the bits differ from the vector kernel's above, so a machine uses one or the other. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_M 32 /* weight rows a block: two A tiles */
#define AMX_K 32 /* inputs a tile step: 64 bytes of each weight row */
/* A's lines are prefetched into L1 this many steps ahead. Tile registers are not renamed: a step's A loads wait for
   the step before's products, and its products for the loads, so a load from L1 keeps that chain short
   (docs/results.md, eighteenth round, "Wide passes"). */
#define AMX_AHEAD 2

static int amx_state = -1; /* -1: not asked yet; 0: no; 1: the kernel's permission granted */

/* Tiles 4, 5: A (16 weight rows x 32 inputs); 6, 7: B for activation rows 0-15 and 16-31 (16 input pairs x n0, n1
   rows); 0, 1 and 2, 3: C for them (16 weight rows x n0, n1 rows). A B tile is as wide as its rows: a pass of one row
   packs 64 bytes a step, not a tile of zeros. */
static void amx_configure(int n0, int n1) {
  struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) config.rows[t] = 16;
  config.colsb[4] = config.colsb[5] = 64;
  config.colsb[0] = config.colsb[1] = config.colsb[6] = (uint16_t)(4 * n0);
  config.colsb[2] = config.colsb[3] = config.colsb[7] = (uint16_t)(4 * (n1 ? n1 : 1));
  _tile_loadconfig(&config);
}

/* 16 float32 -> bfloat16, rounded as f32_to_bf16 rounds: bf16_round8 on each half. */
static inline __m256i bf16_round16(__m512 v) {
  __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_set_m128i(bf16_round8(high), bf16_round8(_mm512_castps512_ps256(v)));
}

/* y[r][j0 + m] = c[m][n] (+ bias[j0 + m]) for the tile's 16 weight rows (nj of them real) and 16 activation rows
   from r0 (nr real): one column of c (gathered) is one row of y. */
static inline void amx_write(const float c[16][16], const uint16_t* bias, void* y, int j0, int nj, int r0, int nr,
                             int out, int y_bf16) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  if (nj <= 0) return;
  __mmask16 real = nj >= 16 ? 0xffff : (__mmask16)((1u << nj) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(real, bias + j0)), 16));
  for (int n = 0; n < nr; n++) {
    __m512 v = _mm512_i32gather_ps(column, &c[0][n], 4);
    if (bias) v = _mm512_add_ps(v, b);
    size_t at = (size_t)(r0 + n) * out + j0;
    if (y_bf16) _mm256_mask_storeu_epi16((uint16_t*)y + at, real, bf16_round16(v));
    else _mm512_mask_storeu_ps((float*)y + at, real, v);
  }
}

static int gemm_amx(const uint16_t* W, const uint16_t* x, const uint16_t* bias, void* y, int rows, int out, int in,
                    int y_bf16, int threads) {
  int steps = in / AMX_K, sets = rows > 16 ? 2 : 1; /* B tiles a step: one per 16 rows */
  int n0 = rows < 16 ? rows : 16, n1 = rows - n0; /* the activation rows each B tile holds */
  size_t step_values = (size_t)16 * rows; /* 32-bit values a step's B tiles hold */
  uint32_t* packed = (uint32_t*)aligned_alloc(64, ((size_t)steps * step_values * 4 + 63) / 64 * 64);
  if (!packed) return SPECDEC_NO_MEMORY;
  int blocks = (out + AMX_M - 1) / AMX_M, failed = 0;
#pragma omp parallel num_threads(threads)
  {
    /* B tile (step s, set): its row p holds input pair p of the step (two bfloat16 as one 32-bit value) for each
       of 16 activation rows, zero past the pass's rows: a gather from 16 rows of x */
    const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(in / 2));
#pragma omp for schedule(static)
    for (int tile = 0; tile < steps * sets; tile++) {
      int s = tile / sets, r0 = 16 * (tile % sets), nr = rows - r0 < 16 ? rows - r0 : 16;
      __mmask16 real = (__mmask16)((1u << nr) - 1);
      const uint32_t* from = (const uint32_t*)x + (size_t)r0 * (in / 2) + (size_t)s * (AMX_K / 2);
      uint32_t* to = packed + (size_t)s * step_values + (size_t)16 * r0; /* set 1 follows set 0's 16 x n0 values */
      for (int p = 0; p < 16; p++)
        _mm512_mask_storeu_epi32((void*)(to + (size_t)nr * p), real,
                                 _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, stride, from + p, 4));
    }
    amx_configure(n0, n1);
    float c[16][16] __attribute__((aligned(64)));
    uint16_t* tail = NULL; /* the last block's weight rows padded with zero rows, where out % AMX_M != 0 */
#pragma omp for schedule(static)
    for (int jb = 0; jb < blocks; jb++) {
      int j0 = jb * AMX_M, nj = out - j0 < AMX_M ? out - j0 : AMX_M;
      const uint16_t* A = W + (size_t)j0 * in;
      if (nj < AMX_M) {
        tail = (uint16_t*)calloc((size_t)AMX_M * in, sizeof(uint16_t));
        if (!tail) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        memcpy(tail, A, (size_t)nj * in * sizeof(uint16_t));
        A = tail;
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int s = 0; s < steps; s++) {
        const uint16_t* a = A + (size_t)s * AMX_K;
        const uint32_t* b = packed + (size_t)s * step_values;
        if (s + AMX_AHEAD < steps)
          for (int m = 0; m < AMX_M; m++) _mm_prefetch((const char*)(a + (size_t)m * in + AMX_AHEAD * AMX_K), _MM_HINT_T0);
        _tile_loadd(4, a, in * 2);
        _tile_loadd(5, a + (size_t)16 * in, in * 2);
        _tile_loadd(6, b, 4 * n0);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (sets == 2) {
          _tile_loadd(7, b + 16 * n0, 4 * n1);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      /* tile t: weight rows j0 + 16 (t % 2) on, activation rows 16 (t / 2) on */
      _tile_stored(0, c, 64);
      amx_write(c, bias, y, j0, nj, 0, rows < 16 ? rows : 16, out, y_bf16);
      _tile_stored(1, c, 64);
      amx_write(c, bias, y, j0 + 16, nj - 16, 0, rows < 16 ? rows : 16, out, y_bf16);
      if (sets == 2) {
        _tile_stored(2, c, 64);
        amx_write(c, bias, y, j0, nj, 16, rows - 16, out, y_bf16);
        _tile_stored(3, c, 64);
        amx_write(c, bias, y, j0 + 16, nj - 16, 16, rows - 16, out, y_bf16);
      }
    }
    free(tail);
    _tile_release();
  }
  free(packed);
  return failed ? SPECDEC_NO_MEMORY : SPECDEC_OK;
}
#endif

/* 1 where bfloat16 activations take the tile unit (built for it, and Linux granted this process its state), else 0. */
int specdec_amx(void) {
#ifdef AMX
  if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return amx_state;
#else
  return 0;
#endif
}

/* x_bf16, y_bf16: 1 where x (and the bias), y are bfloat16, 0 where float32; bias: NULL or `out` values.
   Returns SPECDEC_OK; SPECDEC_BAD_SHAPE where rows is not 1..MAX_ROWS, in not a positive multiple of KB or out
   negative; SPECDEC_NO_MEMORY. */
int specdec_gemm(const uint16_t* W, const void* x, const void* bias, void* y, int rows, int out, int in,
                 int x_bf16, int y_bf16, int threads) {
  if (rows < 1 || rows > MAX_ROWS || in < 1 || in % KB || out < 0) return SPECDEC_BAD_SHAPE;
  if (out == 0) return SPECDEC_OK;
  (void)threads; /* read by the OpenMP pragmas only: unused without -fopenmp */
#ifdef AMX
  if (x_bf16 && specdec_amx() == 1 && in % AMX_K == 0)
    return gemm_amx(W, (const uint16_t*)x, (const uint16_t*)bias, y, rows, out, in, y_bf16, threads);
#endif
  float* xp = (float*)malloc((size_t)rows * in * sizeof(float));
  if (!xp) return SPECDEC_NO_MEMORY;
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < in; k += KB)
      for (int i = 0; i < KB; i++) {
        size_t from = (size_t)r * in + k + i;
        float v = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[from]) : ((const float*)x)[from];
        xp[(size_t)r * in + k + (i & 1) * HALF + i / 2] = v;
      }
  int blocks = (out + JB - 1) / JB, groups = (rows + RB - 1) / RB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int jb = 0; jb < blocks; jb++) {
    int j0 = jb * JB, nj = out - j0 < JB ? out - j0 : JB;
    vf acc[(MAX_ROWS + RB - 1) / RB][RB][JB];
    for (int g = 0; g < groups; g++)
      for (int r = 0; r < RB; r++)
        for (int b = 0; b < JB; b++) acc[g][r][b] = vzero();
    for (int k0 = 0; k0 < in; k0 += KC) {
      int k1 = k0 + KC < in ? k0 + KC : in;
      for (int g = 0; g < groups; g++) {
        int r0 = g * RB, nr = rows - r0 < RB ? rows - r0 : RB;
        if (nj == JB && nr == RB) chunk(W, xp, in, j0, JB, r0, RB, acc[g], k0, k1); /* unrolled: the common case */
        else chunk(W, xp, in, j0, nj, r0, nr, acc[g], k0, k1);
      }
    }
    for (int r = 0; r < rows; r++)
      for (int b = 0; b < nj; b++) {
        float v = vsum(acc[r / RB][r % RB][b]);
        if (bias) v += x_bf16 ? bf16_to_f32(((const uint16_t*)bias)[j0 + b]) : ((const float*)bias)[j0 + b];
        size_t at = (size_t)r * out + j0 + b;
        if (y_bf16) ((uint16_t*)y)[at] = f32_to_bf16(v);
        else ((float*)y)[at] = v;
      }
  }
  free(xp);
  return SPECDEC_OK;
}

/* ---- 4-bit weights (llama.cpp's Q4_1 x Q8_1 numbers, laid out for 16 weight rows at once) ----
   y = x W^T (+ b) for W in blocks of 32 input columns, w = d * q + m with q in 0..15, d and m float16. Each row of x
   is quantized per block to int8 (scale max|x| / 127), so a block's products are one integer dot product (exact),
   scaled once: sum_k w_k x_k = d dx sum_k q_k qx_k + m dx sum_k qx_k.

   Layout: weight rows in groups of Q4_ROWS (16), the last one padded with zero rows. Group g, block b: 256 bytes,
   four 64-byte vectors; in vector v, bytes 4l..4l+3 belong to row 16g + l: byte i holds its input 32b + 8v + i in
   the low nibble and 32b + 8v + 4 + i in the high one. Then d and m: (groups, blocks / per, 2, 16) float16, the
   group's 16 scales of blocks per b..per b + per - 1, then its 16 minimums: a scale serves one block (quantization
   groups of 32 inputs, 5 bits a weight) or two (groups of 64, 4.5 bits). So one integer dot-product instruction
   (VNNI's vpdpbusd, four bytes of the activations broadcast) advances sixteen rows at once, each row in its own
   lane: no horizontal sums, block scales loaded as vectors, under half the instructions of a row-at-a-time kernel,
   and the weights read as one stream, prefetched Q4_AHEAD blocks ahead into L2 (docs/results.md, twelfth and
   thirteenth rounds).

   Per output one order whatever the number of rows or threads (width-invariant): its lane's integer sums (exact),
   then float32 steps in block order. AVX-512 VNNI takes a group as one 512-bit register; AVX2 (with AVX-VNNI where
   there is one, else maddubs) as two 256-bit halves doing the same steps per lane: the same bits on either. */
#define Q4_BLOCK 32
#define Q4_ROWS 16
#define Q4_GROUP_BYTES (Q4_ROWS * Q4_BLOCK / 2) /* one block of a group */
#define Q4_X 4 /* activation rows a group's pass serves (the weights then come from L1 for the next four) */
#define Q4_AHEAD 16 /* blocks prefetched ahead: 4 KB of weights (docs/results.md, twelfth round) */

/* Into L2 (prefetcht1, locality 2): a prefetch into L1 holds one of its few fill buffers until the line comes. */
static inline void q4_prefetch(const uint8_t* w, const uint16_t* dm) {
  for (int line = 0; line < Q4_GROUP_BYTES; line += 64) __builtin_prefetch(w + Q4_AHEAD * Q4_GROUP_BYTES + line, 0, 2);
  __builtin_prefetch(dm + Q4_AHEAD * 2 * Q4_ROWS, 0, 2);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define Q4_512 1
#endif

/* q[i] = v[i] * inverse rounded to the nearest integer (ties to even, as lrintf), clamped to [-127, 127], for one
   block of Q4_BLOCK (32) values -> the sum of the q. */
static inline int quantize_block(const float* v, float inverse, int8_t* q) {
  const __m256 scale = _mm256_set1_ps(inverse);
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  __m256i part[4], sum = _mm256_setzero_si256();
  for (int k = 0; k < 4; k++) {
    part[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), scale));
    part[k] = _mm256_max_epi32(_mm256_min_epi32(part[k], top), bottom);
    sum = _mm256_add_epi32(sum, part[k]);
  }
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(part[0], part[1]), _mm256_packs_epi32(part[2], part[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* back to element order */
  _mm256_storeu_si256((__m256i*)q, bytes);
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
  return _mm_cvtsi128_si32(half);
}

#ifdef Q4_512
/* out[r][l] = row 16g + l of W times activation row r (nr <= Q4_X of them), before the bias. */
static inline void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
                            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  __m512 acc[Q4_X], accm[Q4_X];
  for (int r = 0; r < Q4_X; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b / per) * 2 * Q4_ROWS; /* a scale and a minimum serve `per` blocks */
    q4_prefetch(w, dm);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)dm));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + Q4_ROWS)));
    __m512i q[8]; /* q[2v]: inputs 8v..8v+3 of each row, q[2v + 1]: 8v+4..8v+7 */
    for (int v = 0; v < 4; v++) {
      __m512i bytes = _mm512_loadu_si512((const void*)(w + 64 * v));
      q[2 * v] = _mm512_and_si512(bytes, low);
      q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    }
    for (int r = 0; r < nr; r++) {
      const int32_t* x4 = (const int32_t*)(qx + (size_t)r * in + (size_t)b * Q4_BLOCK); /* four inputs each */
      __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512(); /* two chains: integer sums, exact */
      for (int u = 0; u < 4; u++) {
        s = _mm512_dpbusd_epi32(s, q[u], _mm512_set1_epi32(x4[u]));
        t = _mm512_dpbusd_epi32(t, q[u + 4], _mm512_set1_epi32(x4[u + 4]));
      }
      __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(size_t)r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s, t)), scale, acc[r]);
      accm[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)r * blocks + b]), accm[r]);
    }
  }
  for (int r = 0; r < nr; r++) _mm512_storeu_ps(out[r], _mm512_add_ps(acc[r], accm[r]));
}
#else
static inline __m256i q4_dot(__m256i sum, __m256i w, __m256i x) { /* sum + 8 int32 lanes, each of 4 products */
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sum, w, x);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))); /* 2 * 15 * 127 fits 16 bits */
#endif
}

/* The same as the AVX-512 one, lanes 0..7 and 8..15 as two halves (each vector's first and last 32 bytes). */
static inline void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
                            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  __m256 acc[Q4_X][2], accm[Q4_X][2];
  for (int r = 0; r < Q4_X; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b / per) * 2 * Q4_ROWS; /* a scale and a minimum serve `per` blocks */
    q4_prefetch(w, dm);
    for (int h = 0; h < 2; h++) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + 8 * h)));
      __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + Q4_ROWS + 8 * h)));
      __m256i q[8];
      for (int v = 0; v < 4; v++) {
        __m256i bytes = _mm256_loadu_si256((const __m256i*)(w + 64 * v + 32 * h));
        q[2 * v] = _mm256_and_si256(bytes, low);
        q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      }
      for (int r = 0; r < nr; r++) {
        const int32_t* x4 = (const int32_t*)(qx + (size_t)r * in + (size_t)b * Q4_BLOCK);
        __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
        for (int u = 0; u < 4; u++) {
          s = q4_dot(s, q[u], _mm256_set1_epi32(x4[u]));
          t = q4_dot(t, q[u + 4], _mm256_set1_epi32(x4[u + 4]));
        }
        __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)r * blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s, t)), scale, acc[r][h]);
        accm[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(size_t)r * blocks + b]), accm[r][h]);
      }
    }
  }
  for (int r = 0; r < nr; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(acc[r][h], accm[r][h]));
}
#endif

/* Row l of a group's block (its four bytes of each of the block's four vectors: their low nibbles and high ones
   interleaved four by four are its 32 inputs in order), d * q + m (a product, then a sum) in float32, to w[at..]. */
static inline void dequantize_block(const uint8_t* block, const uint16_t* scales, int l, void* w, size_t at,
                                    int y_bf16) {
  const __m128i low = _mm_set1_epi8(0x0f);
  __m256 d = _mm256_set1_ps(_cvtsh_ss(scales[l])), m = _mm256_set1_ps(_cvtsh_ss(scales[Q4_ROWS + l]));
  uint32_t mine[4];
  for (int v = 0; v < 4; v++) memcpy(mine + v, block + 64 * v + 4 * l, 4);
  __m128i bytes = _mm_loadu_si128((const __m128i*)mine);
  __m128i lows = _mm_and_si128(bytes, low), highs = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
  __m128i q16[2] = {_mm_unpacklo_epi32(lows, highs), _mm_unpackhi_epi32(lows, highs)}; /* inputs 0-15, 16-31 */
  for (int e = 0; e < 4; e++) { /* eight inputs at a time */
    __m128i q8 = e % 2 ? _mm_srli_si128(q16[e / 2], 8) : q16[e / 2];
    __m256 value = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8))), m);
    if (y_bf16) _mm_storeu_si128((__m128i*)((uint16_t*)w + at + 8 * e), bf16_round8(value));
    else _mm256_storeu_ps((float*)w + at + 8 * e, value);
  }
}
#else /* plain C, any CPU: the same steps per lane as the vector kernels above, so the same bits */
/* As _mm256_cvtps_epi32 (round to nearest even; a NaN or a value out of int32's range gives INT32_MIN), clamped. */
static inline int quantize_block(const float* v, float inverse, int8_t* q) {
  int sum = 0;
  for (int i = 0; i < Q4_BLOCK; i++) {
    float t = v[i] * inverse;
    long n = fabsf(t) < 2147483648.0f ? lrintf(t) : -2147483647L - 1;
    n = n > 127 ? 127 : n < -127 ? -127 : n;
    q[i] = (int8_t)n;
    sum += (int)n;
  }
  return sum;
}

/* Row l's 32 weights of a block, in input order (see the layout above). */
static inline void unpack_row(const uint8_t* block, int l, uint8_t q[Q4_BLOCK]) {
  for (int v = 0; v < 4; v++)
    for (int i = 0; i < 4; i++) {
      uint8_t byte = block[64 * v + 4 * l + i];
      q[8 * v + i] = byte & 0x0f;
      q[8 * v + 4 + i] = byte >> 4;
    }
}

/* The AVX-512 kernel's steps, one lane (weight row l) at a time: an exact integer sum, then two fmaf chains. */
static inline void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
                            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  float acc[Q4_X][Q4_ROWS] = {{0}}, accm[Q4_X][Q4_ROWS] = {{0}};
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b / per) * 2 * Q4_ROWS; /* a scale and a minimum serve `per` blocks */
    q4_prefetch(w, dm);
    for (int l = 0; l < Q4_ROWS; l++) {
      uint8_t q[Q4_BLOCK];
      unpack_row(w, l, q);
      float d = f16_to_f32(dm[l]), m = f16_to_f32(dm[Q4_ROWS + l]);
      for (int r = 0; r < nr; r++) {
        const int8_t* x = qx + (size_t)r * in + (size_t)b * Q4_BLOCK;
        int32_t s = 0;
        for (int k = 0; k < Q4_BLOCK; k++) s += q[k] * x[k];
        acc[r][l] = fmaf((float)s, d * dx[(size_t)r * blocks + b], acc[r][l]);
        accm[r][l] = fmaf(m, sx[(size_t)r * blocks + b], accm[r][l]);
      }
    }
  }
  for (int r = 0; r < nr; r++)
    for (int l = 0; l < Q4_ROWS; l++) out[r][l] = acc[r][l] + accm[r][l];
}

static inline void dequantize_block(const uint8_t* block, const uint16_t* scales, int l, void* w, size_t at,
                                    int y_bf16) {
  float d = f16_to_f32(scales[l]), m = f16_to_f32(scales[Q4_ROWS + l]);
  uint8_t q[Q4_BLOCK];
  unpack_row(block, l, q);
  for (int k = 0; k < Q4_BLOCK; k++) {
    float product = d * (float)q[k], value = product + m; /* two roundings, as the vector kernel's (no fusing) */
    if (y_bf16) ((uint16_t*)w)[at + k] = f32_to_bf16(value);
    else ((float*)w)[at + k] = value;
  }
}
#endif

/* The input width must be a multiple of this (every build has a kernel). */
int specdec_q4_block(void) { return Q4_BLOCK; }

/* The (out, in) weight the 4-bit layout holds, d * q + m (a product, then a sum) in float32, stored in bfloat16
   (y_bf16) or float32: for a prompt's pass over more rows than MAX_ROWS, which then multiplies by it with torch's
   GEMM. */
int specdec_dequantize_q4(const uint8_t* Wq, const uint16_t* dm, void* w, int out, int in, int group, int y_bf16,
                          int threads) {
  if (group != Q4_BLOCK && group != 2 * Q4_BLOCK) return SPECDEC_UNSUPPORTED;
  if (out < 0 || in < 1 || in % group) return SPECDEC_BAD_SHAPE;
  int blocks = in / Q4_BLOCK, per = group / Q4_BLOCK;
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int j = 0; j < out; j++) {
    int g = j / Q4_ROWS, l = j % Q4_ROWS;
    for (int b = 0; b < blocks; b++) {
      const uint8_t* block = Wq + ((size_t)g * blocks + b) * Q4_GROUP_BYTES;
      const uint16_t* scales = dm + ((size_t)g * (blocks / per) + b / per) * 2 * Q4_ROWS;
      dequantize_block(block, scales, l, w, (size_t)j * in + (size_t)b * Q4_BLOCK, y_bf16);
    }
  }
  return SPECDEC_OK;
}

/* Each row of x quantized per block of Q4_BLOCK: qx (rows, in) int8, dx (rows, blocks) its scale max|x| / 127 and
   sx (rows, blocks) dx times the block's sum of qx. */
static void quantize_rows(const void* x, int8_t* qx, float* dx, float* sx, int rows, int in, int x_bf16) {
  int blocks = in / Q4_BLOCK;
  for (int r = 0; r < rows; r++)
    for (int b = 0; b < blocks; b++) {
      float v[Q4_BLOCK], amax = 0.0f;
      for (int i = 0; i < Q4_BLOCK; i++) {
        size_t from = (size_t)r * in + (size_t)b * Q4_BLOCK + i;
        v[i] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[from]) : ((const float*)x)[from];
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
      }
      float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
      int sum = quantize_block(v, inverse, qx + (size_t)r * in + (size_t)b * Q4_BLOCK);
      dx[(size_t)r * blocks + b] = d;
      sx[(size_t)r * blocks + b] = d * (float)sum;
    }
}

/* y = x W^T (+ bias) for the 4-bit W (out rows in the layout above) and rows 1..MAX_ROWS of x: SPECDEC_OK;
   SPECDEC_UNSUPPORTED for a group other than 32 or 64; SPECDEC_BAD_SHAPE; SPECDEC_NO_MEMORY. */
int specdec_gemm_q4(const uint8_t* Wq, const uint16_t* dm, const void* x, const void* bias, void* y, int rows, int out,
                    int in, int group, int x_bf16, int y_bf16, int threads) {
  if (group != Q4_BLOCK && group != 2 * Q4_BLOCK) return SPECDEC_UNSUPPORTED;
  if (rows < 1 || rows > MAX_ROWS || out < 0 || in < 1 || in % group) return SPECDEC_BAD_SHAPE;
  int blocks = in / Q4_BLOCK, groups = (out + Q4_ROWS - 1) / Q4_ROWS, per = group / Q4_BLOCK;
  (void)threads;
  int8_t* qx = (int8_t*)aligned_alloc(64, ((size_t)rows * in + 63) / 64 * 64);
  float* dx = (float*)malloc((size_t)rows * blocks * sizeof(float));
  float* sx = (float*)malloc((size_t)rows * blocks * sizeof(float));
  if (!qx || !dx || !sx) {
    free(qx), free(dx), free(sx);
    return SPECDEC_NO_MEMORY;
  }
  quantize_rows(x, qx, dx, sx, rows, in, x_bf16);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int g = 0; g < groups; g++) {
    float o[Q4_X][Q4_ROWS] __attribute__((aligned(64)));
    int real = out - g * Q4_ROWS < Q4_ROWS ? out - g * Q4_ROWS : Q4_ROWS;
    for (int r0 = 0; r0 < rows; r0 += Q4_X) { /* after the first four rows, the group's weights come from L1 */
      int nr = rows - r0 < Q4_X ? rows - r0 : Q4_X;
      q4_group(Wq + (size_t)g * blocks * Q4_GROUP_BYTES, dm + (size_t)g * (blocks / per) * 2 * Q4_ROWS,
               qx + (size_t)r0 * in, dx + (size_t)r0 * blocks, sx + (size_t)r0 * blocks, blocks, per, in, nr, o);
      for (int r = 0; r < nr; r++)
        for (int l = 0; l < real; l++) {
          int j = g * Q4_ROWS + l;
          float v = o[r][l];
          if (bias) v += x_bf16 ? bf16_to_f32(((const uint16_t*)bias)[j]) : ((const float*)bias)[j];
          size_t at = (size_t)(r0 + r) * out + j;
          if (y_bf16) ((uint16_t*)y)[at] = f32_to_bf16(v);
          else ((float*)y)[at] = v;
        }
    }
  }
  free(qx), free(dx), free(sx);
  return SPECDEC_OK;
}
