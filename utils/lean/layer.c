/* A decoder layer's small operations, built with `gemm.c` into one library by `utils/lean/native.py`: RMSNorm
   (with the residual addition before it), the rotary embedding with the keys' and values' write into the static
   buffer, and attention over that buffer. Each replaces several of torch's eager operations (each ~5-10 us of
   dispatch on a one-token pass, about 15 ms of a 1.5B's pass in all) by one call.

   Tensors are float32, or bfloat16 (`bf16` set) stored as uint16; every sum is taken in float32. Where torch's
   eager steps round between operations (bfloat16), the same roundings are made here, so that the rotary step and
   the norms' last multiplication give torch's bits; the norms' and attention's sums are taken in an order of
   their own.

   Width invariance by construction: every query's attention is computed alone (its scores, their maximum, its
   softmax's sum and its output, each in one fixed order over the keys it sees), whatever the number of queries in
   the pass, of keys the pass reads beyond a row's length (a hidden key's weight is exactly zero, and adding a zero
   changes no float32 sum: the buffer holds only finite values) or of threads; the norms and the rotary step work on one token at a time. So no padding of queries or keys is needed
   (torch's attention kernel blocks queries by their count: `llama.py` pads for it). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "specdec.h"

/* 64-byte vectors are passed between our static functions on CPUs without AVX-512 too (split by the compiler):
   their ABI is this file's own. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define LANES 16 /* the fixed accumulators of every dot product and sum of squares (d % LANES == 0) */
#define HIDDEN (-1e30f) /* a mask value at or below this hides the key (the runner's masks hold the dtype's minimum) */

static inline void store(void* p, int64_t i, float v, int bf16) {
  if (bf16)
    ((uint16_t*)p)[i] = f32_to_bf16(v);
  else
    ((float*)p)[i] = v;
}

static inline float round_to(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; } /* the dtype's value */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec vload(const float* p) {
  vec v;
  memcpy(&v, p, sizeof(vec));
  return v;
}

static inline void vstore(float* p, vec v) { memcpy(p, &v, sizeof(vec)); }

typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline void load_row(float* dst, const void* src, int64_t offset, int n, int bf16) { /* n floats */
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src + offset;
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
      hvec h;
      memcpy(&h, s + i, sizeof(hvec));
      uvec bits = __builtin_convertvector(h, uvec) << 16;
      memcpy(dst + i, &bits, sizeof(vec));
    }
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(dst, (const float*)src + offset, (size_t)n * sizeof(float));
  }
}

static inline hvec to_bf16(vec v) { /* f32_to_bf16 on each lane */
  uvec u, nan;
  memcpy(&u, &v, sizeof(vec));
  uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  nan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
  return __builtin_convertvector((((u >> 16) | 0x40u) & nan) | (rounded & ~nan), hvec);
}

static inline vec vround(vec v, int bf16) { /* round_to on each lane */
  if (!bf16) return v;
  uvec bits = __builtin_convertvector(to_bf16(v), uvec) << 16;
  memcpy(&v, &bits, sizeof(vec));
  return v;
}

static inline void store_row(void* dst, int64_t offset, const float* src, int n, int bf16) { /* n % LANES == 0 */
  if (bf16) {
    for (int i = 0; i < n; i += LANES) {
      hvec h = to_bf16(vload(src + i));
      memcpy((uint16_t*)dst + offset + i, &h, sizeof(hvec));
    }
  } else {
    memcpy((float*)dst + offset, src, (size_t)n * sizeof(float));
  }
}

