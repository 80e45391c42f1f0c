/* y = x W^T (+ b) for bfloat16 weights W (out, in) and up to MAX_ROWS rows of x (rows, in); x, b and y in float32
   or bfloat16. Built for the CPU it runs on by `utils/lean/native.py` (cc -O3 -march=native -fopenmp).

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
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 32
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
#else
#define KB 0 /* no kernel for this CPU: specdec_block() says so and the caller keeps torch's products */
#endif

/* The input width must be a multiple of this (0: no kernel was built). */
int specdec_block(void) { return KB; }

#if KB
#define HALF (KB / 2)

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* a NaN stays a NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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
#endif

/* x_bf16, y_bf16: 1 where x (and the bias), y are bfloat16, 0 where float32; bias: NULL or `out` values.
   Returns 0, or -1 where no kernel was built, rows > MAX_ROWS, in % KB != 0 or memory ran out. */
int specdec_gemm(const uint16_t* W, const void* x, const void* bias, void* y, int rows, int out, int in,
                 int x_bf16, int y_bf16, int threads) {
#if KB
  if (rows < 1 || rows > MAX_ROWS || in % KB) return -1;
  float* xp = (float*)malloc((size_t)rows * in * sizeof(float));
  if (!xp) return -1;
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
  return 0;
#else
  (void)W, (void)x, (void)bias, (void)y, (void)rows, (void)out, (void)in, (void)x_bf16, (void)y_bf16, (void)threads;
  return -1;
#endif
}
