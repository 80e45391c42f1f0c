/* Attention over the static buffer (specdec_attention): every query's attention computed alone (its scores, their
   maximum, its softmax's sum and its output, each in one fixed order over the keys it sees), whatever the number of
   queries in the pass, of keys the pass reads beyond a row's length (a hidden key's weight is exactly zero, and
   adding a zero changes no float32 sum: the buffer holds only finite values) or of threads. So no padding of
   queries or keys is needed (torch's attention kernel blocks queries by their count: `llama.py` pads for it).
   Threads take whole (row, key head) tasks, their queries split among them where there are fewer tasks than threads;
   where that leaves a thread idle or busier than the rest (one query over fewer key heads than threads: a one-token
   pass over a long buffer, Gemma 3's single key head, three key heads on two threads), a team of threads shares each
   walk instead (attention_spread: its keys, then its pairs, then slices of its values), with the same bits.
   Tensors are float32, or bfloat16 (`bf16` set) stored as uint16; every sum is taken in float32, products and sums
   fused as fused.h says. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"
#include "simd.h"
#include "fused.h"
#include "attention_dots.h"

#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

#define HIDDEN (-1e30f) /* a mask value at or below this hides the key (the runner's masks hold the dtype's minimum) */
/* The walk's sizes: how many (query, head) pairs one walk over the keys and values serves, and how many keys each
   sweep of PAIRS pairs covers (attention_dots.h). Not measured: chosen with the kernel (tenth round, docs/results.md
   "Our layer operations"). The prefetch distance was timed (docs/results.md, "Figures behind the code's rules"). None
   changes the bits (each pair's sums keep their order). */
#define CHUNK 32 /* (query, head) pairs a walk over the keys serves, at least one query's heads */
#define KEYS 32  /* keys (then values) a sweep covers, in L1 for the walk's next PAIRS pairs */
/* Where threads share walks (attention_spread), a thread's share of a walk's keys is at least this many KEYS blocks
   where OpenMP's idle threads sleep (OMP_WAIT_POLICY=passive, as utils/threads.py sets beside other work: each of its
   two barriers more then costs a wake-up), one block where they spin. On a 2-vCPU Zen 4, one query over one key head
   (Gemma 3 270M's 4 x 256, 18 layers' cold buffers, alternated both ways): with spinning threads the team ran
   1.19-1.34x whole walks at 64 and 256 keys, 1.5-1.8x at 512 to 16,384; with sleeping ones 0.64-0.73x at 64 keys,
   0.83-0.97x at 512, 0.99-1.15x at 1,024, 1.17-1.43x at 2,048 (thirtieth round, docs/results.md). It does not change
   the bits. */
#ifndef MIN_SPREAD_BLOCKS /* -DMIN_SPREAD_BLOCKS=... builds another to time */
#define MIN_SPREAD_BLOCKS 16
#endif
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

/* scores (n pairs of `padded`) = each (query, head) pair's dot products with keys from..to - 1 (from a multiple of
   KEYS) of the key head at head_base, each alone (LANES accumulators, then hsum's tree): PAIRS pairs a sweep over
   KEYS keys. block: KEYS keys in float32 where `sweep_source` widens them. A key's score is the same bits in any
   range that holds it: its block's keys take the same steps. */
