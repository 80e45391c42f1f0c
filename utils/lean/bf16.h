/* Scalar bit casts and number formats, shared by every source file: a float32's bits and back (`f32_bits`,
   `bits_f32`: the one place a scalar is reinterpreted), bfloat16 <-> float32 (a bfloat16 is a float32's upper 16
   bits) and float16 -> float32 (the 4-bit weights' scales) in plain C, exact, for builds without F16C. */
#ifndef SPECDEC_BF16_H
#define SPECDEC_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float f) { /* memcpy: the defined way to reinterpret (compiled to a register move) */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* a NaN stays a NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) { /* every float16 is a float32: the same value, as F16C's vcvtph2ps */
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, u;
  if (exponent == 0x1f) { /* infinity, or a NaN made quiet */
    u = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);
  } else if (exponent) {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13); /* rebias: 127 - 15 */
  } else if (!mantissa) {
    u = sign;
  } else { /* subnormal: mantissa 2^-24, normalised */
    uint32_t e = 113;
    while (!(mantissa & 0x400u)) mantissa <<= 1, e--;
    u = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return bits_f32(u);
}
#endif
