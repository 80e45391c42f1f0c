/* float32 -> bfloat16 in x86 vectors, rounded as bf16.h's f32_to_bf16 rounds (to nearest even, a NaN stays a NaN):
   for the tile kernel's and the 4-bit dequantization's stores (gemm_amx.c, gemm_q4_x86.c). And bfloat16 -> float32
   (exact), one widening load and a shift, for attention's reads of the buffer (attention_dots.h): gcc 12 lowers the
   generic form (__builtin_convertvector of 16 lanes) to five instructions. */
#ifndef SPECDEC_BF16_X86_H
#define SPECDEC_BF16_X86_H
#if defined(__AVX2__)
#include <immintrin.h>

static inline __m128i bf16_round8(__m256 v) { /* 8 values */
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  __m256i packed = _mm256_packus_epi32(rounded, rounded); /* per 128-bit half: its four values twice */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

static inline __m256 bf16_widen8(const uint16_t* p) { /* 8 values */
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

#if defined(__AVX512F__)
static inline __m512 bf16_widen16(const uint16_t* p) { /* 16 values */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline __m256i bf16_round16(__m512 v) { /* 16 values: bf16_round8 on each half */
  __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_set_m128i(bf16_round8(high), bf16_round8(_mm512_castps512_ps256(v)));
}
#endif
#endif
#endif
