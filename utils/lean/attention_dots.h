/* Attention's dot products and weighted sums (attention.c), each in one fixed order over the keys: included after
   fused.h, so products and sums fuse as the build fuses them (see there). Keys and values are read from the buffer as
   they are (bfloat16 widened in registers, or float32): each function comes in both, `_bf16` and `_f32`.

   The sweeps run on the machine's own vector, NATIVE float32 lanes (one AVX-512, AVX or 128-bit register), not on
   `vec`: a 64-byte `vec` is two AVX registers, and gcc keeps arrays of them in memory (what that cost the AVX2 build:
   docs/results.md, twenty-fourth round). A sum's LANES lanes are LANES / NATIVE parts, each lane summed alone in the
   same order as in `vec`, so the bits are the same in every build. */
#ifndef SPECDEC_ATTENTION_DOTS_H
#define SPECDEC_ATTENTION_DOTS_H
#include "fused.h"
#include "bf16_x86.h"

#if defined(__AVX512F__)
#define NATIVE 16
#elif defined(__AVX__)
#define NATIVE 8
#else
#define NATIVE 4
#endif
#define PARTS (LANES / NATIVE)
typedef float nvec __attribute__((vector_size(NATIVE * sizeof(float))));
typedef uint32_t nuvec __attribute__((vector_size(NATIVE * sizeof(uint32_t))));
typedef uint16_t nhvec __attribute__((vector_size(NATIVE * sizeof(uint16_t))));

/* The (query, head) pairs a sweep over the keys serves, and the native vectors of each head's output a sweep over the
   values covers: PAIRS x 4 accumulators in either, what the registers hold (32 with AVX-512, 16 with AVX). A register
   count, not a measurement; neither changes a bit (each sum keeps its order). */
#ifndef PAIRS
#if NATIVE == 16
#define PAIRS 6
#else
#define PAIRS 2
#endif
#endif
#define WEIGHTED_NV 4

/* Holds x in a register: the compiler would otherwise read a head's vector from memory again for each of its four
   products (a load an FMA: the loads then bound the sweep). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__) && (defined(__GNUC__) || defined(__clang__))
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) (void)(x)
#endif

static inline nvec nload(const float* p) {
  nvec v;
  memcpy(&v, p, sizeof(nvec));
  return v;
}

/* NATIVE elements of a buffer at element i, as float32 (a bfloat16's bits are a float32's upper half: exact); on x86
   by bf16_x86.h's widening load, where the instruction is the point. */
static inline nvec at_bf16(const void* buffer, int64_t i) {
  const uint16_t* p = (const uint16_t*)buffer + i;
#if NATIVE == 16 && defined(__AVX512F__)
  return (nvec)bf16_widen16(p);
#elif NATIVE == 8 && defined(__AVX2__)
  return (nvec)bf16_widen8(p);
#else
  nhvec h;
  memcpy(&h, p, sizeof(nhvec));
  return (nvec)(__builtin_convertvector(h, nuvec) << 16);
#endif
}
static inline nvec at_f32(const void* buffer, int64_t i) { return nload((const float*)buffer + i); }

/* x in every lane: one broadcast (gcc makes a lane-by-lane loop sixteen masked ones, and `(nvec){0} + x` an addition
   and a broadcast). */
static inline nvec splat(float x) {
  nvec v = {x};
#if defined(__clang__) && NATIVE == 16
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#elif defined(__clang__) && NATIVE == 8
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
#elif defined(__clang__)
  return __builtin_shufflevector(v, v, 0, 0, 0, 0);
#else
  typedef int32_t nivec __attribute__((vector_size(NATIVE * sizeof(int32_t))));
  return __builtin_shuffle(v, (nivec){0});
#endif
}
/* Part `part` (lanes part NATIVE ..) of the vec at v set to x. */
static inline void set_part(vec* v, int part, nvec x) { memcpy((float*)v + part * NATIVE, &x, sizeof(nvec)); }

/* P query heads (float32 rows of n at q) against the four keys at element `at` of the buffer k (rows of n): each dot
   product's LANES accumulators, head p's four at out[p stride .. p stride + 3], before their sums; each key read once
   for the P heads. Lane l of an accumulator sums the products at l, l + LANES, ... in order, part by part. */
