/* The native kernels (the C files of utils/lean) against scalar references written here, built with them by
   tests/native/run.sh for each compiler and ISA (tests/test_c_kernels.py runs the variants):

     test_kernels check        every entry point over many shapes (widths 1..32, float32 and bfloat16, bias or
                               none): each output within a stated tolerance of a float64 reference (bit for bit
                               where the kernel's steps are fixed: the rotary step, the 4-bit dequantization), each
                               row's bits the same alone and among others, on 1 and 3 threads, in any block;
                               out-of-range slots, positions and shapes answered by their status, nothing written
     test_kernels fuzz N       N random calls per entry point on cheap shapes, valid or not: the status expected,
                               valid calls within tolerance of the reference (for the sanitizer builds)
     test_kernels digest       a hash per entry point of its outputs on fixed inputs, to compare builds

   Tolerances (|kernel - reference| at most, per output; `mag` the sum of the absolute terms):
     GEMM            1e-5 mag, + 2^-8 |ref| for bfloat16 outputs
     4-bit GEMM      the activations' int8 rounding: sum over blocks of 0.5001 dx sum |w|, + 1e-5 mag (+ bf16)
     RMSNorm         1e-5 relative (float32), 2^-6 (bfloat16: two roundings a value)
     attention       1e-4 max|v| (float32), 2^-7 max|v| (bfloat16)
     flash           2^-7 max|v| (bfloat16 only: its softmax's weights rounded to bfloat16)
     gated           1e-5 |ref| + 1e-6 |x u| (float32), 2^-6 |ref| + 1e-6 |x u| (bfloat16)
     rotary step, dequantization: exact. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"

#define MAX_ROWS SPECDEC_MAX_ROWS

/* ---- numbers: a fixed generator, bfloat16 and float16 written apart from the kernels' own helpers ---- */
static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint32_t next(void) { /* xorshift64* */
  state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
  return (uint32_t)((state * 0x2545f4914f6cdd1dull) >> 32);
}
static int below(int n) { return (int)(next() % (uint32_t)n); }
static float uniform(void) { return (float)((next() >> 8) / 16777216.0 * 2.0 - 1.0); } /* [-1, 1) */

static float bits_f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t f_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float from_bf16(uint16_t h) { return bits_f((uint32_t)h << 16); }
static uint16_t to_bf16(float f) { /* the nearer of the two bfloat16 around f, ties to the even one */
  uint32_t u = f_bits(f);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
  uint16_t low = (uint16_t)(u >> 16), high = (uint16_t)(low + 1);
  double below_ = fabs((double)f - from_bf16(low)), above = fabs((double)from_bf16(high) - f);
  if ((u & 0xffff) == 0) return low;
  if (below_ < above) return low;
  if (above < below_) return high;
  return low & 1 ? high : low;
}
static float round_bf16(float f) { return from_bf16(to_bf16(f)); }
static float from_f16(uint16_t h) {
  int exponent = (h >> 10) & 31, mantissa = h & 1023;
  double v = exponent ? ldexp(1024 + mantissa, exponent - 25) : ldexp(mantissa, -24);
  return (float)(h & 0x8000 ? -v : v);
}

/* Tensors of float32 or bfloat16 values, read and written as float. */
static float get(const void* p, size_t i, int bf16) { return bf16 ? from_bf16(((const uint16_t*)p)[i]) : ((const float*)p)[i]; }
static void set(void* p, size_t i, float v, int bf16) {
  if (bf16) ((uint16_t*)p)[i] = to_bf16(v);
  else ((float*)p)[i] = v;
}
static void* tensor(size_t n, int bf16, float scale) { /* uniform in [-scale, scale) */
  void* p = malloc(n ? n * 4 : 4);
  for (size_t i = 0; i < n; i++) set(p, i, scale * uniform(), bf16);
  return p;
}
static void* copy(const void* p, size_t bytes) { return memcpy(malloc(bytes ? bytes : 1), p, bytes); }

/* ---- the record ---- */
static long checks, failures;
#define CHECK(ok, ...)                                                 \
  do {                                                                 \
    checks++;                                                          \
    if (!(ok)) {                                                       \
      if (failures++ < 20) {                                           \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
        fprintf(stderr, __VA_ARGS__);                                  \
        fputc('\n', stderr);                                           \
      }                                                                \
    }                                                                  \
  } while (0)
static int near(double got, double want, double tolerance) { return fabs(got - want) <= tolerance; }
static int same_bytes(const void* a, const void* b, size_t n) { return memcmp(a, b, n) == 0; }

/* ---- bfloat16 GEMM ---- */
typedef struct {
  int rows, out, in, bf16, bias;
} gemm_case;

static double gemm_ref(const uint16_t* W, const void* x, const void* b, int r, int j, int in, int bf16, double* mag) {
  double sum = 0, m = 0;
  for (int k = 0; k < in; k++) {
    double t = (double)from_bf16(W[(size_t)j * in + k]) * get(x, (size_t)r * in + k, bf16);
    sum += t, m += fabs(t);
  }
  if (b) sum += get(b, j, bf16), m += fabs(get(b, j, bf16));
  *mag = m;
  return sum;
}

/* Every output within tolerance, and each row's bits alone == among the others, on 1 and 3 threads, and in a
   product whose weight starts `shift` rows later (another block). */
static void check_gemm(gemm_case c, int threads) {
  int size = c.bf16 ? 2 : 4;
  uint16_t* W = tensor((size_t)c.out * c.in, 1, 1.0f);
  void *x = tensor((size_t)c.rows * c.in, c.bf16, 1.0f), *b = c.bias ? tensor(c.out, c.bf16, 1.0f) : NULL;
  void* y = calloc((size_t)c.rows * c.out, 4);
  void* alone = calloc(c.out, 4);
  CHECK(specdec_gemm(W, x, b, y, c.rows, c.out, c.in, c.bf16, c.bf16, threads) == SPECDEC_OK, "gemm status");
  for (int r = 0; r < c.rows; r++)
    for (int j = 0; j < c.out; j++) {
      double mag, want = gemm_ref(W, x, b, r, j, c.in, c.bf16, &mag);
      double got = get(y, (size_t)r * c.out + j, c.bf16);
      CHECK(near(got, want, 1e-5 * mag + (c.bf16 ? ldexp(fabs(want), -8) : 0) + 1e-30),
            "gemm %dx%dx%d bf16=%d (%d,%d): %.9g vs %.9g", c.rows, c.out, c.in, c.bf16, r, j, got, want);
    }
  for (int r = 0; r < c.rows; r++) {
    const char* row = (const char*)x + (size_t)r * c.in * size;
    CHECK(specdec_gemm(W, row, b, alone, 1, c.out, c.in, c.bf16, c.bf16, 1 + (r % 3)) == SPECDEC_OK, "gemm status");
    CHECK(same_bytes(alone, (char*)y + (size_t)r * c.out * size, (size_t)c.out * size),
          "gemm %dx%dx%d bf16=%d: row %d alone differs", c.rows, c.out, c.in, c.bf16, r);
  }
  int shift = c.out > 5 ? 5 : 0; /* outputs shift..out-1 of a product over W's rows shift.. */
  void* later = calloc((size_t)c.rows * c.out, 4);
  const char* b_later = b ? (const char*)b + (size_t)shift * size : NULL;
  specdec_gemm(W + (size_t)shift * c.in, x, b_later, later, c.rows, c.out - shift, c.in, c.bf16, c.bf16, 3);
  for (int r = 0; r < c.rows; r++)
    CHECK(same_bytes((char*)later + (size_t)r * (c.out - shift) * size, (char*)y + ((size_t)r * c.out + shift) * size,
                     (size_t)(c.out - shift) * size),
          "gemm: row %d's outputs differ in another block", r);
  free(W), free(x), free(b), free(y), free(alone), free(later);
}

