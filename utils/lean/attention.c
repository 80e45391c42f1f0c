/* Attention over the static buffer (specdec_attention): every query's attention computed alone (its scores, their
   maximum, its softmax's sum and its output, each in one fixed order over the keys it sees), whatever the number of
   queries in the pass, of keys the pass reads beyond a row's length (a hidden key's weight is exactly zero, and
   adding a zero changes no float32 sum: the buffer holds only finite values) or of threads. So no padding of
   queries or keys is needed (torch's attention kernel blocks queries by their count: `llama.py` pads for it).
   Tensors are float32, or bfloat16 (`bf16` set) stored as uint16; every sum is taken in float32, products and sums
   fused as fused.h says. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"
#include "simd.h"
#include "fused.h"
#include "attention_dots.h"

#define HIDDEN (-1e30f) /* a mask value at or below this hides the key (the runner's masks hold the dtype's minimum) */
/* The walk's sizes: how many (query, head) pairs one walk over the keys and values serves, and how many keys each
   sweep of PAIRS pairs covers (attention_dots.h). Not measured: chosen with the kernel (tenth round, docs/results.md
   "Our layer operations"). The prefetch distance was timed (docs/results.md, "Figures behind the code's rules"). None
   changes the bits (each pair's sums keep their order). */
#define CHUNK 32 /* (query, head) pairs a walk over the keys serves, at least one query's heads */
#define KEYS 32  /* keys (then values) a sweep covers, in L1 for the walk's next PAIRS pairs */
#ifndef ATTENTION_AHEAD /* -DATTENTION_AHEAD=... builds another to time */
#define ATTENTION_AHEAD 16384 /* bytes of keys (values) prefetched into L2 ahead of the sweep */
#endif

