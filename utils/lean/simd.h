/* The layer operations' one SIMD dialect (norm.c, rope.c, attention.c, gated.c): GCC and clang vector extensions,
   LANES float32 lanes whatever the CPU (the compiler maps a vector onto its registers: one AVX-512 register, two
   AVX2 ones, four NEON ones), so every sum has the same lanes in the same order in every build. Intrinsics appear
   only in the GEMMs' per-ISA files (gemm_bf16_isa.h, gemm_amx.c, gemm_q4_*.c) and bf16_x86.h's conversions (used
   by them and by attention's reads), where the instruction (VNNI, AMX, F16C, a widening load) is the point.

   Bit casts: a cast between vector types of one size reinterprets the bits (GCC's and clang's rule), so `vec_bits`,
   `bits_vec` and `vselect` below are the one way a vector's bits are read here; memcpy remains only for unaligned
   loads and stores. */
#ifndef SPECDEC_SIMD_H
#define SPECDEC_SIMD_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* 64-byte vectors are passed between our static functions on CPUs without AVX-512 too (split by the compiler):
   their ABI is these files' own. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The fixed accumulators of every dot product and sum of squares; a norm's width and a head's size are multiples of
   it (native.py's LANES). Not a tuning constant: it fixes every sum's order, so changing it changes the bits. */
#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t)))); /* a comparison's mask: -1 or 0 a lane */
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline vec vload(const float* p) { /* unaligned */
  vec v;
  memcpy(&v, p, sizeof(vec));
  return v;
}

static inline void vstore(float* p, vec v) { memcpy(p, &v, sizeof(vec)); }

static inline hvec hload(const uint16_t* p) {
  hvec h;
  memcpy(&h, p, sizeof(hvec));
  return h;
}

static inline void hstore(uint16_t* p, hvec h) { memcpy(p, &h, sizeof(hvec)); }

static inline uvec vec_bits(vec v) { return (uvec)v; }
static inline vec bits_vec(uvec u) { return (vec)u; }

/* a where the mask is set, else b, lane by lane (bitwise: a NaN's or an infinity's bits pass unchanged). */
static inline vec vselect(ivec mask, vec a, vec b) {
  uvec m = (uvec)mask;
  return bits_vec((vec_bits(a) & m) | (vec_bits(b) & ~m));
}

static inline vec widen(hvec h) { return bits_vec(__builtin_convertvector(h, uvec) << 16); } /* bfloat16 -> float32 */

static inline void store(void* p, int64_t i, float v, int bf16) {
  if (bf16)
    ((uint16_t*)p)[i] = f32_to_bf16(v);
  else
    ((float*)p)[i] = v;
}

static inline float round_to(float v, int bf16) { /* the dtype's value */
  return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline void load_row(float* dst, const void* src, int64_t offset, int n, int bf16) { /* n floats */
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src + offset;
    int i = 0;
    for (; i + LANES <= n; i += LANES) vstore(dst + i, widen(hload(s + i)));
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(dst, (const float*)src + offset, (size_t)n * sizeof(float));
  }
}

static inline hvec to_bf16(vec v) { /* f32_to_bf16 on each lane */
  uvec u = vec_bits(v);
  uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uvec nan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
  return __builtin_convertvector((((u >> 16) | 0x40u) & nan) | (rounded & ~nan), hvec);
}

static inline vec vround(vec v, int bf16) { /* round_to on each lane */
  if (!bf16) return v;
  return widen(to_bf16(v));
}

static inline void store_row(void* dst, int64_t offset, const float* src, int n, int bf16) { /* n % LANES == 0 */
  if (bf16) {
    for (int i = 0; i < n; i += LANES) hstore((uint16_t*)dst + offset + i, to_bf16(vload(src + i)));
  } else {
    memcpy((float*)dst + offset, src, (size_t)n * sizeof(float));
  }
}

static inline float lanes_sum(float* acc) { /* a fixed tree over the LANES accumulators */
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}
#endif