/* ---- 4-bit GEMM: the layout of gemm.c's comment, built here from (q, d, m) per row ---- */
typedef struct {
  int out, in, group, groups;
  uint8_t* q;      /* (out, in) in 0..15 */
  uint16_t *d, *m; /* (out, in / group) float16 */
  uint8_t* packed; /* (groups, in / 32, 256) */
  uint16_t* dm;    /* (groups, in / group, 2, 16) */
} q4_weight;

static q4_weight q4_make(int out, int in, int group) {
  q4_weight w = {out, in, group, (out + 15) / 16, NULL, NULL, NULL, NULL, NULL};
  int blocks = in / 32, scales = in / group;
  w.q = malloc((size_t)out * in);
  w.d = malloc((size_t)out * scales * 2), w.m = malloc((size_t)out * scales * 2);
  for (size_t i = 0; i < (size_t)out * in; i++) w.q[i] = (uint8_t)below(16);
  for (size_t i = 0; i < (size_t)out * scales; i++) /* d in [2^-10, 2^-4), m in (-2^-1, 2^-1) or so */
    w.d[i] = (uint16_t)(0x1400 + below(0x1800)), w.m[i] = (uint16_t)(0x3400 + below(0x400) + (below(2) << 15));
  w.packed = calloc((size_t)w.groups * blocks * 256, 1);
  w.dm = calloc((size_t)w.groups * scales * 2 * 16, 2);
  for (int j = 0; j < out; j++) {
    int g = j / 16, l = j % 16;
    for (int k = 0; k < in; k++) {
      int b = k / 32, v = (k % 32) / 8, i = k % 4, high = (k % 8) >= 4;
      uint8_t* byte = w.packed + ((size_t)g * blocks + b) * 256 + 64 * v + 4 * l + i;
      *byte |= (uint8_t)(w.q[(size_t)j * in + k] << (4 * high));
    }
    for (int s = 0; s < scales; s++) {
      w.dm[(((size_t)g * scales + s) * 2) * 16 + l] = w.d[(size_t)j * scales + s];
      w.dm[(((size_t)g * scales + s) * 2 + 1) * 16 + l] = w.m[(size_t)j * scales + s];
    }
  }
  return w;
}
static void q4_free(q4_weight w) { free(w.q), free(w.d), free(w.m), free(w.packed), free(w.dm); }
static float q4_value(const q4_weight* w, int j, int k) { /* d q + m: a product, then a sum, in float32 */
  int s = k / w->group, scales = w->in / w->group;
  float product = from_f16(w->d[(size_t)j * scales + s]) * (float)w->q[(size_t)j * w->in + k];
  return product + from_f16(w->m[(size_t)j * scales + s]);
}

static void check_q4(int rows, int out, int in, int group, int bf16, int bias, int threads) {
  int size = bf16 ? 2 : 4;
  q4_weight w = q4_make(out, in, group);
  void *x = tensor((size_t)rows * in, bf16, 1.0f), *b = bias ? tensor(out, bf16, 1.0f) : NULL;
  void *y = calloc((size_t)rows * out, 4), *alone = calloc(out, 4), *dense = calloc((size_t)out * in, 4);
  CHECK(specdec_gemm_q4(w.packed, w.dm, x, b, y, rows, out, in, group, bf16, bf16, threads) == SPECDEC_OK, "q4");
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < out; j++) {
      double sum = 0, mag = 0, rounding = 0;
      for (int k0 = 0; k0 < in; k0 += 32) {
        double amax = 0, weights = 0;
        for (int k = k0; k < k0 + 32; k++) {
          double xv = get(x, (size_t)r * in + k, bf16), wv = q4_value(&w, j, k);
          sum += wv * xv, weights += fabs(wv), amax = fmax(amax, fabs(xv));
          mag += (fabs(from_f16(w.d[(size_t)j * (in / group) + k / group]) * w.q[(size_t)j * in + k]) +
                  fabs(from_f16(w.m[(size_t)j * (in / group) + k / group]))) * fabs(xv);
        }
        rounding += 0.5001 * amax / 127 * weights;
      }
      if (b) sum += get(b, j, bf16), mag += fabs(get(b, j, bf16));
      double got = get(y, (size_t)r * out + j, bf16);
      CHECK(near(got, sum, rounding + 1e-5 * mag + (bf16 ? ldexp(fabs(sum), -8) : 0) + 1e-30),
            "q4 %dx%dx%d/%d bf16=%d (%d,%d): %.9g vs %.9g", rows, out, in, group, bf16, r, j, got, sum);
    }
  for (int r = 0; r < rows; r++) {
    specdec_gemm_q4(w.packed, w.dm, (char*)x + (size_t)r * in * size, b, alone, 1, out, in, group, bf16, bf16, 1 + r % 3);
    CHECK(same_bytes(alone, (char*)y + (size_t)r * out * size, (size_t)out * size), "q4: row %d alone differs", r);
  }
  if (out > 16) { /* the second group of weight rows alone: the same bits */
    size_t scales = (size_t)(in / group) * 32;
    specdec_gemm_q4(w.packed + (size_t)(in / 32) * 256, w.dm + scales, x, b ? (char*)b + 16 * size : NULL, alone, 1,
                    out - 16, in, group, bf16, bf16, 2);
    CHECK(same_bytes(alone, (char*)y + 16 * size, (size_t)(out - 16) * size), "q4: a group's outputs differ alone");
  }
  CHECK(specdec_dequantize_q4(w.packed, w.dm, dense, out, in, group, bf16, threads) == SPECDEC_OK, "dequantize");
  for (int j = 0; j < out; j++)
    for (int k = 0; k < in; k++) {
      float want = bf16 ? round_bf16(q4_value(&w, j, k)) : q4_value(&w, j, k);
      CHECK(f_bits(get(dense, (size_t)j * in + k, bf16)) == f_bits(want), "dequantize (%d,%d)", j, k);
    }
  q4_free(w), free(x), free(b), free(y), free(alone), free(dense);
}

/* ---- RMSNorm ---- */
static void check_rms_norm(int tokens, int n, int bf16, int with_delta, int plus_one, int weight_bf16, int threads) {
  int size = bf16 ? 2 : 4;
  void *x = tensor((size_t)tokens * n, bf16, 2.0f), *delta = with_delta ? tensor((size_t)tokens * n, bf16, 1.0f) : NULL;
  void *weight = tensor(n, weight_bf16, 1.0f), *before = copy(x, (size_t)tokens * n * size);
  void *out = calloc((size_t)tokens * n, 4), *alone = calloc(n, 4);
  CHECK(specdec_rms_norm(x, delta, weight, out, tokens, n, 1e-6f, plus_one, bf16, weight_bf16, threads) == SPECDEC_OK,
        "rms_norm");
  for (int t = 0; t < tokens; t++) {
    double squares = 0;
    for (int i = 0; i < n; i++) {
      size_t at = (size_t)t * n + i;
      float v = get(before, at, bf16);
      if (delta) { /* the residual addition: a float32 sum rounded to the dtype, written back */
        v = v + get(delta, at, bf16);
        v = bf16 ? round_bf16(v) : v;
        CHECK(f_bits(get(x, at, bf16)) == f_bits(v), "rms_norm's residual (%d,%d)", t, i);
      }
      squares += (double)v * v;
    }
    double inverse = 1 / sqrt(squares / n + 1e-6);
    for (int i = 0; i < n; i++) {
      size_t at = (size_t)t * n + i;
      double v = get(x, at, bf16) * inverse, w = get(weight, i, weight_bf16);
      double want = plus_one ? v * (1 + w) : w * v, mag = plus_one ? fabs(v) * (1 + fabs(w)) : fabs(w * v);
      CHECK(near(get(out, at, bf16), want, (bf16 ? 1.0 / 64 : 1e-5) * mag + 1e-30), "rms_norm (%d,%d) bf16=%d: %.9g vs %.9g",
            t, i, bf16, get(out, at, bf16), want);
    }
  }
  for (int t = 0; t < tokens; t++) { /* a token alone (its x after the residual, no delta) gives its bits */
    specdec_rms_norm((char*)x + (size_t)t * n * size, NULL, weight, alone, 1, n, 1e-6f, plus_one, bf16, weight_bf16, 1);
    CHECK(same_bytes(alone, (char*)out + (size_t)t * n * size, (size_t)n * size), "rms_norm: token %d alone", t);
  }
  free(x), free(delta), free(weight), free(before), free(out), free(alone);
}

