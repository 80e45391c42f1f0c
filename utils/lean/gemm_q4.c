/* The 4-bit GEMM (specdec_gemm_q4) and its dequantization (specdec_dequantize_q4): the activations quantized to
   int8, then each group of sixteen weight rows by its ISA's kernel (layout, numbers and kernels: gemm_q4.h). */
#include <math.h>
#include <stdlib.h>

#include "bf16.h"
#include "gemm_q4.h"
#include "specdec.h"

#define MAX_ROWS SPECDEC_MAX_ROWS

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
    q4_dequantize_row(Wq + (size_t)g * blocks * Q4_GROUP_BYTES, dm + (size_t)g * (blocks / per) * 2 * Q4_ROWS, l,
                      blocks, per, w, (size_t)j * in, y_bf16);
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
      int sum = q4_quantize_block(v, inverse, qx + (size_t)r * in + (size_t)b * Q4_BLOCK);
      dx[(size_t)r * blocks + b] = d;
      sx[(size_t)r * blocks + b] = d * (float)sum;
    }
}

/* Rows r0..r0 + nr - 1 of group g's outputs (o, before the bias; `real` of its rows), plus the bias, to y. */
static void write_group(const float o[Q4_X][Q4_ROWS], const void* bias, void* y, int g, int real, int r0, int nr,
                        int out, int x_bf16, int y_bf16) {
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

/* y = x W^T (+ bias) for the 4-bit W (out rows in gemm_q4.h's layout) and rows 1..MAX_ROWS of x: SPECDEC_OK;
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
      write_group((const float(*)[Q4_ROWS])o, bias, y, g, real, r0, nr, out, x_bf16, y_bf16);
    }
  }
  free(qx), free(dx), free(sx);
  return SPECDEC_OK;
}