static void attention_dots(const attention_t* A, const float* queries, float* scores, float* block, int64_t head_base,
                           int n, int from, int to) {
  int d = A->d, padded = A->padded;
  for (int j0 = from; j0 < to; j0 += KEYS) {
    int keys_here = to - j0 < KEYS ? to - j0 : KEYS;
    prefetch_ahead(A->keys, head_base + (int64_t)j0 * d, keys_here * d, head_base + (int64_t)to * d, A->bf16);
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

/* One pair's scores p scaled, capped, plus its query's mask m (`padded` values): -inf where hidden. */
static void mask_scores(const attention_t* A, float* p, const float* m) {
  for (int j = 0; j < A->used; j += LANES) {
    vec v = vload(p + j) * A->scale, mv = vload(m + j), hidden = (vec){0} - INFINITY;
    if (A->cap > 0)
      for (int l = 0; l < LANES; l++) v[l] = A->cap * tanhf(v[l] / A->cap);
    vec sum = v + mv;
    vstore(p + j, vselect(mv > HIDDEN, sum, hidden));
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

/* Prefetches (into L2) elements lo..hi - 1 of the rows of `keys` keys (values) from key j0, ATTENTION_AHEAD bytes of
   whole rows ahead: a slice's own lines only (another thread reads the rest into its own cache). */
static void prefetch_slice(const attention_t* A, const void* buffer, int64_t head_base, int j0, int keys, int lo,
                           int hi) {
  int64_t size = A->bf16 ? 2 : 4, row = A->d * size, ahead = ATTENTION_AHEAD / row + 1;
  for (int64_t j = j0 + ahead; j < j0 + ahead + keys && j < A->used; j++)
    for (int64_t byte = lo * size; byte < hi * size; byte += 64)
      __builtin_prefetch((const char*)buffer + (head_base + j * A->d) * size + byte, 0, 2);
}

/* acc (n pairs of d; elements lo..hi - 1, multiples of NATIVE) = the values at head_base weighted by each pair's
   numerators, key after key: PAIRS pairs a sweep over KEYS values. Each output element is one chain over the keys,
   the same bits whichever of these loops takes it. */
static void attention_values(const attention_t* A, const float* scores, float* acc, float* block, int64_t head_base,
                             int n, int lo, int hi) {
  int d = A->d, used = A->used;
  for (int pair = 0; pair < n; pair++) memset(acc + (size_t)pair * d + lo, 0, (size_t)(hi - lo) * sizeof(float));
  for (int j0 = 0; j0 < used; j0 += KEYS) {
    int keys_here = used - j0 < KEYS ? used - j0 : KEYS;
    if (lo == 0 && hi == d)
      prefetch_ahead(A->values, head_base + (int64_t)j0 * d, keys_here * d, head_base + (int64_t)used * d, A->bf16);
    else
      prefetch_slice(A, A->values, head_base, j0, keys_here, lo, hi);
    source_t values = sweep_source(A, A->values, head_base + (int64_t)j0 * d, keys_here, n, block);
    int bf16 = values.bf16;
    int64_t at = values.at;
    for (int pair = 0; pair < n; pair += PAIRS) {
      int count = n - pair < PAIRS ? n - pair : PAIRS;
      const float* ps = scores + (size_t)pair * A->padded + j0;
      float* out = acc + (size_t)pair * d;
      int i = lo;
      for (; i + WEIGHTED_NV * NATIVE <= hi; i += WEIGHTED_NV * NATIVE)
        weighted_x(bf16, count, out + i, d, ps, A->padded, values.from, at + i, keys_here);
      for (; i < hi; i += NATIVE)
        for (int h = 0; h < count; h++)
          weighted_one(bf16, out + (size_t)h * d + i, d, ps + (size_t)h * A->padded, values.from, at + i, keys_here);
    }
  }
}

/* Elements lo..hi - 1 of n pairs' outputs (queries first.. of row r, the query heads of key head kvh): acc over their
   numerators' sums. */
static void store_outputs(const attention_t* A, const float* acc, const float* sums, int r, int kvh, int first, int n,
                          int lo, int hi) {
  for (int pair = 0; pair < n; pair++) {
    int t = first + pair / A->group, h = kvh * A->group + pair % A->group;
    int64_t to = (((int64_t)r * A->width + t) * A->heads + h) * A->d;
    float inverse = sums[pair] > 0 ? 1.0f / sums[pair] : 0.0f;
    for (int i = lo; i < hi; i++) store(A->out, to + i, acc[(size_t)pair * A->d + i] * inverse, A->bf16);
  }
}

/* Query t of row r's mask in float32 (`padded` values, -inf past `used`). */
static void load_mask(const attention_t* A, float* mask, int r, int t) {
  load_row(mask, A->mask, r * A->m_row + t * A->m_token, A->used, A->bf16);
  for (int j = A->used; j < A->padded; j++) mask[j] = -INFINITY;
}

/* The query heads of key head kvh for queries first..first + count - 1 of row r, in float32. */
static void load_queries(const attention_t* A, float* queries, int r, int kvh, int first, int count) {
  for (int c = 0; c < count; c++)
    for (int h = 0; h < A->group; h++)
      load_row(queries + (size_t)(c * A->group + h) * A->d, A->q,
               r * A->q_row + (int64_t)(kvh * A->group + h) * A->q_head + (first + c) * A->q_token, A->d, A->bf16);
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
  for (int c = 0; c < count; c++) load_mask(A, masks + (size_t)c * padded, r, first + c);
  load_queries(A, queries, r, kvh, first, count);
  attention_dots(A, queries, scores, block, head_base, n, 0, A->used);
  float sums[CHUNK > group ? CHUNK : group];
  for (int pair = 0; pair < n; pair++) {
    mask_scores(A, scores + (size_t)pair * padded, masks + (size_t)(pair / group) * padded);
    sums[pair] = softmax_numerators(scores + (size_t)pair * padded, A->used, padded);
  }
  attention_values(A, scores, acc, block, head_base, n, 0, d);
  store_outputs(A, acc, sums, r, kvh, first, n, 0, d);
}

/* ---- a team of threads on each walk: where whole walks would leave a thread idle (one query, fewer key heads than
   threads: a one-token pass) or one busier than the rest (three key heads on two threads) ---- */

/* Elements of a head's output a thread's share of the values covers: 128 bytes of a bfloat16 row, a pair of lines
   (on a 2-vCPU Zen 4, slices of 64 bytes ran 0.89-0.94x as fast: a line's neighbour is fetched with it, into the
   other thread's cache too); a whole number of WEIGHTED_NV sweeps in every build. */
#define SLICE 64

typedef struct {
  int r, kvh, first, count;
  size_t at; /* its first pair among all the walks' pairs */
} walk_t;

/* The walks of specdec_attention (row, key head, queries first..first + count - 1), the team's `threads` on each:
   its keys' scores in `threads` ranges of whole KEYS blocks; each pair's mask and softmax alone; its values' weighted
   sum in slices of SLICE elements of the head. Each step computes what attention_walk computes, on the same inputs
   and in the same order, so the bits are its bits. Two barriers more than whole walks take (after the scores, after
   the softmax). -> SPECDEC_OK or SPECDEC_NO_MEMORY. */
static int attention_spread(const attention_t* A, int rows, int per_walk, int threads) {
  int d = A->d, group = A->group, padded = A->padded, per_task = (A->width + per_walk - 1) / per_walk;
  int walks = rows * A->kv_heads * per_task, blocks = (A->used + KEYS - 1) / KEYS, slices = (d + SLICE - 1) / SLICE;
  walk_t* walk = malloc((size_t)walks * sizeof(walk_t));
  if (!walk) return SPECDEC_NO_MEMORY;
  size_t pairs = 0;
  for (int w = 0; w < walks; w++) {
    int task = w / per_task, first = w % per_task * per_walk;
    int count = A->width - first < per_walk ? A->width - first : per_walk;
    walk[w] = (walk_t){task / A->kv_heads, task % A->kv_heads, first, count, pairs};
    pairs += (size_t)count * group;
  }
  /* Shared: every pair's scores, outputs and sum. A thread's own: a block of keys in float32 (sweep_source), a walk's
     queries, a query's mask; each a whole number of vectors. */
  size_t own = ((size_t)KEYS * d + (size_t)per_walk * group * d + padded + LANES - 1) / LANES * LANES;
  float* shared = malloc((pairs * (padded + (size_t)d + 1) + threads * own + 2 * LANES) * sizeof(float));
  if (!shared) {
    free(walk);
    return SPECDEC_NO_MEMORY;
  }
  float* scores = (float*)(((uintptr_t)shared + sizeof(vec) - 1) / sizeof(vec) * sizeof(vec));
  float *acc = scores + pairs * padded, *scratch = acc + pairs * d, *sums = scratch + threads * own;
#pragma omp parallel num_threads(threads)
  {
    float* block = scratch + THREAD_NUM() * own;
    float *queries = block + (size_t)KEYS * d, *mask = queries + (size_t)per_walk * group * d;
#pragma omp for schedule(static, 1) /* piece p of each walk to thread p */
    for (int64_t u = 0; u < (int64_t)walks * threads; u++) {
      const walk_t* W = &walk[u / threads];
      int p = (int)(u % threads), from = blocks * p / threads * KEYS, to = blocks * (p + 1) / threads * KEYS;
      int64_t head_base = ((int64_t)W->r * A->kv_heads + W->kvh) * A->slots * d;
      load_queries(A, queries, W->r, W->kvh, W->first, W->count);
      attention_dots(A, queries, scores + W->at * padded, block, head_base, W->count * group, from,
                     to < A->used ? to : A->used);
    }
#pragma omp for schedule(static, 1)
    for (size_t pair = 0; pair < pairs; pair++) {
      int w = 0;
      while (w + 1 < walks && walk[w + 1].at <= pair) w++;
      load_mask(A, mask, walk[w].r, walk[w].first + (int)((pair - walk[w].at) / group));
      mask_scores(A, scores + pair * padded, mask);
      sums[pair] = softmax_numerators(scores + pair * padded, A->used, padded);
    }
#pragma omp for schedule(static) nowait /* a thread's slices side by side */
    for (int64_t u = 0; u < (int64_t)walks * slices; u++) {
      const walk_t* W = &walk[u / slices];
      int lo = (int)(u % slices) * SLICE, hi = lo + SLICE < d ? lo + SLICE : d, n = W->count * group;
      int64_t head_base = ((int64_t)W->r * A->kv_heads + W->kvh) * A->slots * d;
      attention_values(A, scores + W->at * padded, acc + W->at * d, block, head_base, n, lo, hi);
      store_outputs(A, acc + W->at * d, sums + W->at, W->r, W->kvh, W->first, n, lo, hi);
    }
  }
  free(shared);
  free(walk);
  return SPECDEC_OK;
}

/* Whether OpenMP's idle threads sleep rather than spin: OMP_WAIT_POLICY=passive, read as OpenMP reads it. */
static int threads_sleep(void) {
  static int sleeping = -1; /* read once (a caller that reads it again writes the same value) */
  if (sleeping < 0) {
    const char *policy = getenv("OMP_WAIT_POLICY"), *passive = "passive";
    int same = policy != NULL;
    for (int i = 0; same && (policy[i] || passive[i]); i++) same = (policy[i] | 32) == passive[i]; /* any case */
    sleeping = same;
  }
  return sleeping;
}

/* The queries split `split` ways within each of `tasks` whole (row, key head) tasks, as OpenMP's static schedule deals
   the parts to `threads` threads: the busiest thread's queries (each part counted at its largest). */
static int64_t busiest(int64_t tasks, int width, int split, int threads) {
  int64_t parts = tasks * split;
  return (parts + threads - 1) / threads * ((width + split - 1) / split);
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
  /* Whole tasks, their queries split the way that leaves the busiest thread the fewest; else a team of threads on
     each walk, as many as get `least` of its keys each, where its share is less than that busiest's. */
  int64_t tasks = (int64_t)rows * kv_heads, split = 1;
  for (int s = 2; s <= width && busiest(tasks, width, (int)split, threads) * threads > tasks * width; s++)
    if (busiest(tasks, width, s, threads) < busiest(tasks, width, (int)split, threads)) split = s;
  int least = (threads_sleep() ? MIN_SPREAD_BLOCKS : 1) * KEYS;
  int team = used / least < threads ? used / least : threads;
  if (team > 1 && tasks * width < busiest(tasks, width, (int)split, threads) * team)
    return attention_spread(&A, rows, per_walk, team);
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