/* ---- the rotary step and the buffer's write ---- */
typedef struct {
  int rows, width, heads, kv_heads, slots, d, bf16, table, rotary; /* rotary: a head's dimensions turned (0: all d) */
} rope_case;

static float rnd(float v, int bf16) { return bf16 ? round_bf16(v) : v; }

/* The expected q_out, keys and values (keys and values start as copies of the buffer). */
static void rope_ref(rope_case c, const void* qkv, const void* cs, const void* sn, const int64_t* pos,
                     const int64_t* slot, void* q, void* keys, void* values) {
  int half = c.rotary / 2, per = (c.heads + 2 * c.kv_heads) * c.d;
  for (int token = 0; token < c.rows * c.width; token++) {
    int r = token / c.width;
    for (int h = 0; h < c.heads + 2 * c.kv_heads; h++) {
      size_t to = h < c.heads ? ((size_t)token * c.heads + h) * c.d
                              : (((size_t)r * c.kv_heads + (h - c.heads) % c.kv_heads) * c.slots + slot[token]) * c.d;
      void* dst = h < c.heads ? q : h < c.heads + c.kv_heads ? keys : values;
      for (int i = 0; i < c.d; i++) {
        float x = get(qkv, (size_t)token * per + h * c.d + i, c.bf16);
        if (h >= c.heads + c.kv_heads || i >= c.rotary) { /* a value, or past the turned dimensions: copied */
          set(dst, to + i, x, c.bf16);
          continue;
        }
        int other = i < half ? i + half : i - half;
        float partner = get(qkv, (size_t)token * per + h * c.d + other, c.bf16);
        float co = get(cs, (size_t)pos[token] * c.rotary + i, c.bf16);
        float si = get(sn, (size_t)pos[token] * c.rotary + i, c.bf16);
        float first = rnd(x * co, c.bf16), second = rnd((i < half ? -partner : partner) * si, c.bf16);
        set(dst, to + i, rnd(first + second, c.bf16), c.bf16);
      }
    }
  }
}

static void check_rope(rope_case c, int threads) {
  if (!c.rotary) c.rotary = c.d;
  int size = c.bf16 ? 2 : 4, tokens = c.rows * c.width;
  size_t nq = (size_t)tokens * c.heads * c.d, nkv = (size_t)c.rows * c.kv_heads * c.slots * c.d;
  void *qkv = tensor((size_t)tokens * (c.heads + 2 * c.kv_heads) * c.d, c.bf16, 1.0f);
  void *cs = tensor((size_t)c.table * c.rotary, c.bf16, 1.0f), *sn = tensor((size_t)c.table * c.rotary, c.bf16, 1.0f);
  int64_t *pos = malloc(8 * (size_t)tokens), *slot = malloc(8 * (size_t)tokens);
  for (int t = 0; t < tokens; t++) pos[t] = below(c.table), slot[t] = (t % c.width) * c.slots / c.width + below(c.slots / c.width);
  void *q = calloc(nq, 4), *keys = tensor(nkv, c.bf16, 1.0f), *values = tensor(nkv, c.bf16, 1.0f);
  void *q_want = calloc(nq, 4), *k_want = copy(keys, nkv * size), *v_want = copy(values, nkv * size);
  rope_ref(c, qkv, cs, sn, pos, slot, q_want, k_want, v_want);
  CHECK(specdec_rope_write_checked(qkv, cs, sn, c.table, pos, slot, q, keys, values, c.rows, c.width, c.heads,
                                   c.kv_heads, c.slots, c.d, c.rotary, c.bf16, threads) == SPECDEC_OK, "rope status");
  CHECK(same_bytes(q, q_want, nq * size), "rope: queries d=%d bf16=%d", c.d, c.bf16);
  CHECK(same_bytes(keys, k_want, nkv * size), "rope: keys (or a slot written that should not be)");
  CHECK(same_bytes(values, v_want, nkv * size), "rope: values");
  /* out of range: a slot, a position; nothing written */
  int64_t keep_slot = slot[tokens - 1], keep_pos = pos[tokens - 1];
  int64_t bad_slots[] = {c.slots, -1, INT64_MAX}, bad_pos[] = {c.table, -1};
  void *k_now = copy(keys, nkv * size), *q_now = copy(q, nq * size);
  for (int i = 0; i < 3; i++) {
    slot[tokens - 1] = bad_slots[i];
    CHECK(specdec_rope_write_checked(qkv, cs, sn, c.table, pos, slot, q, keys, values, c.rows, c.width, c.heads,
                                     c.kv_heads, c.slots, c.d, c.rotary, c.bf16, threads) == SPECDEC_BAD_INDEX, "rope: bad slot");
    CHECK(specdec_rope_write(qkv, cs, sn, pos, slot, q, keys, values, c.rows, c.width, c.heads, c.kv_heads, c.slots,
                             c.d, c.bf16, threads) == SPECDEC_BAD_INDEX, "rope (unchecked table): bad slot");
  }
  slot[tokens - 1] = keep_slot;
  for (int i = 0; i < 2; i++) {
    pos[tokens - 1] = bad_pos[i];
    CHECK(specdec_rope_write_checked(qkv, cs, sn, c.table, pos, slot, q, keys, values, c.rows, c.width, c.heads,
                                     c.kv_heads, c.slots, c.d, c.rotary, c.bf16, threads) == SPECDEC_BAD_INDEX, "rope: bad position");
  }
  pos[tokens - 1] = keep_pos;
  CHECK(same_bytes(keys, k_now, nkv * size) && same_bytes(q, q_now, nq * size), "rope: written though refused");
  free(qkv), free(cs), free(sn), free(pos), free(slot), free(q), free(keys), free(values), free(q_want), free(k_want),
      free(v_want), free(k_now), free(q_now);
}

/* ---- attention ---- */
typedef struct {
  int rows, heads, kv_heads, width, used, slots, d, bf16;
  float scale, cap;
} attention_case;