/* Prefetches (into L2) the bytes ATTENTION_AHEAD past a block of n elements at offset in a buffer of `end` elements. */
static inline void prefetch_ahead(const void* buffer, int64_t offset, int n, int64_t end, int bf16) {
  int64_t size = bf16 ? 2 : 4, from = offset * size + ATTENTION_AHEAD, to = from + n * size;
  for (int64_t byte = from; byte < to && byte < end * size; byte += 64)
    __builtin_prefetch((const char*)buffer + byte, 0, 2);
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

/* Where a sweep reads a block of KEYS keys (values) of the buffer from `at`: the buffer itself, bfloat16 widened in
   registers, when one sweep serves every pair; else `block`, the block widened to float32 once for the sweeps. */
typedef struct {
  const void* from;
  int64_t at;
  int bf16;
} source_t;

static source_t sweep_source(const attention_t* A, const void* buffer, int64_t at, int keys, int n, float* block) {
  if (!A->bf16 || n <= PAIRS) return (source_t){buffer, at, A->bf16};
  for (int i = 0; i < keys * A->d; i += NATIVE) { /* d is a multiple of LANES */
    nvec x = at_bf16(buffer, at + i);
    memcpy(block + i, &x, sizeof(nvec));
  }
  return (source_t){block, 0, 0};
}

/* scores (n pairs of `padded`) = each (query, head) pair's dot products with the first `used` keys of the key head at
   head_base, each alone (LANES accumulators, then hsum's tree): PAIRS pairs a sweep over KEYS keys. block: KEYS keys
   in float32 where `sweep_source` widens them. */
static void attention_dots(const attention_t* A, const float* queries, float* scores, float* block, int64_t head_base,
                           int n) {
  int d = A->d, used = A->used, padded = A->padded;
  for (int j0 = 0; j0 < used; j0 += KEYS) {
    int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
    prefetch_ahead(A->keys, head_base + (int64_t)j0 * d, keys_here * d, head_base + (int64_t)used * d, A->bf16);
    source_t keys = sweep_source(A, A->keys, head_base + (int64_t)j0 * d, keys_here, n, block);
    int bf16 = keys.bf16;
    int64_t at = keys.at; /* the block's first key */
    for (int pair = 0; pair < n; pair += PAIRS) { /* the dot products, each alone */
      int count = n - pair < PAIRS ? n - pair : PAIRS;
      const float* q = queries + (size_t)pair * d;
      float* s = scores + (size_t)pair * padded + j0;
      int j = 0;
      for (; j + LANES <= keys_here; j += LANES) { /* sixteen keys' scores summed at once */
        vec lanes[PAIRS * LANES]; /* pair h's sixteen keys at lanes[h LANES ...] */
        for (int k = 0; k < LANES; k += 4)
          lanes_x4(bf16, count, q, keys.from, at + (int64_t)(j + k) * d, d, lanes + k, LANES);
        for (int h = 0; h < count; h++) vstore(s + (size_t)h * padded + j, hsum16(lanes + h * LANES));
      }
      for (; j + 4 <= keys_here; j += 4) {
        vec four[PAIRS * 4];
        lanes_x4(bf16, count, q, keys.from, at + (int64_t)j * d, d, four, 4);
        for (int h = 0; h < count; h++)
          for (int key = 0; key < 4; key++) s[(size_t)h * padded + j + key] = hsum(four[4 * h + key]);
      }
      for (int h = 0; h < count; h++)
        for (int key = j; key < keys_here; key++)
          s[(size_t)h * padded + key] = key_dot(bf16, q + (size_t)h * d, keys.from, at + (int64_t)key * d, d);
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
      vec sum = v + mv;
      vstore(p + j, vselect(mv > HIDDEN, sum, hidden));
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
    top = vselect(s > top, s, top);
  }
  float most = -INFINITY;
  for (int l = 0; l < LANES; l++) most = top[l] > most ? top[l] : most;
  /* The sum's lanes follow the visible keys' count, not their slots: the v-th key the query sees goes
     to lane v % LANES, so a tree node's sum (hidden siblings between its ancestors and itself) is the
     sum it gets once accepted and moved next to them. Vectors while every key so far is seen. */
  int seen_all = 1, visible = 0;
  for (int j = 0; j < padded; j += LANES) {
    vec s = vload(p + j), e = vexp(s - most);
    ivec seen = s > -INFINITY;
    e = vselect(seen, e, (vec){0});
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

/* acc (n pairs of d) = the values at head_base weighted by each pair's numerators, key after key: PAIRS pairs a sweep
   over KEYS values. */
static void attention_values(const attention_t* A, const float* scores, float* acc, float* block, int64_t head_base,
                             int n) {
  int d = A->d, used = A->used;
  memset(acc, 0, (size_t)n * d * sizeof(float));
  for (int j0 = 0; j0 < used; j0 += KEYS) {
    int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
    prefetch_ahead(A->values, head_base + (int64_t)j0 * d, keys_here * d, head_base + (int64_t)used * d, A->bf16);
    source_t values = sweep_source(A, A->values, head_base + (int64_t)j0 * d, keys_here, n, block);
    int bf16 = values.bf16;
    int64_t at = values.at;
    for (int pair = 0; pair < n; pair += PAIRS) {
      int count = n - pair < PAIRS ? n - pair : PAIRS;
      const float* ps = scores + (size_t)pair * A->padded + j0;
      float* out = acc + (size_t)pair * d;
      int i = 0;
      for (; i + WEIGHTED_NV * NATIVE <= d; i += WEIGHTED_NV * NATIVE)
        weighted_x(bf16, count, out + i, d, ps, A->padded, values.from, at + i, keys_here);
      for (; i < d; i += NATIVE)
        for (int h = 0; h < count; h++)
          weighted_one(bf16, out + (size_t)h * d + i, d, ps + (size_t)h * A->padded, values.from, at + i, keys_here);
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
  float* block = masks + pairs / group * padded; /* KEYS keys or values in float32 (sweep_source) */
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