#define LANES_X4(P, T)                                                                                             \
  static inline void lanes_##P##x4_##T(const float* q, const void* k, int64_t at, int n, vec* out, int stride) { \
    for (int part = 0; part < PARTS; part++) {                                                                   \
      nvec acc[4 * P];                                                                                           \
      for (int a = 0; a < 4 * P; a++) acc[a] = (nvec){0};                                                        \
      for (int i = part * NATIVE; i < n; i += LANES) {                                                           \
        nvec k0 = at_##T(k, at + i), k1 = at_##T(k, at + n + i), k2 = at_##T(k, at + 2 * n + i),                 \
             k3 = at_##T(k, at + 3 * n + i);                                                                     \
        for (int p = 0; p < P; p++) {                                                                            \
          nvec x = nload(q + (size_t)p * n + i);                                                                 \
          IN_REGISTER(x);                                                                                        \
          acc[4 * p] = acc[4 * p] + x * k0, acc[4 * p + 1] = acc[4 * p + 1] + x * k1;                            \
          acc[4 * p + 2] = acc[4 * p + 2] + x * k2, acc[4 * p + 3] = acc[4 * p + 3] + x * k3;                    \
        }                                                                                                        \
      }                                                                                                          \
      for (int p = 0; p < P; p++)                                                                                \
        for (int key = 0; key < 4; key++) set_part(out + p * stride + key, part, acc[4 * p + key]);              \
    }                                                                                                            \
  }

/* acc (P heads' outputs, rows of d; NV native vectors of each from acc's column) += p_h v_j over `keys` values from
   element `at` of the buffer v (rows of d), in key order (head h's numerators at ps + h * stride): the accumulators
   stay in registers for the whole block, each value vector read once for the P heads. */
#define WEIGHTED(P, NV, T)                                                                                   \
  static inline void weighted_##P##x##NV##_##T(float* acc, int d, const float* ps, size_t stride, const void* v, \
                                                int64_t at, int keys) {                                      \
    nvec x[P * NV];                                                                                          \
    for (int h = 0; h < P; h++)                                                                              \
      for (int u = 0; u < NV; u++) x[h * NV + u] = nload(acc + (size_t)h * d + u * NATIVE);                  \
    for (int j = 0; j < keys; j++) {                                                                         \
      nvec w[NV];                                                                                            \
      for (int u = 0; u < NV; u++) w[u] = at_##T(v, at + (int64_t)j * d + u * NATIVE);                       \
      for (int h = 0; h < P; h++) {                                                                          \
        nvec p = splat(ps[h * stride + j]);                                                                  \
        for (int u = 0; u < NV; u++) x[h * NV + u] = x[h * NV + u] + p * w[u];                               \
      }                                                                                                      \
    }                                                                                                        \
    for (int h = 0; h < P; h++)                                                                              \
      for (int u = 0; u < NV; u++) memcpy(acc + (size_t)h * d + u * NATIVE, &x[h * NV + u], sizeof(nvec));   \
  }

/* One head's score against one key (its LANES accumulators, then hsum: the bits of lanes_Px4 and hsum). */
#define KEY_DOT(T)                                                                  \
  static inline float key_dot_##T(const float* a, const void* k, int64_t at, int n) { \
    vec sum;                                                                        \
    for (int part = 0; part < PARTS; part++) {                                      \
      nvec acc = {0};                                                               \
      for (int i = part * NATIVE; i < n; i += LANES) acc = acc + nload(a + i) * at_##T(k, at + i); \
      set_part(&sum, part, acc);                                                    \
    }                                                                               \
    return hsum(sum);                                                               \
  }