static void attention_ref(attention_case c, const void* q, const void* keys, const void* values, const void* mask,
                          int r, int h, int t, double* out, double* vmax) {
  int kvh = h / (c.heads / c.kv_heads);
  size_t base = ((size_t)r * c.kv_heads + kvh) * c.slots * c.d;
  double* p = malloc(sizeof(double) * (c.used ? c.used : 1));
  double most = -INFINITY, sum = 0;
  for (int j = 0; j < c.used; j++) {
    float m = get(mask, ((size_t)r * c.width + t) * c.used + j, c.bf16);
    double s = 0;
    for (int i = 0; i < c.d; i++)
      s += (double)get(q, (((size_t)r * c.heads + h) * c.width + t) * c.d + i, c.bf16) * get(keys, base + (size_t)j * c.d + i, c.bf16);
    s *= c.scale;
    if (c.cap > 0) s = c.cap * tanh(s / c.cap);
    p[j] = m <= -1e30f ? -INFINITY : s + m;
    most = fmax(most, p[j]);
  }
  for (int j = 0; j < c.used; j++) p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - most), sum += p[j];
  *vmax = 0;
  for (int i = 0; i < c.d; i++) out[i] = 0;
  for (int j = 0; j < c.used; j++)
    for (int i = 0; i < c.d; i++) {
      double v = get(values, base + (size_t)j * c.d + i, c.bf16);
      if (p[j] > 0) *vmax = fmax(*vmax, fabs(v));
      out[i] += sum > 0 ? p[j] / sum * v : 0;
    }
  free(p);
}

/* q laid out (rows, heads, width, d), the mask (rows, width, used): a quarter of the keys hidden, a few whole rows. */
static void check_attention(attention_case c, int threads) {
  int size = c.bf16 ? 2 : 4;
  size_t nq = (size_t)c.rows * c.heads * c.width * c.d, nkv = (size_t)c.rows * c.kv_heads * c.slots * c.d;
  size_t nm = (size_t)c.rows * c.width * c.used, no = (size_t)c.rows * c.width * c.heads * c.d;
  void *q = tensor(nq, c.bf16, 1.0f), *keys = tensor(nkv, c.bf16, 1.0f), *values = tensor(nkv, c.bf16, 1.0f);
  void *mask = malloc(nm * 4 + 4), *out = calloc(no, 4), *alone = calloc((size_t)c.heads * c.d, 4);
  for (size_t i = 0; i < nm; i++) set(mask, i, below(4) == 0 ? -3.0e38f : below(3) == 0 ? -0.5f * (float)below(4) : 0.0f, c.bf16);
  if (c.width > 2) /* a query that sees no key */
    for (int j = 0; j < c.used; j++) set(mask, (size_t)1 * c.used + j, -3.0e38f, c.bf16);
  int64_t q_row = (int64_t)c.heads * c.width * c.d, q_head = (int64_t)c.width * c.d, q_token = c.d;
  CHECK(specdec_attention(q, q_row, q_head, q_token, keys, values, mask, (int64_t)c.width * c.used, c.used, out,
                          c.rows, c.heads, c.kv_heads, c.width, c.used, c.slots, c.d, c.scale, c.cap, c.bf16,
                          threads) == SPECDEC_OK, "attention status");
  if (threads > 1) { /* the same bits on one thread (threads that share a query's keys among them, or not) */
    void* one = calloc(no, 4);
    specdec_attention(q, q_row, q_head, q_token, keys, values, mask, (int64_t)c.width * c.used, c.used, one, c.rows,
                      c.heads, c.kv_heads, c.width, c.used, c.slots, c.d, c.scale, c.cap, c.bf16, 1);
    CHECK(same_bytes(one, out, no * size), "attention: %d threads and one differ (%d of %d key heads, width %d, %d keys)",
          threads, c.heads, c.kv_heads, c.width, c.used);
    free(one);
  }
  double* want = malloc(sizeof(double) * c.d);
  for (int r = 0; r < c.rows; r++)
    for (int t = 0; t < c.width; t++)
      for (int h = 0; h < c.heads; h++) {
        double vmax;
        attention_ref(c, q, keys, values, mask, r, h, t, want, &vmax);
        for (int i = 0; i < c.d; i++) {
          double got = get(out, (((size_t)r * c.width + t) * c.heads + h) * c.d + i, c.bf16);
          CHECK(near(got, want[i], (c.bf16 ? 1.0 / 128 : 1e-4) * vmax + 1e-30),
                "attention r%d t%d h%d i%d bf16=%d cap=%g: %.9g vs %.9g", r, t, h, i, c.bf16, c.cap, got, want[i]);
        }
      }
  for (int r = 0; r < c.rows; r++) /* each query alone: width 1, its mask row, its q */
    for (int t = 0; t < c.width; t++) {
      const char* q_at = (const char*)q + ((size_t)r * q_row + (size_t)t * q_token) * size;
      const char* m_at = (const char*)mask + ((size_t)r * c.width + t) * c.used * size;
      const char* k_at = (const char*)keys + (size_t)r * c.kv_heads * c.slots * c.d * size;
      const char* v_at = (const char*)values + (size_t)r * c.kv_heads * c.slots * c.d * size;
      specdec_attention(q_at, q_row, q_head, q_token, k_at, v_at, m_at, 0, 0, alone, 1, c.heads, c.kv_heads, 1,
                        c.used, c.slots, c.d, c.scale, c.cap, c.bf16, 1 + t % 4);
      CHECK(same_bytes(alone, (char*)out + ((size_t)r * c.width + t) * c.heads * c.d * size, (size_t)c.heads * c.d * size),
            "attention: query (%d,%d) alone differs", r, t);
    }
  CHECK(specdec_attention(q, q_row, q_head, q_token, keys, values, mask, 0, 0, out, c.rows, c.heads, c.kv_heads,
                          c.width, c.slots + 1, c.slots, c.d, c.scale, c.cap, c.bf16, threads) == SPECDEC_BAD_INDEX,
        "attention: used > slots");
  free(q), free(keys), free(values), free(mask), free(out), free(alone), free(want);
}

/* ---- a prompt's attention over itself (flash.c) ---- */
/* heads x width queries at positions start..start + width - 1 (q laid out (heads, width, d)) over kv_heads x slots
   keys, each seeing the keys up to its position: within 2^-7 max|v| of the float64 softmax (bfloat16 inputs, its
   weights rounded to bfloat16), every query's bits the same in the prompt's first half alone on other threads. */
static void check_flash(int heads, int kv_heads, int width, int start, int d, int threads) {
  int slots = start + width + below(5), group = heads / kv_heads;
  size_t nq = (size_t)heads * width * d, nkv = (size_t)kv_heads * slots * d, no = (size_t)width * heads * d;
  uint16_t *q = tensor(nq, 1, 1.0f), *keys = tensor(nkv, 1, 1.0f), *values = tensor(nkv, 1, 1.0f);
  uint16_t *out = calloc(no, 2), *half = calloc(no, 2);
  float scale = 1.0f / sqrtf((float)d);
  CHECK(specdec_flash_attention(q, (int64_t)width * d, d, keys, values, out, heads, kv_heads, width, start, slots, d,
                                scale, threads) == SPECDEC_OK, "flash status");
  double* p = malloc(sizeof(double) * (start + width));
  for (int h = 0; h < heads; h++)
    for (int t = 0; t < width; t++) {
      size_t base = (size_t)(h / group) * slots * d;
      int seen = start + t + 1;
      double most = -INFINITY, sum = 0, vmax = 0;
      for (int j = 0; j < seen; j++) {
        double dot = 0;
        for (int i = 0; i < d; i++) dot += (double)get(q, ((size_t)h * width + t) * d + i, 1) * get(keys, base + (size_t)j * d + i, 1);
        p[j] = dot * scale;
        if (p[j] > most) most = p[j];
      }
      for (int j = 0; j < seen; j++) p[j] = exp(p[j] - most), sum += p[j];
      for (size_t i = 0; i < (size_t)seen * d; i++) { /* written without fmax: aarch64 gcc 12 failed on that reduction */
        double v = fabs(get(values, base + i, 1));
        if (v > vmax) vmax = v;
      }
      for (int i = 0; i < d; i++) {
        double want = 0;
        for (int j = 0; j < seen; j++) want += p[j] / sum * get(values, base + (size_t)j * d + i, 1);
        double got = get(out, ((size_t)t * heads + h) * d + i, 1);
        CHECK(near(got, want, vmax / 128), "flash h%d t%d i%d (heads %d/%d, width %d, start %d, d %d): %.9g vs %.9g",
              h, t, i, heads, kv_heads, width, start, d, got, want);
      }
    }
  int first = (width + 1) / 2; /* the first half alone (q's strides kept), on another thread count */
  specdec_flash_attention(q, (int64_t)width * d, d, keys, values, half, heads, kv_heads, first, start, slots, d, scale,
                          1 + threads % 3);
  CHECK(same_bytes(half, out, (size_t)first * heads * d * 2), "flash: the first %d of %d queries alone differ", first, width);
  CHECK(specdec_flash_attention(q, d, d, keys, values, out, heads, kv_heads, width, slots - width + 1, slots, d, scale,
                                threads) == SPECDEC_BAD_INDEX, "flash: start + width > slots");
  CHECK(specdec_flash_attention(q, d, d, keys, values, out, heads, kv_heads, width, start, slots, d + 16, scale,
                                threads) == SPECDEC_BAD_SHAPE, "flash: a head size not a multiple of 32");
  CHECK(specdec_flash_attention(q, d, d, keys, values, out, 9 * kv_heads, kv_heads, width, start, slots, d, scale,
                                threads) == SPECDEC_BAD_SHAPE, "flash: nine query heads a key head");
  free(q), free(keys), free(values), free(out), free(half), free(p);
}

