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

#define LANES 16 /* the fixed accumulators of every dot product and sum of squares (d % LANES == 0) */
#define HIDDEN (-1e30f) /* a mask value at or below this hides the key (the runner's masks hold the dtype's minimum) */

static inline float load(const void* p, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

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

static inline void load_row(float* dst, const void* src, int64_t offset, int n, int bf16) { /* n floats */
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src + offset;
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
      hvec h;
      memcpy(&h, s + i, sizeof(hvec));
      ivec bits = __builtin_convertvector(h, ivec) << 16;
      memcpy(dst + i, &bits, sizeof(vec));
    }
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(dst, (const float*)src + offset, (size_t)n * sizeof(float));
  }
}

typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

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

static inline float dot(const float* a, const float* b, int n) {
  float acc[LANES] = {0};
  for (int i = 0; i < n; i += LANES)
    for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
  return lanes_sum(acc);
}

/* out = RMSNorm(x) for `tokens` rows of n (n % LANES == 0): x normalised in float32, then times the weight in the
   dtype (Llama: rounded to the dtype first, as transformers does) or times (1 + weight) in float32 (`plus_one`:
   Gemma's). With `delta`, x = x + delta first (the residual addition, rounded to the dtype), written back to x.
   The weight is bfloat16 where `weight_bf16` is set (a float32 pass over a bfloat16 model), else in x's dtype. */
