/* Included after simd.h by attention.c and gated.c, as the last of their headers: from here to the end of the
   including file, products and sums are fused where they can be. That is a fixed choice of the build (which pairs
   the compiler fuses is its own, so these bits are a build's, not torch's). clang: within an expression (`on`),
   decided as it parses, so every inlined copy of a sum fuses alike; its `fast` is left to the back end's blocks, and
   at -O1/-O2 fused a query's products differently as a pair's first and second member (a query's bits then depended
   on its neighbours: tests/native/test_kernels.c). gcc fuses across statements, the same everywhere. The norms and
   the rotary step (norm.c, rope.c) stay unfused (-ffp-contract=off), rounded as torch's eager steps are.

   Then the helpers both files take under that rule: `hsum`, a vector's fixed-tree sum, and `vexp`. */
#ifndef SPECDEC_FUSED_H
#define SPECDEC_FUSED_H
#include "simd.h"

#if defined(__clang__)
#pragma clang fp contract(on)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif

/* A lane permutation of two vectors (the second's lanes numbered from LANES on): gcc takes the indices as a vector,
   clang as constants. */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

static inline float hsum(vec v) { /* a fixed tree: lane i plus lane i + 8, then + 4, + 2, + 1 */
  v = v + SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

/* vexp's numbers: Cephes' expf (cephes/single/expf.c) as published, not tuned here; changing any changes the bits
   of softmax, silu and gelu. */
#define EXP_FLOOR (-87.0f)             /* x clamped here: e^-87 is near float32's smallest normal */
#define EXP_LOG2E 1.44269504088896341f /* log2(e): x = n ln 2 + r, n = round(x log2 e) */
#define EXP_LN2_HIGH 0.693359375f      /* ln 2 in two parts (Cody and Waite): the high one exact in 9 bits, */
#define EXP_LN2_LOW (-2.12194440e-4f)  /* the low one the rest, so r = x - n ln 2 loses nothing */
#define EXP_P0 1.9875691500e-4f        /* e^r ~ 1 + r + r^2 (P5 + r (P4 + ... + r P0)) on |r| <= ln 2 / 2 */
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define EXP_BIAS 127                   /* float32's exponent bias: 2^n's bits are (n + 127) << 23 */

static inline vec vexp(vec x) { /* e^x for x <= 0 (Cephes' expf: a degree-5 polynomial on a reduced argument) */
  x = vselect(x < EXP_FLOOR, (vec){0} + EXP_FLOOR, x);
  ivec n = __builtin_convertvector(x * EXP_LOG2E - 0.5f, ivec); /* round to nearest: x <= 0 */
  vec k = __builtin_convertvector(n, vec);
  vec r = x - k * EXP_LN2_HIGH;
  r = r - k * EXP_LN2_LOW;
  vec p = (vec){0} + EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  p = p * (r * r) + r + 1.0f;
  return p * bits_vec((uvec)((n + EXP_BIAS) << 23));
}
#endif