static inline float lanes_sum(float* acc) { /* a fixed tree over the LANES accumulators */
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* out = RMSNorm(x) for `tokens` rows of n (n % LANES == 0): x normalised in float32, then times the weight in the
   dtype (Llama: rounded to the dtype first, as transformers does) or times (1 + weight) in float32 (`plus_one`:
   Gemma's). With `delta`, x = x + delta first (the residual addition, rounded to the dtype), written back to x.
   The weight is bfloat16 where `weight_bf16` is set (a float32 pass over a bfloat16 model), else in x's dtype. */
int specdec_rms_norm(void* x, const void* delta, const void* weight, void* out, int tokens, int n, float eps,
                     int plus_one, int bf16, int weight_bf16, int threads) {
  if (n < 1 || n % LANES || tokens < 0) return SPECDEC_BAD_SHAPE;
  int status = SPECDEC_OK;
  threads = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(threads) if (tokens > 1)
  {
    float* row = malloc((size_t)3 * n * sizeof(float)); /* the token's x, its delta, the weight */
    if (!row) {
#pragma omp atomic write
      status = SPECDEC_NO_MEMORY;
    }
    if (row) load_row(row + 2 * n, weight, 0, n, weight_bf16);
#pragma omp for schedule(static)
    for (int t = 0; t < tokens; t++) {
      if (!row) continue;
      float *more = row + n, *w = row + 2 * n;
      int64_t base = (int64_t)t * n;
      load_row(row, x, base, n, bf16);
      if (delta) { /* the residual addition, rounded to the dtype and written back */
        load_row(more, delta, base, n, bf16);
        for (int i = 0; i < n; i += LANES) vstore(row + i, vround(vload(row + i) + vload(more + i), bf16));
        store_row(x, base, row, n, bf16);
      }
      float acc[LANES] = {0};
      for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(row[i + l], row[i + l], acc[l]);
      vec inverse = (vec){0} + 1.0f / sqrtf(lanes_sum(acc) / (float)n + eps), one = (vec){0} + 1.0f;
      for (int i = 0; i < n; i += LANES) {
        vec v = vload(row + i) * inverse;
        vstore(more + i, plus_one ? v * (one + vload(w + i)) : vload(w + i) * vround(v, bf16));
      }
      store_row(out, base, more, n, bf16);
    }
    free(row);
  }
  return status;
}

/* One head's rotary embedding, transformers' x cos + rotate_half(x) sin, each product and the sum rounded to the
   dtype as torch's eager steps are. */
static inline void rotate(const float* x, const float* c, const float* s, float* y, int d, int bf16) {
  int half = d / 2, i = 0;
  if (half % LANES == 0)
    for (; i < half; i += LANES) {
      vec a = vload(x + i), b = vload(x + i + half);
      vstore(y + i, vround(vround(a * vload(c + i), bf16) + vround(-b * vload(s + i), bf16), bf16));
      vstore(y + i + half, vround(vround(b * vload(c + i + half), bf16) + vround(a * vload(s + i + half), bf16), bf16));
    }
  for (; i < half; i++) {
    y[i] = round_to(round_to(x[i] * c[i], bf16) + round_to(-x[i + half] * s[i], bf16), bf16);
    y[i + half] = round_to(round_to(x[i + half] * c[i + half], bf16) + round_to(x[i] * s[i + half], bf16), bf16);
  }
}

/* One token's rotary step and write (see below): its heads of qkv (`stride` values a token) rotated, the queries to
   q_out, the keys and the values (copied) to the buffer's `slot` of row r. scratch: 4 d floats. */
static void rope_token(const void* qkv, const void* cos, const void* sin, int64_t position, int64_t slot, int64_t token,
                       int64_t r, void* q_out, void* keys, void* values, int heads, int kv_heads, int slots, int d,
                       int bf16, float* scratch) {
  int64_t stride = (int64_t)(heads + 2 * kv_heads) * d;
  size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
  float *x = scratch, *y = scratch + d, *c = scratch + 2 * d, *s = scratch + 3 * d;
  load_row(c, cos, position * d, d, bf16);
  load_row(s, sin, position * d, d, bf16);
  for (int h = 0; h < heads + kv_heads; h++) {
    load_row(x, qkv, token * stride + (int64_t)h * d, d, bf16);
    rotate(x, c, s, y, d, bf16);
    int64_t to = h < heads ? (token * heads + h) * d : ((r * kv_heads + h - heads) * slots + slot) * d;
    if (d % LANES == 0)
      store_row(h < heads ? q_out : keys, to, y, d, bf16);
    else
      for (int i = 0; i < d; i++) store(h < heads ? q_out : keys, to + i, y[i], bf16);
  }
  for (int h = 0; h < kv_heads; h++) {
    int64_t from = token * stride + (int64_t)(heads + kv_heads + h) * d;
    int64_t to = ((r * kv_heads + h) * slots + slot) * d;
    memcpy((char*)values + (size_t)to * size, (const char*)qkv + (size_t)from * size, (size_t)d * size);
  }
}

/* The q/k/v product's output (rows * width tokens of (heads + 2 kv_heads) d: q's heads, k's, v's) -> the rotated
   queries, q_out (rows, width, heads, d), and the rotated keys and the values written into the buffer's slots
   `write_index` (rows, width) of keys and values (rows, kv_heads, slots, d). cos and sin: the rotary tables
   (table_rows, d), read at `positions` (rows, width). Every slot is checked to lie in [0, slots) and every position
   in [0, table_rows) before anything is written: SPECDEC_BAD_INDEX where one does not. */
int specdec_rope_write_checked(const void* qkv, const void* cos, const void* sin, int64_t table_rows,
                               const int64_t* positions, const int64_t* write_index, void* q_out, void* keys,
                               void* values, int rows, int width, int heads, int kv_heads, int slots, int d, int bf16,
                               int threads) {
  if (d < 2 || d % 2 || rows < 0 || width < 0 || heads < 0 || kv_heads < 0 || slots < 0 || table_rows < 0)
    return SPECDEC_BAD_SHAPE;
  int64_t tokens = (int64_t)rows * width;
  for (int64_t token = 0; token < tokens; token++)
    if (write_index[token] < 0 || write_index[token] >= slots || positions[token] < 0 ||
        positions[token] >= table_rows)
      return SPECDEC_BAD_INDEX;
  int status = SPECDEC_OK;
  threads = threads > 0 ? threads : 1;
#pragma omp parallel num_threads(threads) if (tokens > 1)
  {
    float* scratch = malloc((size_t)4 * d * sizeof(float));
    if (!scratch) {
#pragma omp atomic write
      status = SPECDEC_NO_MEMORY;
    }
#pragma omp for schedule(static)
    for (int64_t token = 0; token < tokens; token++) {
      if (!scratch) continue;
      rope_token(qkv, cos, sin, positions[token], write_index[token], token, token / width, q_out, keys, values,
                 heads, kv_heads, slots, d, bf16, scratch);
    }
    free(scratch);
  }
  return status;
}

/* The same without the table's length: slots checked, positions only for >= 0 (the caller vouches for the rest).
   Kept for callers built before specdec_rope_write_checked. */
int specdec_rope_write(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                       const int64_t* write_index, void* q_out, void* keys, void* values, int rows, int width,
                       int heads, int kv_heads, int slots, int d, int bf16, int threads) {
  return specdec_rope_write_checked(qkv, cos, sin, INT64_MAX, positions, write_index, q_out, keys, values, rows,
                                    width, heads, kv_heads, slots, d, bf16, threads);
}

/* Attention of `width` queries a row over the first `used` slots of its keys and values (rows, kv_heads, slots, d):
   query (r, h, t) at q + r q_row + h q_head + t q_token (elements), its mask at mask + r m_row + t m_token (used
   values: added to the scores; at or below HIDDEN the key is hidden), its output at out ((rows, width, heads, d):
   the output projection's input). Query head h reads key head h / (heads / kv_heads). Scores: scale q.k, capped
   to cap tanh(s / cap) where cap > 0 (Gemma 2), plus the mask; softmax and the weighted values in float32. A query
   that sees no key gets zeros.

   The work: a task is a row's key head for some of the row's queries (all of them, split while there are fewer
   tasks than threads) with every query head that reads that key head; it walks the keys once per CHUNK (query,
   head) pairs, converting each key and value to float32 once for all of them. */
#define CHUNK 32 /* (query, head) pairs a walk over the keys serves, at least one query's heads */
#define KEYS 32 /* keys (then values) converted to float32 at once */
/* Products and sums fused where they can be, from here to the end of the file: a fixed choice of the build (which
   pairs the compiler fuses is its own, so the bits here are a build's, not torch's). clang: within an expression
   (`on`), decided as it parses, so every inlined copy of a sum fuses alike; its `fast` is left to the back end's
   blocks, and at -O1/-O2 fused a query's products differently as a pair's first and second member (a query's bits
   then depended on its neighbours: tests/native/test_kernels.c). gcc fuses across statements, the same everywhere. */
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

static inline vec vexp(vec x) { /* e^x for x <= 0 (Cephes' expf: a degree-5 polynomial on a reduced argument) */
  ivec low = x < -87.0f, bits;
  vec floor = (vec){0} - 87.0f;
  ivec xb, fb;
  memcpy(&xb, &x, sizeof(vec));
  memcpy(&fb, &floor, sizeof(vec));
  bits = (xb & ~low) | (fb & low);
  memcpy(&x, &bits, sizeof(vec));
  ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec); /* round to nearest: x <= 0 */
  vec k = __builtin_convertvector(n, vec);
  vec r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  vec p = (vec){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  ivec scale = (n + 127) << 23;
  vec two_n;
  memcpy(&two_n, &scale, sizeof(vec));
  return p * two_n;
}

/* One call's operands (specdec_attention's arguments) and the numbers derived from them. */
typedef struct {
  const void *q, *keys, *values, *mask;
  void* out;
  int64_t q_row, q_head, q_token, m_row, m_token;
  int heads, kv_heads, width, used, slots, d, bf16;
  int group, padded; /* query heads a key head serves; `used` rounded up to LANES */
  float scale, cap;
} attention_t;

/* scores (n pairs of `padded`) = each (query, head) pair's dot products with the first `used` keys of the key head at
   head_base, each alone (LANES accumulators, then hsum's tree). block: KEYS keys in float32. */
static void attention_dots(const attention_t* A, const float* queries, float* scores, float* block, int64_t head_base,
                           int n) {
  int d = A->d, used = A->used, padded = A->padded;
  for (int j0 = 0; j0 < used; j0 += KEYS) {
    int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
    load_row(block, A->keys, head_base + (int64_t)j0 * d, keys_here * d, A->bf16);
    for (int pair = 0; pair < n; pair += 2) { /* the dot products, each alone */
      const float *a = queries + (size_t)pair * d, *b = pair + 1 < n ? a + d : a;
      float *sa = scores + (size_t)pair * padded + j0, *sb = sa + padded;
      int j = 0;
      for (; j + LANES <= keys_here; j += LANES) { /* sixteen keys' scores summed at once */
        vec la[LANES], lb[LANES];
        for (int k = 0; k < LANES; k += 4) lanes_2x4(a, b, block + (size_t)(j + k) * d, d, la + k, lb + k);
        vstore(sa + j, hsum16(la));
        if (pair + 1 < n) vstore(sb + j, hsum16(lb));
      }
      for (; j < keys_here; j += 4) {
        float s[8];
        if (j + 4 <= keys_here) {
          dots_2x4(a, b, block + (size_t)j * d, d, s);
        } else {
          for (int k = 0; k < keys_here - j; k++)
            s[k] = vdot(a, block + (size_t)(j + k) * d, d), s[4 + k] = vdot(b, block + (size_t)(j + k) * d, d);
        }
        for (int k = 0; k < 4 && j + k < keys_here; k++) {
          sa[j + k] = s[k];
          if (pair + 1 < n) sb[j + k] = s[4 + k];
        }
      }
    }
  }
}

/* The scores scaled, capped, plus their query's mask (masks: a query's `padded` values): -inf where hidden. */
static void attention_mask(const attention_t* A, float* scores, const float* masks, int n) {
  for (int pair = 0; pair < n; pair++) {
    float* p = scores + (size_t)pair * A->padded;
    const float* m = masks + (size_t)(pair / A->group) * A->padded;
    for (int j = 0; j < A->used; j += LANES) {
      vec v = vload(p + j) * A->scale, mv = vload(m + j), hidden = (vec){0} - INFINITY;
      if (A->cap > 0)
        for (int l = 0; l < LANES; l++) v[l] = A->cap * tanhf(v[l] / A->cap);
      ivec shown = mv > HIDDEN, x, y;
      vec sum = v + mv;
      memcpy(&x, &sum, sizeof(vec));
      memcpy(&y, &hidden, sizeof(vec));
      x = (x & shown) | (y & ~shown);
      memcpy(p + j, &x, sizeof(vec));
    }
  }
}

/* One pair's softmax numerators e^(s - max), in place over `padded` scores (-inf past `used`) -> their sum (0 where
   the query sees no key). */
static float softmax_numerators(float* p, int used, int padded) {
  for (int j = used; j < padded; j++) p[j] = -INFINITY;
  vec top = (vec){0} - INFINITY, sum = {0};
  for (int j = 0; j < padded; j += LANES) {
    vec s = vload(p + j);
    ivec more = s > top, a, b;
    memcpy(&a, &s, sizeof(vec));
    memcpy(&b, &top, sizeof(vec));
    a = (a & more) | (b & ~more);
    memcpy(&top, &a, sizeof(vec));
  }
  float most = -INFINITY;
  for (int l = 0; l < LANES; l++) most = top[l] > most ? top[l] : most;
  /* The sum's lanes follow the visible keys' count, not their slots: the v-th key the query sees goes
     to lane v % LANES, so a tree node's sum (hidden siblings between its ancestors and itself) is the
     sum it gets once accepted and moved next to them. Vectors while every key so far is seen. */
  int seen_all = 1, visible = 0;
  for (int j = 0; j < padded; j += LANES) {
    vec s = vload(p + j), e = vexp(s - most);
    ivec seen = s > -INFINITY, bits;
    memcpy(&bits, &e, sizeof(vec));
    bits &= seen;
    memcpy(&e, &bits, sizeof(vec));
    vstore(p + j, e);
    if (seen_all) {
      int whole = 1;
      for (int l = 0; l < LANES; l++) whole &= seen[l] != 0;
      if (whole) {
        sum = sum + e;
        visible += LANES;
        continue;
      }
      seen_all = 0;
    }
    for (int l = 0; l < LANES; l++)
      if (seen[l]) sum[visible++ % LANES] += e[l];
  }
  return most == -INFINITY ? 0.0f : hsum(sum);
}

/* acc (n pairs of d) = the values at head_base weighted by each pair's numerators, key after key. */
static void attention_values(const attention_t* A, const float* scores, float* acc, float* block, int64_t head_base,
                             int n) {
  int d = A->d, used = A->used;
  memset(acc, 0, (size_t)n * d * sizeof(float));
  for (int j0 = 0; j0 < used; j0 += KEYS) {
    int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
    load_row(block, A->values, head_base + (int64_t)j0 * d, keys_here * d, A->bf16);
    for (int pair = 0; pair < n; pair += 2) {
      const float *pa = scores + (size_t)pair * A->padded + j0, *pb = pair + 1 < n ? pa + A->padded : pa;
      float* at = acc + (size_t)pair * d;
      int i = 0, two = pair + 1 < n;
      for (; i + 8 * LANES <= d; i += 8 * LANES) weighted_8(at + i, d, pa, pb, block + i, keys_here, two);
      for (; i + 4 * LANES <= d; i += 4 * LANES) weighted_4(at + i, d, pa, pb, block + i, keys_here, two);
      for (; i < d; i += LANES) weighted_1(at + i, d, pa, pb, block + i, keys_here, two);
    }
  }
}

/* Queries first..first + count - 1 of row r, with every query head of key head kvh: their outputs. buffer: the
   thread's scratch (attention_floats). */
static void attention_walk(const attention_t* A, float* buffer, int r, int kvh, int first, int count) {
  int d = A->d, group = A->group, padded = A->padded, n = count * group;
  size_t pairs = (size_t)(CHUNK / group > 0 ? CHUNK / group : 1) * group;
  int64_t head_base = ((int64_t)r * A->kv_heads + kvh) * A->slots * d;
  float* scores = (float*)(((uintptr_t)buffer + sizeof(vec) - 1) / sizeof(vec) * sizeof(vec));
  float *queries = scores + pairs * padded, *acc = queries + pairs * d, *masks = acc + pairs * d;
  float* block = masks + pairs / group * padded; /* KEYS keys or values in float32 */
  for (int c = 0; c < count; c++) { /* each query's mask in float32 and its heads' queries */
    load_row(masks + (size_t)c * padded, A->mask, r * A->m_row + (first + c) * A->m_token, A->used, A->bf16);
    for (int j = A->used; j < padded; j++) masks[(size_t)c * padded + j] = -INFINITY;
    for (int h = 0; h < group; h++)
      load_row(queries + (size_t)(c * group + h) * d, A->q,
               r * A->q_row + (int64_t)(kvh * group + h) * A->q_head + (first + c) * A->q_token, d, A->bf16);
  }
  attention_dots(A, queries, scores, block, head_base, n);
  attention_mask(A, scores, masks, n);
  float sums[CHUNK > group ? CHUNK : group];
  for (int pair = 0; pair < n; pair++) sums[pair] = softmax_numerators(scores + (size_t)pair * padded, A->used, padded);
  attention_values(A, scores, acc, block, head_base, n);
  for (int pair = 0; pair < n; pair++) {
    int t = first + pair / group, h = kvh * group + pair % group;
    int64_t to = (((int64_t)r * A->width + t) * A->heads + h) * d;
    float inverse = sums[pair] > 0 ? 1.0f / sums[pair] : 0.0f;
    for (int i = 0; i < d; i++) store(A->out, to + i, acc[(size_t)pair * d + i] * inverse, A->bf16);
  }
}

/* SPECDEC_BAD_SHAPE for a head size not a positive multiple of LANES, query heads not a multiple of key heads, a
   negative count; SPECDEC_BAD_INDEX where `used` exceeds the buffer's slots. Then SPECDEC_NO_MEMORY or OK. */
int specdec_attention(const void* q, int64_t q_row, int64_t q_head, int64_t q_token, const void* keys,
                      const void* values, const void* mask, int64_t m_row, int64_t m_token, void* out, int rows,
                      int heads, int kv_heads, int width, int used, int slots, int d, float scale, float cap, int bf16,
                      int threads) {
  if (d < 1 || d % LANES || kv_heads < 1 || heads < 0 || heads % kv_heads || rows < 0 || width < 0 || used < 0 ||
      slots < 0)
    return SPECDEC_BAD_SHAPE;
  if (used > slots) return SPECDEC_BAD_INDEX;
  attention_t A = {q, keys, values, mask, out, q_row, q_head, q_token, m_row, m_token, heads, kv_heads, width, used,
                   slots, d, bf16, heads / kv_heads, (used + LANES - 1) / LANES * LANES, scale, cap};
  if (A.group == 0) return SPECDEC_OK; /* no query heads: nothing to write */
  threads = threads > 0 ? threads : 1;
  int per_walk = CHUNK / A.group > 0 ? CHUNK / A.group : 1; /* queries a walk serves */
  int64_t tasks = (int64_t)rows * kv_heads, split = 1;
  while (tasks * split < threads && split < width) split++;
  int per_task = (int)((width + split - 1) / split), status = SPECDEC_OK;
  size_t pairs = (size_t)per_walk * A.group; /* (query, head) pairs a walk serves */
  size_t floats = pairs * (A.padded + 2 * (size_t)d) + (size_t)per_walk * A.padded + (size_t)KEYS * d + 2 * LANES;
#pragma omp parallel num_threads(threads)
  {
    float* buffer = malloc(floats * sizeof(float));
    if (!buffer) {
#pragma omp atomic write
      status = SPECDEC_NO_MEMORY;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks * split; task++) {
      if (!buffer) continue;
      int part = (int)(task % split), kvh = (int)(task / split % kv_heads), r = (int)(task / split / kv_heads);
      int end = (part + 1) * per_task < width ? (part + 1) * per_task : width;
      for (int first = part * per_task; first < end; first += per_walk)
        attention_walk(&A, buffer, r, kvh, first, end - first < per_walk ? end - first : per_walk);
    }
    free(buffer);
  }
  return status;
}

/* out = act(gate) * up for `tokens` rows of gate_up = [gate | up] (n each, n % LANES == 0) -> (tokens, n): the
   activation rounded to the dtype, then the product rounded (torch's two eager steps' roundings). silu (kind 0):
   x sigmoid(x); gelu's tanh approximation (kind 1): torch's steps, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi)
   (x + 0.044715 x^3), so that it is 0 where tanh(y) rounds to -1, as torch's is. Both from e^-|z| (`vexp`): within
   a float32 ulp or a few of torch's (gelu: of tanh's, where 1 + tanh(y) cancels), so a bfloat16 value can sit one
   step away from torch's at a rounding's edge. Each value alone: the same bits whatever the pass's width. */
#define GATED_CHUNK 1024 /* values a task serves */
int specdec_gated(const void* gate_up, void* out, int tokens, int n, int kind, int bf16, int threads) {
  if (kind < 0 || kind > 1) return SPECDEC_UNSUPPORTED;
  if (n < 1 || n % LANES || tokens < 0) return SPECDEC_BAD_SHAPE;
  int chunks = (n + GATED_CHUNK - 1) / GATED_CHUNK;
  int64_t tasks = (int64_t)tokens * chunks;
  threads = threads > 0 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (tasks > 1)
  for (int64_t task = 0; task < tasks; task++) {
    int64_t t = task / chunks;
    int from = (int)(task % chunks) * GATED_CHUNK, to = from + GATED_CHUNK < n ? from + GATED_CHUNK : n;
    float g[LANES] __attribute__((aligned(64))), u[LANES] __attribute__((aligned(64)));
    for (int i = from; i < to; i += LANES) {
      load_row(g, gate_up, t * 2 * n + i, LANES, bf16);
      load_row(u, gate_up, t * 2 * n + n + i, LANES, bf16);
      vec x = vload(g), z = kind ? 0.7978845608028654f * (x + 0.044715f * (x * x * x)) : x;
      vec magnitude, act, one = (vec){0} + 1.0f;
      ivec bits, negative = z < 0;
      memcpy(&bits, &z, sizeof(vec));
      bits &= 0x7fffffff;
      memcpy(&magnitude, &bits, sizeof(vec));
      if (kind) { /* tanh(z) = sign(z) (1 - e) / (1 + e), e = e^-2|z| */
        vec e = vexp(-2.0f * magnitude), t = (one - e) / (one + e), minus = -t;
        ivec t_bits, minus_bits;
        memcpy(&t_bits, &t, sizeof(vec));
        memcpy(&minus_bits, &minus, sizeof(vec));
        bits = (minus_bits & negative) | (t_bits & ~negative);
        memcpy(&t, &bits, sizeof(vec));
        act = 0.5f * x * (one + t);
      } else { /* sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below, e = e^-|z| */
        vec e = vexp(-magnitude), numerator;
        ivec e_bits, one_bits;
        memcpy(&e_bits, &e, sizeof(vec));
        memcpy(&one_bits, &one, sizeof(vec));
        bits = (e_bits & negative) | (one_bits & ~negative);
        memcpy(&numerator, &bits, sizeof(vec));
        act = x * (numerator / (one + e));
      }
      vec product = vround(act, bf16) * vload(u);
      store_row(out, t * n + i, (const float*)&product, LANES, bf16);
    }
  }
  return SPECDEC_OK;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