/* ---- act(gate) * up ---- */
static void check_gated(int tokens, int n, int kind, int bf16, int threads) {
  int size = bf16 ? 2 : 4;
  void *gate_up = tensor((size_t)tokens * 2 * n, bf16, 6.0f), *out = calloc((size_t)tokens * n, 4), *alone = calloc(n, 4);
  CHECK(specdec_gated(gate_up, out, tokens, n, kind, bf16, threads) == SPECDEC_OK, "gated");
  for (int t = 0; t < tokens; t++)
    for (int i = 0; i < n; i++) {
      double x = get(gate_up, (size_t)t * 2 * n + i, bf16), u = get(gate_up, (size_t)t * 2 * n + n + i, bf16);
      double act = kind ? 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))) : x / (1 + exp(-x));
      double got = get(out, (size_t)t * n + i, bf16);
      CHECK(near(got, act * u, (bf16 ? 1.0 / 64 : 1e-5) * fabs(act * u) + 1e-6 * fabs(x * u) + 1e-30),
            "gated kind %d bf16=%d x=%g u=%g: %.9g vs %.9g", kind, bf16, x, u, got, act * u);
    }
  for (int t = 0; t < tokens; t++) {
    specdec_gated((char*)gate_up + (size_t)t * 2 * n * size, alone, 1, n, kind, bf16, 1);
    CHECK(same_bytes(alone, (char*)out + (size_t)t * n * size, (size_t)n * size), "gated: token %d alone", t);
  }
  free(gate_up), free(out), free(alone);
}

