/* The 4-bit GEMM's activation quantization and weight dequantization on x86 with AVX2 and F16C, for both x86
   builds (AVX-512 VNNI's and AVX2's): the steps gemm_q4_plain.c takes, so the same bits. Interface: gemm_q4.h. */
#include "gemm_q4.h"

#ifdef Q4_X86
#include <immintrin.h>
#include <string.h>

#include "bf16_x86.h"

int q4_quantize_block(const float* v, float inverse, int8_t* q) {
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

void q4_dequantize_row(const uint8_t* group, const uint16_t* scales, int l, int blocks, int per, void* w, size_t at,
                       int y_bf16) {
  for (int b = 0; b < blocks; b++)
    dequantize_block(group + (size_t)b * Q4_GROUP_BYTES, scales + (size_t)(b / per) * 2 * Q4_ROWS, l, w,
                     at + (size_t)b * Q4_BLOCK, y_bf16);
}
#endif
