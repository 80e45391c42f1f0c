/* Attention's dot products and weighted sums (attention.c), each in one fixed order over the keys: included after
   fused.h, so products and sums fuse as the build fuses them (see there). */
#ifndef SPECDEC_ATTENTION_DOTS_H
#define SPECDEC_ATTENTION_DOTS_H
#include "fused.h"

/* Two query heads a and b against four keys k0..k3 (float32 rows of n): each dot product's LANES accumulators, a's
   four at sa[0..3], b's at sb[0..3], before their sums. */
static inline void lanes_2x4(const float* a, const float* b, const float* k, int n, vec* sa, vec* sb) {
  vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
  for (int i = 0; i < n; i += LANES) {
    vec x = vload(a + i), y = vload(b + i), k0 = vload(k + i), k1 = vload(k + n + i), k2 = vload(k + 2 * n + i),
        k3 = vload(k + 3 * n + i);
    a0 = a0 + x * k0, a1 = a1 + x * k1, a2 = a2 + x * k2, a3 = a3 + x * k3;
    b0 = b0 + y * k0, b1 = b1 + y * k1, b2 = b2 + y * k2, b3 = b3 + y * k3;
  }
  sa[0] = a0, sa[1] = a1, sa[2] = a2, sa[3] = a3, sb[0] = b0, sb[1] = b1, sb[2] = b2, sb[3] = b3;
}

/* Their scores: out[0..3] for a, out[4..7] for b, each one dot product in the same order as every other (LANES
   accumulators, then hsum). */
static inline void dots_2x4(const float* a, const float* b, const float* k, int n, float* out) {
  vec sa[4], sb[4];
  lanes_2x4(a, b, k, n, sa, sb);
  for (int j = 0; j < 4; j++) out[j] = hsum(sa[j]), out[4 + j] = hsum(sb[j]);
}

/* hsum of sixteen vectors at once, each in hsum's own tree: out[k] = hsum(v[k]), four shuffled additions in all
   where sixteen hsums make four each (the input order below leaves key k in lane k). */
static inline vec hsum16(const vec* v) {
  static const int order[16] = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};
  vec a[8], b[4], c[2];
  for (int k = 0; k < 8; k++)
    a[k] = SHUFFLE(v[order[2 * k]], v[order[2 * k + 1]], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(v[order[2 * k]], v[order[2 * k + 1]], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; k++)
    b[k] = SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int k = 0; k < 2; k++)
    c[k] = SHUFFLE(b[2 * k], b[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(b[2 * k], b[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline float vdot(const float* a, const float* b, int n) {
  vec acc = {0};
  for (int i = 0; i < n; i += LANES) acc = acc + vload(a + i) * vload(b + i);
  return hsum(acc);
}

/* acc (2 heads' outputs, NV vectors each, at acc and acc + d) += p_a v_j, p_b v_j over the keys of a block, in key
   order: the accumulators stay in registers for the whole block. */
#define WEIGHTED(NV)                                                                                      \
  static inline void weighted_##NV(float* acc, int d, const float* pa, const float* pb, const float* v, \
                                   int keys, int two) {                                                 \
    vec x[NV], y[NV];                                                                                   \
    for (int u = 0; u < NV; u++) x[u] = vload(acc + u * LANES), y[u] = two ? vload(acc + d + u * LANES) : x[u]; \
    for (int j = 0; j < keys; j++) {                                                                    \
      vec p = (vec){0} + pa[j], o = (vec){0} + (two ? pb[j] : 0.0f);                                    \
      for (int u = 0; u < NV; u++) {                                                                    \
        vec w = vload(v + (size_t)j * d + u * LANES);                                                   \
        x[u] = x[u] + p * w;                                                                            \
        if (two) y[u] = y[u] + o * w;                                                                   \
      }                                                                                                 \
    }                                                                                                   \
    for (int u = 0; u < NV; u++) {                                                                      \
      vstore(acc + u * LANES, x[u]);                                                                    \
      if (two) vstore(acc + d + u * LANES, y[u]);                                                       \
    }                                                                                                   \
  }
WEIGHTED(8)
WEIGHTED(4)
WEIGHTED(1)
#endif
