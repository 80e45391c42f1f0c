/* The 4-bit GEMM's group kernel on AVX2 (with AVX-VNNI's dot product where there is one, else maddubs): the
   AVX-512 kernel's steps (gemm_q4_avx512.c) on two 256-bit halves, so the same bits (interface and layout:
   gemm_q4.h). */
#include "gemm_q4.h"

#ifdef Q4_AVX2
#include <immintrin.h>

/* AVX-VNNI's dot product (vpdpbusd on 256 bits). Q4_AVX_VNNI_AS_EVEX, for the C kernels' tests only: the same
   instruction in its AVX-512 VL encoding, so that a CPU with AVX-512 VNNI and no AVX-VNNI (qemu 7.2 runs neither)
   takes these steps: tests/test_c_kernels.py's "gcc-avx-vnni-as-evex" build. */
#if defined(__AVXVNNI__)
#define Q4_DPBUSD _mm256_dpbusd_avx_epi32
#elif defined(Q4_AVX_VNNI_AS_EVEX) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4_DPBUSD _mm256_dpbusd_epi32
#endif

/* A row's eight broadcast quads of inputs x4 against a half's eight vectors of nibbles q: 8 int32 lanes, each the
   exact integer sum of its row's 32 products (the AVX-512 kernel's s + t). */
static inline __m256i q4_sums(const __m256i q[8], const int32_t* x4) {
#if defined(Q4_DPBUSD)
  __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
  for (int u = 0; u < 4; u++) {
    s = Q4_DPBUSD(s, q[u], _mm256_set1_epi32(x4[u]));
    t = Q4_DPBUSD(t, q[u + 4], _mm256_set1_epi32(x4[u + 4]));
  }
  return _mm256_add_epi32(s, t);
#else
  /* maddubs's pairs are at most 2 * 15 * 127 = 3810: eight of them summed in 16 bits reach 30480, no overflow, so
     one widening (madd by ones) a row rather than eight (twenty-fifth round) */
  __m256i p[8];
  for (int u = 0; u < 8; u++) p[u] = _mm256_maddubs_epi16(q[u], _mm256_set1_epi32(x4[u]));
  __m256i sum = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                 _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
}

/* The same as the AVX-512 one, lanes 0..7 and 8..15 as two halves (each vector's first and last 32 bytes). */
void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  __m256 acc[Q4_X][2], accm[Q4_X][2];
  for (int r = 0; r < Q4_X; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b >> (per - 1)) * 2 * Q4_ROWS; /* a scale and a minimum serve per = 1 or 2 blocks */
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
        __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)r * blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_sums(q, x4)), scale, acc[r][h]);
        accm[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(size_t)r * blocks + b]), accm[r][h]);
      }
    }
  }
  for (int r = 0; r < nr; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(acc[r][h], accm[r][h]));
}
#endif
