/* The bfloat16 GEMM's vector operations for each ISA (gemm.c's kernel is written once over them, as ggml-cpu's
   simd-mappings.h maps its vectors): AVX-512, AVX2 + FMA, or plain C on any other CPU (x86-64 without AVX2,
   aarch64, ...), chosen at compile time. The plain C one takes AVX2's steps lane for lane (8 float32 lanes, fmaf, its
   horizontal sum's tree), so it gives AVX2's bits.

     KB              bfloat16 weights a step: one vector load per weight row (the ISA's width, not a tuning choice;
                     the input width must be a multiple of it, and it fixes the sums' order: AVX-512's bits differ)
     JB              weight rows a thread's block takes with several activation rows (gemm.c: 4, AVX2's 5)
     RB              activation rows a chunk of weights serves at once (their accumulators held in registers). Not
                     measured: chosen with the kernel (ninth round, docs/results.md "A kernel of our own"), 4 where
                     AVX-512 has 32 vector registers, 2 where AVX2 has 16; it does not change the bits
     JB1             weight rows a thread's block takes when there is one activation row (a one-token pass): more
                     rows read side by side than gemm.c's JB, one accumulator each. Measured on a 2-vCPU Zen 4
                     against 4 on the same path, alternated: AVX-512 6 to 16 rows 1.00-1.10x, 8 kept; Haswell's 6
                     1.05-1.06x, 8 1.02x (twenty-third round, docs/results.md); plain C keeps 4, unmeasured. It does
                     not change the bits
     vf, vi          float32 vector, the weights' integer vector
     load_w          KB weights; even_half, odd_half their even and odd elements as float32 (a bfloat16 is a
                     float32's upper half: a shift or a mask)
     vzero, vload, vfma, vsum   zero, a load of float32, a fused multiply-add, the fixed-tree horizontal sum */
#ifndef SPECDEC_GEMM_BF16_ISA_H
#define SPECDEC_GEMM_BF16_ISA_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define KB 32 /* bfloat16 weights per step: one 64-byte load per weight row */
#ifndef RB /* overridable at compile time to time others (-DRB=...): it does not change the bits */
#define RB 4
#endif
#ifndef JB1
#define JB1 8
#endif
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
#include <immintrin.h>
#define KB 16 /* one 32-byte load per weight row */
#ifndef RB
#define RB 2
#endif
#ifndef JB /* gemm.c's JB (4 elsewhere): on a 2-vCPU Zen 3, 5 ran 1.13-1.28x as fast as 4 at 3 to 32 rows, 6 1.03-1.15x */
#define JB 5
#endif
#ifndef JB1
#define JB1 6
#endif
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
#define KB 16 /* AVX2's */
#define RB 2
#ifndef JB1
#define JB1 4
#endif
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
#endif