/* Every function above for one element type T, and the dispatch on the heads' count (1..PAIRS). */
#if PAIRS == 6
#define KERNELS(T)                                                                                                 \
  LANES_X4(1, T) LANES_X4(2, T) LANES_X4(3, T) LANES_X4(4, T) LANES_X4(5, T) LANES_X4(6, T)                         \
  WEIGHTED(1, 4, T) WEIGHTED(2, 4, T) WEIGHTED(3, 4, T) WEIGHTED(4, 4, T) WEIGHTED(5, 4, T) WEIGHTED(6, 4, T)       \
  WEIGHTED(1, 1, T) KEY_DOT(T)                                                                                     \
  static inline void lanes_x4_##T(int count, const float* q, const void* k, int64_t at, int n, vec* out, int stride) { \
    switch (count) {                                                                                               \
      case 1: lanes_1x4_##T(q, k, at, n, out, stride); break;                                                      \
      case 2: lanes_2x4_##T(q, k, at, n, out, stride); break;                                                      \
      case 3: lanes_3x4_##T(q, k, at, n, out, stride); break;                                                      \
      case 4: lanes_4x4_##T(q, k, at, n, out, stride); break;                                                      \
      case 5: lanes_5x4_##T(q, k, at, n, out, stride); break;                                                      \
      default: lanes_6x4_##T(q, k, at, n, out, stride); break;                                                     \
    }                                                                                                              \
  }                                                                                                                \
  static inline void weighted_x_##T(int count, float* acc, int d, const float* ps, size_t stride, const void* v,    \
                                    int64_t at, int keys) {                                                        \
    switch (count) {                                                                                               \
      case 1: weighted_1x4_##T(acc, d, ps, stride, v, at, keys); break;                                            \
      case 2: weighted_2x4_##T(acc, d, ps, stride, v, at, keys); break;                                            \
      case 3: weighted_3x4_##T(acc, d, ps, stride, v, at, keys); break;                                            \
      case 4: weighted_4x4_##T(acc, d, ps, stride, v, at, keys); break;                                            \
      case 5: weighted_5x4_##T(acc, d, ps, stride, v, at, keys); break;                                            \
      default: weighted_6x4_##T(acc, d, ps, stride, v, at, keys); break;                                           \
    }                                                                                                              \
  }
#elif PAIRS == 2
#define KERNELS(T)                                                                                                 \
  LANES_X4(1, T) LANES_X4(2, T) WEIGHTED(1, 4, T) WEIGHTED(2, 4, T) WEIGHTED(1, 1, T) KEY_DOT(T)                   \
  static inline void lanes_x4_##T(int count, const float* q, const void* k, int64_t at, int n, vec* out, int stride) { \
    if (count == 1)                                                                                                \
      lanes_1x4_##T(q, k, at, n, out, stride);                                                                     \
    else                                                                                                           \
      lanes_2x4_##T(q, k, at, n, out, stride);                                                                     \
  }                                                                                                                \
  static inline void weighted_x_##T(int count, float* acc, int d, const float* ps, size_t stride, const void* v,    \
                                    int64_t at, int keys) {                                                        \
    if (count == 1)                                                                                                \
      weighted_1x4_##T(acc, d, ps, stride, v, at, keys);                                                           \
    else                                                                                                           \
      weighted_2x4_##T(acc, d, ps, stride, v, at, keys);                                                           \
  }
#else
#error "PAIRS is 6 or 2"
#endif
KERNELS(bf16)
KERNELS(f32)

/* The functions above for a buffer of bfloat16 (bf16 set) or float32. */
static inline void lanes_x4(int bf16, int count, const float* q, const void* k, int64_t at, int n, vec* out,
                            int stride) {
  if (bf16)
    lanes_x4_bf16(count, q, k, at, n, out, stride);
  else
    lanes_x4_f32(count, q, k, at, n, out, stride);
}
static inline void weighted_x(int bf16, int count, float* acc, int d, const float* ps, size_t stride, const void* v,
                              int64_t at, int keys) {
  if (bf16)
    weighted_x_bf16(count, acc, d, ps, stride, v, at, keys);
  else
    weighted_x_f32(count, acc, d, ps, stride, v, at, keys);
}
static inline void weighted_one(int bf16, float* acc, int d, const float* ps, const void* v, int64_t at, int keys) {
  if (bf16)
    weighted_1x1_bf16(acc, d, ps, 0, v, at, keys);
  else
    weighted_1x1_f32(acc, d, ps, 0, v, at, keys);
}
static inline float key_dot(int bf16, const float* a, const void* k, int64_t at, int n) {
  return bf16 ? key_dot_bf16(a, k, at, n) : key_dot_f32(a, k, at, n);
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

#endif