int specdec_rms_norm(void* x, const void* delta, const void* weight, void* out, int tokens, int n, float eps,
                     int plus_one, int bf16, int weight_bf16, int threads) {
  if (n % LANES) return 1;
  int status = 0;
#pragma omp parallel num_threads(threads) if (tokens > 1)
  {
    float* row = malloc((size_t)3 * n * sizeof(float)); /* the token's x, its delta, the weight */
    if (!row) {
#pragma omp atomic write
      status = 2;
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

/* The q/k/v product's output (rows * width tokens of (heads + 2 kv_heads) d: q's heads, k's, v's) -> the rotated
   queries, q_out (rows, width, heads, d), and the rotated keys and the values written into the buffer's slots
   `write_index` (rows, width) of keys and values (rows, kv_heads, slots, d). cos and sin: the rotary tables
   (positions, d), read at `positions` (rows, width). */
int specdec_rope_write(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                       const int64_t* write_index, void* q_out, void* keys, void* values, int rows, int width,
                       int heads, int kv_heads, int slots, int d, int bf16, int threads) {
  if (d % 2) return 1;
  int status = 0, tokens = rows * width;
  int64_t stride = (int64_t)(heads + 2 * kv_heads) * d;
  size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel num_threads(threads) if (tokens > 1)
  {
    float* scratch = malloc((size_t)4 * d * sizeof(float));
    if (!scratch) {
#pragma omp atomic write
      status = 2;
    }
#pragma omp for schedule(static)
    for (int64_t token = 0; token < tokens; token++) {
      if (!scratch) continue;
      float *x = scratch, *y = scratch + d, *c = scratch + 2 * d, *s = scratch + 3 * d;
      int64_t r = token / width, slot = write_index[token];
      load_row(c, cos, positions[token] * d, d, bf16);
      load_row(s, sin, positions[token] * d, d, bf16);
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
        memcpy((char*)values + to * size, (const char*)qkv + from * size, d * size);
      }
    }
    free(scratch);
  }
  return status;
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
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast") /* products and sums fused where they can be: a fixed choice of the build */

static inline float hsum(vec v) { /* a fixed tree: lane i plus lane i + 8, then + 4, + 2, + 1 */
  v = v + __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v = v + __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v = v + __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
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
    a[k] = __builtin_shuffle(v[order[2 * k]], v[order[2 * k + 1]], (ivec){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[order[2 * k]], v[order[2 * k + 1]], (ivec){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int k = 0; k < 4; k++)
    b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], (ivec){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(a[2 * k], a[2 * k + 1], (ivec){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  for (int k = 0; k < 2; k++)
    c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], (ivec){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(b[2 * k], b[2 * k + 1], (ivec){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  return __builtin_shuffle(c[0], c[1], (ivec){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(c[0], c[1], (ivec){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
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

int specdec_attention(const void* q, int64_t q_row, int64_t q_head, int64_t q_token, const void* keys,
                      const void* values, const void* mask, int64_t m_row, int64_t m_token, void* out, int rows,
                      int heads, int kv_heads, int width, int used, int slots, int d, float scale, float cap, int bf16,
                      int threads) {
  if (d % LANES || heads % kv_heads) return 1;
  int group = heads / kv_heads, per_walk = CHUNK / group > 0 ? CHUNK / group : 1; /* queries a walk serves */
  int tasks = rows * kv_heads, split = 1;
  while (tasks * split < threads && split < width) split++;
  int per_task = (width + split - 1) / split, padded = (used + LANES - 1) / LANES * LANES;
  int status = 0;
#pragma omp parallel num_threads(threads)
  {
    size_t pairs = (size_t)per_walk * group; /* (query, head) pairs a walk serves */
    size_t floats = pairs * (padded + 2 * d) + (size_t)per_walk * padded + (size_t)KEYS * d + 2 * LANES;
    float* buffer = malloc(floats * sizeof(float));
    if (!buffer) {
#pragma omp atomic write
      status = 2;
    }
#pragma omp for schedule(static)
    for (int task = 0; task < tasks * split; task++) {
      if (!buffer) continue;
      int part = task % split, kvh = (task / split) % kv_heads, r = task / split / kv_heads;
      int64_t head_base = ((int64_t)r * kv_heads + kvh) * slots * d;
      float* scores = (float*)(((uintptr_t)buffer + sizeof(vec) - 1) / sizeof(vec) * sizeof(vec));
      float *queries = scores + pairs * padded, *acc = queries + pairs * d, *masks = acc + pairs * d;
      float* block = masks + (size_t)per_walk * padded; /* KEYS keys or values in float32 */
      int end = (part + 1) * per_task < width ? (part + 1) * per_task : width;
      for (int first = part * per_task; first < end; first += per_walk) {
        int count = end - first < per_walk ? end - first : per_walk, n = count * group;
        for (int c = 0; c < count; c++) { /* each query's mask in float32 and its heads' queries */
          load_row(masks + (size_t)c * padded, mask, r * m_row + (first + c) * m_token, used, bf16);
          for (int j = used; j < padded; j++) masks[c * padded + j] = -INFINITY;
          for (int h = 0; h < group; h++)
            load_row(queries + (size_t)(c * group + h) * d, q, r * q_row + (kvh * group + h) * q_head + (first + c) * q_token, d,
                     bf16);
        }
        for (int j0 = 0; j0 < used; j0 += KEYS) { /* scores: scaled, capped, masked; -inf where hidden */
          int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
          load_row(block, keys, head_base + (int64_t)j0 * d, keys_here * d, bf16);
          for (int pair = 0; pair < n; pair += 2) { /* the dot products, each alone */
            const float *a = queries + pair * d, *b = pair + 1 < n ? a + d : a;
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
        for (int pair = 0; pair < n; pair++) { /* scaled, capped, masked: -inf where hidden */
          float *p = scores + (size_t)pair * padded, *m = masks + (size_t)(pair / group) * padded;
          for (int j = 0; j < used; j += LANES) {
            vec v = vload(p + j) * scale, mv = vload(m + j), hidden = (vec){0} - INFINITY;
            if (cap > 0)
              for (int l = 0; l < LANES; l++) v[l] = cap * tanhf(v[l] / cap);
            ivec shown = mv > HIDDEN, x, y;
            vec sum = v + mv;
            memcpy(&x, &sum, sizeof(vec));
            memcpy(&y, &hidden, sizeof(vec));
            x = (x & shown) | (y & ~shown);
            memcpy(p + j, &x, sizeof(vec));
          }
        }
        float sums[CHUNK > group ? CHUNK : group];
        for (int pair = 0; pair < n; pair++) { /* softmax's numerators, in place, and their sum */
          float* p = scores + (size_t)pair * padded;
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
          sums[pair] = most == -INFINITY ? 0.0f : hsum(sum);
        }
        memset(acc, 0, (size_t)n * d * sizeof(float));
        for (int j0 = 0; j0 < used; j0 += KEYS) { /* the weighted values, key after key */
          int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
          load_row(block, values, head_base + (int64_t)j0 * d, keys_here * d, bf16);
          for (int pair = 0; pair < n; pair += 2) {
            const float *pa = scores + (size_t)pair * padded + j0, *pb = pair + 1 < n ? pa + padded : pa;
            int i = 0;
            for (; i + 8 * LANES <= d; i += 8 * LANES) weighted_8(acc + pair * d + i, d, pa, pb, block + i, keys_here, pair + 1 < n);
            for (; i + 4 * LANES <= d; i += 4 * LANES) weighted_4(acc + pair * d + i, d, pa, pb, block + i, keys_here, pair + 1 < n);
            for (; i < d; i += LANES) weighted_1(acc + pair * d + i, d, pa, pb, block + i, keys_here, pair + 1 < n);
          }
        }
        for (int pair = 0; pair < n; pair++) {
          int t = first + pair / group, h = kvh * group + pair % group;
          int64_t to = (((int64_t)r * width + t) * heads + h) * d;
          float inverse = sums[pair] > 0 ? 1.0f / sums[pair] : 0.0f;
          for (int i = 0; i < d; i++) store(out, to + i, acc[pair * d + i] * inverse, bf16);
        }
      }
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
  if (n % LANES || kind < 0 || kind > 1) return 1;
  int chunks = (n + GATED_CHUNK - 1) / GATED_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * chunks > 1)
  for (int task = 0; task < tokens * chunks; task++) {
    int t = task / chunks, from = task % chunks * GATED_CHUNK, to = from + GATED_CHUNK < n ? from + GATED_CHUNK : n;
    float g[LANES] __attribute__((aligned(64))), u[LANES] __attribute__((aligned(64)));
    for (int i = from; i < to; i += LANES) {
      load_row(g, gate_up, (int64_t)t * 2 * n + i, LANES, bf16);
      load_row(u, gate_up, (int64_t)t * 2 * n + n + i, LANES, bf16);
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
      store_row(out, (int64_t)t * n + i, (const float*)&product, LANES, bf16);
    }
  }
  return 0;
}
#pragma GCC pop_options