/* ---- every entry point's refusals ---- */
static void check_statuses(void) {
  int block = specdec_block(), q4 = specdec_q4_block();
  CHECK(block > 0 && q4 > 0, "a kernel in every build: block %d, q4 block %d", block, q4);
  uint16_t w[64 * 64] = {0};
  float x[64 * 64] = {0}, y[64 * 64];
  int64_t index[4] = {0, 1, 2, 3};
  CHECK(specdec_gemm(w, x, NULL, y, 0, 4, block, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gemm: 0 rows");
  CHECK(specdec_gemm(w, x, NULL, y, MAX_ROWS + 1, 4, block, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gemm: 33 rows");
  CHECK(specdec_gemm(w, x, NULL, y, 1, 4, block + 1, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gemm: in %% block");
  CHECK(specdec_gemm(w, x, NULL, y, 1, -1, block, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gemm: out < 0");
  CHECK(specdec_gemm_q4((uint8_t*)w, w, x, NULL, y, 1, 4, 64, 48, 0, 0, 1) == SPECDEC_UNSUPPORTED, "q4: group 48");
  CHECK(specdec_gemm_q4((uint8_t*)w, w, x, NULL, y, 1, 4, 32, 64, 0, 0, 1) == SPECDEC_BAD_SHAPE, "q4: in %% group");
  CHECK(specdec_gemm_q4((uint8_t*)w, w, x, NULL, y, 33, 4, 32, 32, 0, 0, 1) == SPECDEC_BAD_SHAPE, "q4: 33 rows");
  CHECK(specdec_dequantize_q4((uint8_t*)w, w, y, 4, 32, 16, 0, 1) == SPECDEC_UNSUPPORTED, "dequantize: group 16");
  CHECK(specdec_rms_norm(x, NULL, x, y, 1, 24, 1e-6f, 0, 0, 0, 1) == SPECDEC_BAD_SHAPE, "rms_norm: n %% 16");
  CHECK(specdec_rms_norm(x, NULL, x, y, -1, 16, 1e-6f, 0, 0, 0, 1) == SPECDEC_BAD_SHAPE, "rms_norm: tokens < 0");
  CHECK(specdec_rope_write_checked(x, x, x, 4, index, index, y, y, y, 1, 1, 1, 1, 4, 3, 3, 0, 1) == SPECDEC_BAD_SHAPE,
        "rope: odd d");
  CHECK(specdec_rope_write_checked(x, x, x, 4, index, index, y, y, y, 1, 1, 1, 1, 4, 4, 3, 0, 1) == SPECDEC_BAD_SHAPE,
        "rope: odd rotary");
  CHECK(specdec_rope_write_checked(x, x, x, 4, index, index, y, y, y, 1, 1, 1, 1, 4, 4, 6, 0, 1) == SPECDEC_BAD_SHAPE,
        "rope: rotary > d");
  CHECK(specdec_rope_write_checked(x, x, x, 4, index, index, y, y, y, 1, 1, 1, 1, 4, 4, 0, 0, 1) == SPECDEC_BAD_SHAPE,
        "rope: rotary 0");
  CHECK(specdec_attention(x, 0, 0, 0, x, x, x, 0, 0, y, 1, 2, 0, 1, 1, 1, 16, 1, 0, 0, 1) == SPECDEC_BAD_SHAPE,
        "attention: no key heads");
  CHECK(specdec_attention(x, 0, 0, 0, x, x, x, 0, 0, y, 1, 3, 2, 1, 1, 1, 16, 1, 0, 0, 1) == SPECDEC_BAD_SHAPE,
        "attention: heads %% kv_heads");
  CHECK(specdec_attention(x, 0, 0, 0, x, x, x, 0, 0, y, 1, 2, 1, 1, 1, 1, 24, 1, 0, 0, 1) == SPECDEC_BAD_SHAPE,
        "attention: d %% 16");
  CHECK(specdec_attention(x, 0, 0, 0, x, x, x, 0, 0, y, 1, 2, 1, 1, 3, 2, 16, 1, 0, 0, 1) == SPECDEC_BAD_INDEX,
        "attention: used > slots");
  CHECK(specdec_gated(x, y, 1, 16, 2, 0, 1) == SPECDEC_UNSUPPORTED, "gated: kind 2");
  CHECK(specdec_gated(x, y, 1, 8, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gated: n %% 16");
}

/* ---- the whole stack: a pass of W tokens gives each token the bits of W passes of one ---- */
enum { HIDDEN = 64, HEADS = 4, KV_HEADS = 2, HEAD_DIM = 16, INTERMEDIATE = 64, LAYERS = 2, TABLE = 64 };

typedef struct {
  const void* pointers[LAYERS * SPECDEC_LAYER_POINTERS];
  void* owned[LAYERS * SPECDEC_LAYER_POINTERS * 2];
  int n_owned;
  q4_weight q4[LAYERS * SPECDEC_LINEARS];
  specdec_shape_t shape;
  void *cos, *sin;
} model;

static const void* own(model* m, void* p) { return m->owned[m->n_owned++] = p; }

static void model_make(model* m, int kind, int bf16, int qk_norms, int threads) {
  static const int outs[SPECDEC_LINEARS] = {(HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 2 * INTERMEDIATE, HIDDEN};
  static const int ins[SPECDEC_LINEARS] = {HIDDEN, HEADS * HEAD_DIM, HIDDEN, INTERMEDIATE};
  memset(m, 0, sizeof *m);
  for (int l = 0; l < LAYERS; l++) {
    const void** p = m->pointers + l * SPECDEC_LAYER_POINTERS;
    p[SPECDEC_ATTENTION_NORM] = own(m, tensor(HIDDEN, bf16, 1.0f));
    p[SPECDEC_MLP_NORM] = own(m, tensor(HIDDEN, bf16, 1.0f));
    if (qk_norms) p[SPECDEC_Q_NORM] = own(m, tensor(HEAD_DIM, bf16, 1.0f)), p[SPECDEC_K_NORM] = own(m, tensor(HEAD_DIM, bf16, 1.0f));
    for (int i = 0; i < SPECDEC_LINEARS; i++) {
      const void** at = p + SPECDEC_FIRST_LINEAR + 3 * i;
      if (kind == 1) {
        m->q4[l * SPECDEC_LINEARS + i] = q4_make(outs[i], ins[i], 32);
        at[0] = m->q4[l * SPECDEC_LINEARS + i].packed, at[1] = m->q4[l * SPECDEC_LINEARS + i].dm;
      } else {
        at[0] = own(m, tensor((size_t)outs[i] * ins[i], 1, 0.2f));
      }
      if (i == SPECDEC_QKV) at[2] = own(m, tensor(outs[i], bf16, 0.5f));
    }
  }
  specdec_shape_t s = {0};
  s.hidden = HIDDEN, s.intermediate = INTERMEDIATE, s.heads = HEADS, s.kv_heads = KV_HEADS, s.head_dim = HEAD_DIM;
  for (int i = 0; i < SPECDEC_LINEARS; i++) s.kinds[i] = kind, s.outs[i] = outs[i], s.groups[i] = 32;
  s.bf16 = bf16, s.norm_bf16 = bf16, s.threads = threads, s.activation = 0, s.eps = 1e-6f, s.scale = 0.25f;
  s.table_rows = TABLE, s.rotary = HEAD_DIM;
  m->shape = s;
  m->cos = tensor((size_t)TABLE * HEAD_DIM, bf16, 1.0f), m->sin = tensor((size_t)TABLE * HEAD_DIM, bf16, 1.0f);
}

static void model_free(model* m) {
  for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
  for (int i = 0; i < LAYERS * SPECDEC_LINEARS; i++) q4_free(m->q4[i]);
  free(m->cos), free(m->sin);
}

/* h (width tokens) through the stack: one row, tokens at positions and slots first..first + width - 1, seeing every
   slot before theirs and themselves (a causal mask over `used` = first + width slots). */
static int model_pass(model* m, void* h, void* const* kv, int first, int width, int slots, int64_t bad_slot) {
  int bf16 = (int)m->shape.bf16, used = first + width, size = bf16 ? 2 : 4;
  int64_t positions[64], write_index[64], kinds[LAYERS] = {0};
  void* mask = malloc((size_t)width * used * 4);
  for (int t = 0; t < width; t++) {
    positions[t] = first + t, write_index[t] = bad_slot >= 0 && t == width - 1 ? bad_slot : first + t;
    for (int j = 0; j < used; j++) set(mask, (size_t)t * used + j, j <= first + t ? 0.0f : -3.0e38f, bf16);
  }
  specdec_shape_t s = m->shape;
  s.rows = 1, s.width = width, s.used = used, s.slots = slots, s.mask_row = (int64_t)width * used, s.mask_token = used;
  s.sliding_row = s.mask_row, s.sliding_token = s.mask_token;
  size_t work_values = (size_t)width * (2 * HIDDEN + s.outs[SPECDEC_QKV] + 2 * HEADS * HEAD_DIM + 3 * INTERMEDIATE);
  void* work = malloc(work_values * size);
  int status = specdec_decoder(h, work, m->pointers, kv, kinds, LAYERS, m->cos, m->sin, NULL, NULL, positions,
                               write_index, mask, mask, &s);
  free(mask), free(work);
  return status;
}

static void check_decoder(int kind, int bf16, int qk_norms, int width, int threads) {
  model m;
  model_make(&m, kind, bf16, qk_norms, threads);
  int size = bf16 ? 2 : 4, slots = width + 3;
  size_t buffer = (size_t)KV_HEADS * slots * HEAD_DIM * size;
  void *wide_kv[2 * LAYERS], *one_kv[2 * LAYERS];
  for (int i = 0; i < 2 * LAYERS; i++) wide_kv[i] = calloc(buffer, 1), one_kv[i] = calloc(buffer, 1);
  void* h = tensor((size_t)width * HIDDEN, bf16, 1.0f);
  void* wide = copy(h, (size_t)width * HIDDEN * size);
  CHECK(model_pass(&m, wide, wide_kv, 0, width, slots, -1) == SPECDEC_OK, "decoder status");
  for (int t = 0; t < width; t++) {
    void* one = copy((char*)h + (size_t)t * HIDDEN * size, (size_t)HIDDEN * size);
    CHECK(model_pass(&m, one, one_kv, t, 1, slots, -1) == SPECDEC_OK, "decoder status (one token)");
    CHECK(same_bytes(one, (char*)wide + (size_t)t * HIDDEN * size, (size_t)HIDDEN * size),
          "decoder kind %d bf16=%d: token %d of %d differs from its pass alone", kind, bf16, t, width);
    int finite = 1;
    for (int i = 0; i < HIDDEN; i++) finite &= isfinite(get(one, i, bf16));
    CHECK(finite, "decoder: a value not finite");
    free(one);
  }
  for (int i = 0; i < 2 * LAYERS; i++) CHECK(same_bytes(wide_kv[i], one_kv[i], buffer), "decoder: buffers differ");
  int status = model_pass(&m, wide, wide_kv, 0, width, slots, slots);
  CHECK(status == SPECDEC_BAD_INDEX * 100 + 3, "decoder: a slot past the buffer gave %d", status);
  m.shape.table_rows = width - 1; /* the last token's position past the rotary tables */
  status = model_pass(&m, wide, wide_kv, 0, width, slots, -1);
  CHECK(status == SPECDEC_BAD_INDEX * 100 + 3, "decoder: a position past the tables gave %d", status);
  for (int i = 0; i < 2 * LAYERS; i++) free(wide_kv[i]), free(one_kv[i]);
  free(h), free(wide);
  model_free(&m);
}

/* ---- the modes ---- */

/* Each iteration's random numbers drawn first, in order: arguments are evaluated in an order of the compiler's own,
   and every build should meet the same shapes. */
#define DRAWS 59
static void draw(uint32_t* z) {
  for (int k = 0; k < DRAWS; k++) z[k] = next();
}
#define Z(k, n) ((int)(z[k] % (uint32_t)(n)))
#define ZPICK(k, n, ...) (((const int[]){__VA_ARGS__})[Z(k, n)])

static void check_all(void) {
  uint32_t z[DRAWS];
  static const int widths[] = {1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32};
  check_statuses();
  /* inputs wider than several of the bfloat16 GEMM's chunks (512 inputs a chunk for float32 activations, 4096 for
     bfloat16 pairs), the last one short: the accumulators carried from chunk to chunk keep every row's bits */
  for (int bf16 = 0; bf16 < 2; bf16++)
    for (int rows = 1; rows <= 32; rows += 15) {
      gemm_case wide = {rows, 21, 3 * 4096 + 3 * 512 + 3 * specdec_block(), bf16, rows % 2};
      check_gemm(wide, 1 + rows % 3);
    }
  for (int i = 0; i < 12; i++)
    for (int bf16 = 0; bf16 < 2; bf16++) {
      draw(z);
      int w = widths[i], block = specdec_block();
      gemm_case c = {w, 1 + Z(0, 70), block * (1 + Z(1, 6)), bf16, (i + bf16) % 2};
      check_gemm(c, 1 + i % 3);
      check_q4(w, 1 + Z(2, 50), 64 * (1 + Z(3, 4)), i % 2 ? 32 : 64, bf16, (i + bf16) % 2, 1 + i % 3);
      check_rms_norm(w, 16 * (1 + Z(4, 8)), bf16, i % 2, i % 3 == 0, bf16 ? Z(5, 2) : 0, 1 + i % 3);
      check_gated(w, 16 * (1 + Z(6, 80)), i % 2, bf16, 1 + i % 3);
      rope_case r = {1 + Z(7, 2), w, 1 + Z(8, 4), 1 + Z(9, 2), 2 * w + Z(10, 9), ZPICK(44, 5, 2, 6, 16, 40, 64),
                     bf16, 8 + Z(11, 64), 0};
      r.rotary = i % 3 ? r.d : 2 + 2 * Z(47, r.d / 2); /* a third of the cases turn part of each head */
      check_rope(r, 1 + i % 3);
      int kv = 1 + Z(12, 2);
      attention_case a = {1 + Z(13, 2), kv * (1 + Z(14, 4)), kv, w, 0, 0, 16 * (1 + Z(15, 8)), bf16, 0.3f, i % 3 ? 0 : 8.0f};
      a.slots = w + Z(16, 50), a.used = a.slots - Z(17, a.slots + 1);
      check_attention(a, 1 + i % 4);
    }
  for (int bf16 = 0; bf16 < 2; bf16++) { /* part of each head through the vector loop: Phi-4-mini's 96 of 128, 32 of 64 */
    rope_case phi4 = {2, 3, 3, 1, 8, 128, bf16, 16, 96}, half = {1, 5, 2, 2, 12, 64, bf16, 16, 32};
    check_rope(phi4, 2), check_rope(half, 1);
  }
  /* teams of threads on the same queries' keys (attention.c's attention_spread; 512 keys a thread at least where the
     threads sleep, as run.sh runs them; test_c_kernels.py fuzzes with spinning ones, teams from 32 keys a thread): one
     query over one key head, three key heads on two threads, walks of several queries and ragged ones, queries past
     a walk's pairs, heads of 48-256, a team of two of four threads */
  for (int bf16 = 0; bf16 < 2; bf16++) {
    attention_case spread[] = {{1, 4, 1, 1, 1100, 1100, 256, bf16, 0.3f, 0}, {1, 9, 3, 1, 1100, 1200, 64, bf16, 0.3f, 0},
                               {2, 12, 2, 2, 1600, 1650, 128, bf16, 0.3f, 8.0f}, {1, 2, 1, 5, 1100, 1200, 80, bf16, 0.3f, 0},
                               {1, 16, 1, 3, 1100, 1100, 48, bf16, 0.3f, 0}, {1, 4, 1, 1, 1100, 1100, 128, bf16, 0.3f, 0}};
    int threads[] = {2, 2, 3, 2, 2, 4};
    for (int i = 0; i < 6; i++) check_attention(spread[i], threads[i]);
  }
  for (int kind = 0; kind < 2; kind++)
    for (int bf16 = 0; bf16 < 2; bf16++) check_decoder(kind, bf16, kind == bf16, 6 + 3 * bf16, 2);
  /* a prompt: the 1.5B's heads, ragged blocks, a continuation, one to eight query heads a key head, heads of 32-256 */
  check_flash(12, 2, 100, 0, 128, 2), check_flash(4, 4, 37, 5, 64, 3), check_flash(8, 1, 70, 0, 32, 1);
  check_flash(6, 3, 33, 60, 96, 2), check_flash(16, 2, 50, 0, 256, 4), check_flash(1, 1, 1, 0, 32, 1);
}

/* n random calls per entry point on cheap shapes; one in eight refused (a bad shape or index) */
static void fuzz(long n) {
  uint32_t z[DRAWS];
  for (long i = 0; i < n; i++) {
    draw(z);
    int bf16 = Z(18, 2), w = 1 + Z(19, 8), threads = 1 + Z(20, 2), block = specdec_block();
    gemm_case c = {w, 1 + Z(21, 9), block * (1 + Z(22, 2)), bf16, Z(23, 2)};
    if (Z(24, 8)) check_gemm(c, threads);
    else CHECK(specdec_gemm(NULL, NULL, NULL, NULL, ZPICK(45, 3, 0, -1, 33), 4, block, 0, 0, 1) == SPECDEC_BAD_SHAPE, "gemm");
    if (Z(25, 8)) check_q4(w, 1 + Z(26, 20), 64, 32 << Z(27, 2), bf16, Z(28, 2), threads);
    else CHECK(specdec_gemm_q4(NULL, NULL, NULL, NULL, NULL, w, 4, 64, ZPICK(46, 3, 16, 48, 96), 0, 0, 1) == SPECDEC_UNSUPPORTED, "q4");
    check_rms_norm(w, 16 * (1 + Z(29, 2)), bf16, Z(30, 2), Z(31, 2), bf16 ? Z(32, 2) : 0, threads);
    check_gated(w, 16, Z(33, 2), bf16, threads);
    rope_case r = {1 + Z(34, 2), w, 1 + Z(35, 2), 1, 2 * w + Z(36, 3), 2 * (1 + Z(37, 9)), bf16, 1 + Z(38, 8), 0};
    r.rotary = Z(48, 2) ? r.d : 2 + 2 * Z(49, r.d / 2);
    check_rope(r, threads);
    attention_case a = {1, 2, 1 + Z(39, 2), w, 0, 0, 16, bf16, 0.3f, Z(40, 2) ? 0 : 5.0f};
    a.heads = a.kv_heads * (1 + Z(41, 2)), a.slots = w + Z(42, 5), a.used = a.slots - Z(43, a.slots + 1);
    if (Z(56, 8) == 0) a.slots = 1024 + Z(57, 600), a.used = a.slots - Z(43, 40), a.d = 16 * (1 + Z(58, 4)); /* shared keys */
    check_attention(a, threads);
    int kvh = 1 + Z(50, 2);
    check_flash(kvh * (1 + Z(51, 3)), kvh, 1 + Z(52, 40), Z(53, 3) ? 0 : Z(54, 9), 32 * (1 + Z(55, 2)), threads);
    if (failures) return;
  }
}

/* A hash per entry point of its outputs over fixed inputs (the same in every build where the kernel's steps are):
   the 4-bit GEMM, dequantization, RMSNorm and the rotary step in every build; the bfloat16 GEMM in builds of the same
   block (the plain C one and AVX2's alike); attention, gated and the whole stack (decoder) where the compiler fuses
   the same products. Within one build and compiler they prove a refactor left every kernel's bits unchanged. */
static uint64_t fnv(uint64_t h, const void* p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char*)p)[i]) * 1099511628211ull;
  return h;
}

/* Attention over shapes that take each of its paths: head sizes of 1, 4 and 8 vectors and between, key counts
   past KEYS and not a multiple of LANES, one to four query heads a key head, capped and not, a hidden query. */
static uint64_t digest_attention(void) {
  uint64_t h = 1469598103934665603ull;
  state = 54321;
  for (int it = 0; it < 16; it++) {
    static const int dims[] = {16, 48, 64, 128, 144};
    int bf16 = it % 2, size = bf16 ? 2 : 4, kv_heads = 1 + below(2), heads = kv_heads << below(3);
    int rows = 1 + below(2), width = 1 + below(5), d = dims[below(5)], slots = width + below(50);
    int used = slots - below(3);
    used = used < 0 ? 0 : used;
    float cap = it % 3 == 0 ? 5.0f : 0.0f;
    size_t nq = (size_t)rows * heads * width * d, nkv = (size_t)rows * kv_heads * slots * d;
    size_t nm = (size_t)rows * width * used, no = (size_t)rows * width * heads * d;
    void *q = tensor(nq, bf16, 1.0f), *keys = tensor(nkv, bf16, 1.0f), *values = tensor(nkv, bf16, 1.0f);
    void *mask = malloc(nm * 4 + 4), *out = calloc(no, 4);
    for (size_t i = 0; i < nm; i++) set(mask, i, below(4) == 0 ? -3.0e38f : below(3) == 0 ? -0.5f * (float)below(4) : 0.0f, bf16);
    if (width > 2)
      for (int j = 0; j < used; j++) set(mask, (size_t)used + j, -3.0e38f, bf16);
    specdec_attention(q, (int64_t)heads * width * d, (int64_t)width * d, d, keys, values, mask, (int64_t)width * used,
                      used, out, rows, heads, kv_heads, width, used, slots, d, 0.3f, cap, bf16, 2);
    h = fnv(h, out, no * size);
    free(q), free(keys), free(values), free(mask), free(out);
  }
  return h;
}

/* The whole stack: both linear kinds, both dtypes, with and without q/k norms, silu and gelu. */
static uint64_t digest_decoder(void) {
  uint64_t h = 1469598103934665603ull;
  state = 777;
  for (int it = 0; it < 8; it++) {
    int kind = it % 2, bf16 = it / 2 % 2, qk_norms = it / 4, width = 1 + it % 5, size = bf16 ? 2 : 4, slots = width + 3;
    model m;
    model_make(&m, kind, bf16, qk_norms, 2);
    m.shape.activation = it % 3 == 0, m.shape.plus_one = it % 3 == 1, m.shape.cap = it % 4 == 3 ? 20.0f : 0.0f;
    size_t buffer = (size_t)KV_HEADS * slots * HEAD_DIM * size;
    void* kv[2 * LAYERS];
    for (int i = 0; i < 2 * LAYERS; i++) kv[i] = calloc(buffer, 1);
    void* x = tensor((size_t)width * HIDDEN, bf16, 1.0f);
    model_pass(&m, x, kv, 0, width, slots, -1);
    h = fnv(h, x, (size_t)width * HIDDEN * size);
    for (int i = 0; i < 2 * LAYERS; i++) h = fnv(h, kv[i], buffer), free(kv[i]);
    free(x);
    model_free(&m);
  }
  return h;
}

static void digest(void) {
  uint64_t h[6];
  for (int i = 0; i < 6; i++) h[i] = 1469598103934665603ull;
  state = 12345;
  for (int it = 0; it < 24; it++) {
    int rows = 1 + below(32), out = 1 + below(40), in = 64 * (1 + below(4)), bf16 = it % 2, size = bf16 ? 2 : 4;
    uint16_t* W = tensor((size_t)out * in, 1, 1.0f);
    void *x = tensor((size_t)rows * in, bf16, 1.0f), *y = calloc((size_t)rows * out, 4);
    specdec_gemm(W, x, NULL, y, rows, out, in, bf16, bf16, 2);
    h[0] = fnv(h[0], y, (size_t)rows * out * size);
    q4_weight w = q4_make(out, in, it % 4 < 2 ? 32 : 64);
    specdec_gemm_q4(w.packed, w.dm, x, NULL, y, rows, out, in, w.group, bf16, bf16, 2);
    h[1] = fnv(h[1], y, (size_t)rows * out * size);
    void* dense = malloc((size_t)out * in * 4);
    specdec_dequantize_q4(w.packed, w.dm, dense, out, in, w.group, bf16, 2);
    h[2] = fnv(h[2], dense, (size_t)out * in * size);
    void *weight = tensor(in, bf16, 1.0f), *normed = malloc((size_t)rows * in * 4);
    specdec_rms_norm(x, NULL, weight, normed, rows, in, 1e-6f, it % 3 == 0, bf16, bf16, 2);
    h[3] = fnv(h[3], normed, (size_t)rows * in * size);
    specdec_gated(x, normed, rows, in / 2, it % 2, bf16, 2);
    h[5] = fnv(h[5], normed, (size_t)rows * in / 2 * size);
    int d = 16 * (1 + below(2)), table = 32;
    int64_t pos[32], slot[32];
    for (int t = 0; t < rows; t++) pos[t] = below(table), slot[t] = t;
    int rotary = it % 4 == 3 ? d / 2 : d; /* part of each head: 8 or 16 dimensions */
    void *cs = tensor((size_t)table * rotary, bf16, 1.0f), *sn = tensor((size_t)table * rotary, bf16, 1.0f);
    void *qkv = tensor((size_t)rows * 4 * d, bf16, 1.0f), *q = calloc((size_t)rows * 2 * d, 4);
    void *k = calloc((size_t)rows * d, 4), *v = calloc((size_t)rows * d, 4);
    specdec_rope_write_checked(qkv, cs, sn, table, pos, slot, q, k, v, 1, rows, 2, 1, rows, d, rotary, bf16, 2);
    h[4] = fnv(fnv(fnv(h[4], q, (size_t)rows * 2 * d * size), k, (size_t)rows * d * size), v, (size_t)rows * d * size);
    q4_free(w);
    free(W), free(x), free(y), free(dense), free(weight), free(normed), free(cs), free(sn), free(qkv), free(q), free(k),
        free(v);
  }
  static const char* names[] = {"gemm", "gemm_q4", "dequantize_q4", "rms_norm", "rope_write", "gated"};
  printf("block %d q4_block %d amx %d\n", specdec_block(), specdec_q4_block(), specdec_amx());
  for (int i = 0; i < 6; i++) printf("digest %s %016llx\n", names[i], (unsigned long long)h[i]);
  printf("digest attention %016llx\n", (unsigned long long)digest_attention());
  printf("digest decoder %016llx\n", (unsigned long long)digest_decoder());
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "check";
  if (argc > 3) state = strtoull(argv[3], NULL, 10) | 1;
  if (!strcmp(mode, "check")) check_all();
  else if (!strcmp(mode, "fuzz")) fuzz(argc > 2 ? atol(argv[2]) : 1000);
  else if (!strcmp(mode, "digest")) digest();
  else return fprintf(stderr, "usage: %s check | fuzz N [seed] | digest\n", argv[0]), 2;
  if (strcmp(mode, "digest")) printf("%s: %ld checks, %ld failures (block %d, q4 block %d, amx %d)\n", mode, checks,
                                      failures, specdec_block(), specdec_q4_block(), specdec_amx());
  return failures ? 1 : 0;
}
