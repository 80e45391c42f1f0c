/* The 4-bit GEMM's group kernel on AVX-512 VNNI: a group's sixteen weight rows as one 512-bit register, one lane
   each (interface and layout: gemm_q4.h). */
#include "gemm_q4.h"

#ifdef Q4_AVX512
#include <immintrin.h>

/* out[r][l] = row 16g + l of W times activation row r (nr <= Q4_X of them), before the bias. */
void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  __m512 acc[Q4_X], accm[Q4_X];
  for (int r = 0; r < Q4_X; r++) acc[r] = accm[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b >> (per - 1)) * 2 * Q4_ROWS; /* a scale and a minimum serve per = 1 or 2 blocks */
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
#endif
