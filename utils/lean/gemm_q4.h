/* The 4-bit GEMM's layout, its numbers and its per-ISA kernels' interface (gemm_q4.c drives them).

   llama.cpp's Q4_1 x Q8_1 numbers, laid out for 16 weight rows at once: y = x W^T (+ b) for W in blocks of 32 input
   columns, w = d * q + m with q in 0..15, d and m float16. Each row of x is quantized per block to int8 (scale
   max|x| / 127), so a block's products are one integer dot product (exact), scaled once:
   sum_k w_k x_k = d dx sum_k q_k qx_k + m dx sum_k qx_k.

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
   then float32 steps in block order. The kernels, one set per ISA, chosen at compile time (the others' files
   compile to nothing):
     gemm_q4_avx512.c  q4_group: AVX-512 VNNI, a group as one 512-bit register
     gemm_q4_avx2.c    q4_group: AVX2 (with AVX-VNNI where there is one, else maddubs), two 256-bit halves doing
                       the same steps per lane: the same bits
     gemm_q4_x86.c     q4_quantize_block, q4_dequantize_row: AVX2 + F16C, for both x86 builds
     gemm_q4_plain.c   all three in plain C, any other CPU: the same steps per lane, so the same bits */
#ifndef SPECDEC_GEMM_Q4_H
#define SPECDEC_GEMM_Q4_H
#include <stddef.h>
#include <stdint.h>

#include "specdec.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_X86 1
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(Q4_AVX_VNNI_AS_EVEX) /* gemm_q4_avx2.c */
#define Q4_AVX512 1
#else
#define Q4_AVX2 1
#endif
#else
#define Q4_PLAIN 1
#endif

#define Q4_BLOCK 32 /* inputs a block: the layout's (and llama.cpp's), not a tuning choice */
#define Q4_ROWS 16  /* weight rows a group: one per float32 lane of a 512-bit register (the layout's) */
#define Q4_GROUP_BYTES (Q4_ROWS * Q4_BLOCK / 2) /* one block of a group */
/* Activation rows a group's pass serves (the weights then come from L1 for the next four). It does not change the
   bits. Against 6, 8 and 16 on a 2-vCPU Zen 4 (twenty-second round): the same at 1 and 4 rows, 0.93-1.14x at 8 to 32
   (the shift of a 5% noise), so kept: past 4 rows the kernel is bound by its integer dot products, not by reads. */
#ifndef Q4_X
#define Q4_X 4
#endif
/* Blocks prefetched ahead: 16 KB of weights, as the bfloat16 kernel's PREFETCH. Measured: 1 to 8 KB ahead
   (docs/results.md, twelfth round); into L2 rather than L1 5-8% faster (thirteenth round); 64 blocks against 16 on a
   2-vCPU Zen 4 the same where the VM read 25-30 GB/s, 1.18-1.32x at one row where it read faster (twenty-third round;
   the figures in "Figures behind the code's rules"). */
#ifndef Q4_AHEAD /* -DQ4_AHEAD=... builds another to time: it does not change the bits */
#define Q4_AHEAD 64
#endif

/* Into L2 (prefetcht1, locality 2): a prefetch into L1 holds one of its few fill buffers until the line comes. */
static inline void q4_prefetch(const uint8_t* w, const uint16_t* dm) {
  for (int line = 0; line < Q4_GROUP_BYTES; line += 64) __builtin_prefetch(w + Q4_AHEAD * Q4_GROUP_BYTES + line, 0, 2);
  __builtin_prefetch(dm + Q4_AHEAD * 2 * Q4_ROWS, 0, 2);
}

/* q[i] = v[i] * inverse rounded to the nearest integer (ties to even, as lrintf; a NaN or a value out of int32's
   range as _mm256_cvtps_epi32 gives it, INT32_MIN), clamped to [-127, 127], for one block of Q4_BLOCK values ->
   the sum of the q. */
SPECDEC_INTERNAL int q4_quantize_block(const float* v, float inverse, int8_t* q);

/* out[r][l] = row 16g + l of W times activation row r (nr <= Q4_X of them), before the bias: w the group's blocks,
   dm0 its scales and minimums, qx, dx, sx the activations' int8 values, scales and scaled sums (gemm_q4.c). */
SPECDEC_INTERNAL void q4_group(const uint8_t* w, const uint16_t* dm0, const int8_t* qx, const float* dx,
                               const float* sx, int blocks, int per, int in, int nr, float out[Q4_X][Q4_ROWS]);

/* Row l of a group (its blocks at `group`, their scales at `scales`), d * q + m (a product, then a sum) in float32,
   to w[at..at + blocks * Q4_BLOCK) in bfloat16 (y_bf16) or float32. */
SPECDEC_INTERNAL void q4_dequantize_row(const uint8_t* group, const uint16_t* scales, int l, int blocks, int per,
                                        void* w, size_t at, int y_bf16);
#endif
