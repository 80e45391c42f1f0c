/* The 4-bit GEMM's kernels in plain C, for any CPU without AVX2, FMA and F16C (x86-64's baseline, aarch64, ...):
   the same steps per lane as the vector kernels (gemm_q4_avx512.c, gemm_q4_avx2.c, gemm_q4_x86.c), so the same
   bits (interface and layout: gemm_q4.h). */
#include "gemm_q4.h"

#ifdef Q4_PLAIN
#include <math.h>

#include "bf16.h"

/* As _mm256_cvtps_epi32 (round to nearest even; a NaN or a value out of int32's range gives INT32_MIN), clamped. */
int q4_quantize_block(const float* v, float inverse, int8_t* q) {
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
void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx, const float* sx,
            int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]) {
  float acc[Q4_X][Q4_ROWS] = {{0}}, accm[Q4_X][Q4_ROWS] = {{0}};
  for (int b = 0; b < blocks; b++, w += Q4_GROUP_BYTES) {
    const uint16_t* dm = dm0 + (size_t)(b >> (per - 1)) * 2 * Q4_ROWS; /* a scale and a minimum serve per = 1 or 2 blocks */
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

void q4_dequantize_row(const uint8_t* group, const uint16_t* scales, int l, int blocks, int per, void* w, size_t at,
                       int y_bf16) {
  for (int b = 0; b < blocks; b++)
    dequantize_block(group + (size_t)b * Q4_GROUP_BYTES, scales + (size_t)(b / per) * 2 * Q4_ROWS, l, w,
                     at + (size_t)b * Q4_BLOCK, y_bf16);
}
#endif
