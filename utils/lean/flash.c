/* A prompt's attention over itself (specdec_flash_attention): one row's `width` new queries at positions
   start..start + width - 1, each over the keys up to its own position, blocked as FlashAttention does (Dao et al.
   2022, its online softmax): the keys and values of a key head are packed once a call, then each task (a key head's
   QUERY_BLOCK queries with every query head it serves, `rows` of scores) walks the key blocks its queries see, scores
   a block (rows x KEY_BLOCK, SROWS rows at a time in registers), folds it into a running maximum and sum per row, and adds the block's
   weighted values to the row's output, rescaled as the maximum grows. No score matrix over the whole prompt is held.

   Where this CPU has bfloat16 arithmetic (AVX512_BF16) both products take VDPBF16PS (pairs of bfloat16 products
   summed in float32), the weights e^(s - max) rounded to bfloat16 first, as torch's blocked kernel rounds them; else
   the same walk in float32 over the widened bfloat16 (any CPU, the layer operations' vectors, simd.h). Which of this
   and torch's kernel runs a prompt is measured on the machine (`utils/lean/flash.py`).

   Each query's output depends on its own position and keys only (its key blocks are aligned to slot 0 and walked in
   order; a block past its position changes nothing: a maximum of nothing, a weight of zero): the same bits whatever
   the prompt's width, its task or the thread count. bfloat16 only (stored as uint16); the tail of a block past the
   last key is packed as zeros. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "specdec.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAIR 2 /* a packed block's elements in pairs along the product's sum: VDPBF16PS's operands */
#else
#define PAIR 1
#endif

#include "fused.h"

/* The blocking, timed on a 2-vCPU AMD EPYC (Zen 4) at 512 to 4,096 tokens of the 1.5B's heads (twenty-ninth round,
   docs/results.md): key blocks of 64 ran 1.03-1.06x blocks of 32 (half the output's reloads a key); 8, 16 and 32
   queries a task within the runs' noise. None changes a query's bits but KEY_BLOCK (its blocks start at slot 0
   whatever the task). */
#ifndef KEY_BLOCK /* -DKEY_BLOCK=... builds another to time */
#define KEY_BLOCK 64 /* keys a block: KV vectors of scores a row */
#endif
#ifndef QUERY_BLOCK
#define QUERY_BLOCK 16 /* queries a task (times the query heads of a key head: a task's rows) */
#endif
#define KV (KEY_BLOCK / LANES)
#define SROWS (16 / KV) /* rows a register block of scores holds: SROWS x KV accumulators (the first product) */
#define ROWS 8          /* rows a register block of the second product holds: ROWS x 2 accumulators of DIMS */
#define DIMS 32         /* a row's output dimensions a register block of the second product holds */

typedef struct {
  const uint16_t *q, *keys, *values;
  uint16_t* out;
  int64_t q_head, q_token;
  int heads, kv_heads, width, start, used, slots, d, blocks; /* used = start + width keys; blocks of KEY_BLOCK */
  float scale;
} flash_t;

/* The packed copies: keys [block][d / PAIR][KEY_BLOCK][PAIR], values [block][KEY_BLOCK / PAIR][d][PAIR]. */
static size_t block_elements(const flash_t* F) { return (size_t)KEY_BLOCK * F->d; }

static void pack_block(const flash_t* F, int kvh, int b, uint16_t* kp, uint16_t* vp) {
  int d = F->d;
  const uint16_t* keys = F->keys + (int64_t)kvh * F->slots * d;
  const uint16_t* values = F->values + (int64_t)kvh * F->slots * d;
  for (int j = 0; j < KEY_BLOCK; j++) {
    int64_t key = (int64_t)b * KEY_BLOCK + j;
    for (int i = 0; i < d; i++) {
      uint16_t k = key < F->used ? keys[key * d + i] : 0, v = key < F->used ? values[key * d + i] : 0;
      kp[((size_t)(i / PAIR) * KEY_BLOCK + j) * PAIR + i % PAIR] = k;
      vp[((size_t)(j / PAIR) * d + i) * PAIR + j % PAIR] = v;
    }
  }
}

/* s (SROWS x KEY_BLOCK) = each of SROWS query rows dotted with the block's keys, summed in float32. */
static void score_rows(const flash_t* F, const uint16_t* const* q, const uint16_t* kp, float* s) {
  int d = F->d;
#if PAIR == 2
  __m512 acc[SROWS][KV];
  for (int r = 0; r < SROWS; r++)
    for (int v = 0; v < KV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int i = 0; i < d / 2; i++) {
    __m512bh k[KV];
    for (int v = 0; v < KV; v++) k[v] = (__m512bh)_mm512_loadu_si512((const void*)(kp + ((size_t)i * KEY_BLOCK + 16 * v) * 2));
    for (int r = 0; r < SROWS; r++) {
      int32_t two;
      memcpy(&two, q[r] + 2 * i, sizeof two);
      __m512bh x = (__m512bh)_mm512_set1_epi32(two);
      for (int v = 0; v < KV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, k[v]);
    }
  }
  for (int r = 0; r < SROWS; r++)
    for (int v = 0; v < KV; v++) _mm512_storeu_ps(s + r * KEY_BLOCK + 16 * v, acc[r][v]);
#else
  vec acc[SROWS][KV] = {{{0}}};
  for (int i = 0; i < d; i++) {
    vec k[KV];
    for (int v = 0; v < KV; v++)
      k[v] = widen(hload(kp + (size_t)i * KEY_BLOCK + LANES * v));
    for (int r = 0; r < SROWS; r++) {
      float x = bf16_to_f32(q[r][i]);
      for (int v = 0; v < KV; v++) acc[r][v] = x * k[v] + acc[r][v];
    }
  }
  for (int r = 0; r < SROWS; r++)
    for (int v = 0; v < KV; v++) vstore(s + r * KEY_BLOCK + LANES * v, acc[r][v]);
#endif
}

/* o (ROWS rows of d) = o * alpha + p v: each row's output rescaled and the block's values weighted by its p (ROWS x
   KEY_BLOCK, bfloat16), DIMS dimensions at a time. */
static void weigh_rows(const flash_t* F, const uint16_t* p, const uint16_t* vp, const float* alpha, float* o) {
  int d = F->d;
  for (int i0 = 0; i0 < d; i0 += DIMS) {
#if PAIR == 2
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) {
      __m512 a = _mm512_set1_ps(alpha[r]);
      acc[r][0] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * d + i0), a);
      acc[r][1] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)r * d + i0 + 16), a);
    }
    for (int j = 0; j < KEY_BLOCK / 2; j++) {
      const uint16_t* v = vp + ((size_t)j * d + i0) * 2;
      __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void*)v), v1 = (__m512bh)_mm512_loadu_si512((const void*)(v + 32));
      for (int r = 0; r < ROWS; r++) {
        int32_t two;
        memcpy(&two, p + r * KEY_BLOCK + 2 * j, sizeof two);
        __m512bh x = (__m512bh)_mm512_set1_epi32(two);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, v1);
      }
    }
    for (int r = 0; r < ROWS; r++) {
      _mm512_storeu_ps(o + (size_t)r * d + i0, acc[r][0]);
      _mm512_storeu_ps(o + (size_t)r * d + i0 + 16, acc[r][1]);
    }
#else
    vec acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) {
      acc[r][0] = vload(o + (size_t)r * d + i0) * alpha[r];
      acc[r][1] = vload(o + (size_t)r * d + i0 + LANES) * alpha[r];
    }
    for (int j = 0; j < KEY_BLOCK; j++) {
      const uint16_t* v = vp + (size_t)j * d + i0;
      vec v0 = widen(hload(v));
      vec v1 = widen(hload(v + LANES));
      for (int r = 0; r < ROWS; r++) {
        float x = bf16_to_f32(p[r * KEY_BLOCK + j]);
        acc[r][0] = x * v0 + acc[r][0];
        acc[r][1] = x * v1 + acc[r][1];
      }
    }
    for (int r = 0; r < ROWS; r++) {
      vstore(o + (size_t)r * d + i0, acc[r][0]);
      vstore(o + (size_t)r * d + i0 + LANES, acc[r][1]);
    }
#endif
  }
}

static inline float hmax(vec v) { /* the largest lane (a fixed tree, as hsum's) */
  vec w = SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = vselect(v > w, v, w);
  w = SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = vselect(v > w, v, w);
  w = SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = vselect(v > w, v, w);
  w = SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0] > w[0] ? v[0] : w[0];
}

/* One row's block of scores folded into its running maximum and sum: p = e^(s scale - max) rounded to bfloat16
   (0 for a key past `last`, the row's last visible key in this block, or for every key where last < 0), alpha =
   e^(old max - new max) for its output (exactly 1 where the maximum stays), the sum kept in LANES lanes (summed once,
   at the end). */
static void fold_row(const float* s, int last, float scale, float* most, vec* sum, uint16_t* p, float* alpha) {
  if (last < 0) { /* the row sees none of this block: nothing changes */
    memset(p, 0, KEY_BLOCK * sizeof(uint16_t));
    *alpha = 1.0f;
    return;
  }
  const vec lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, hidden = (vec){0} - INFINITY;
  vec x[KV], high = hidden;
  for (int h = 0; h < KV; h++) x[h] = vload(s + h * LANES) * scale;
  if (last < KEY_BLOCK - 1) /* the diagonal's block: the keys past the row's position hidden */
    for (int h = 0; h < KV; h++) x[h] = vselect(lanes + (float)(h * LANES) <= (float)last, x[h], hidden);
  for (int h = 0; h < KV; h++) high = vselect(x[h] > high, x[h], high);
  float top = hmax(high);
  top = top > *most ? top : *most;
  *alpha = top == *most ? 1.0f : *most == -INFINITY ? 0.0f : vexp((vec){0} + (*most - top))[0]; /* no call: a call
                                                                                                  spills every vector */
  vec total = *sum * *alpha;
  for (int h = 0; h < KV; h++) {
    vec e = vselect(x[h] > hidden, vexp(x[h] - top), (vec){0});
#if PAIR == 2
    hvec rounded = (hvec)_mm512_cvtneps_pbh(e); /* to_bf16's rounding for these (finite) values, in one instruction */
#else
    hvec rounded = to_bf16(e);
#endif
    hstore(p + h * LANES, rounded);
    total = total + widen(rounded);
  }
  *sum = total;
  *most = top;
}

/* Task (kvh, block qb): QUERY_BLOCK queries from qb * QUERY_BLOCK with every query head of key head kvh. Row r is
   query r / group, head r % group; rows past the last query (and the padding to ROWS) read a zero query. */
static void flash_task(const flash_t* F, const uint16_t* kpacked, const uint16_t* vpacked, int kvh, int qb,
                       float* scratch, const uint16_t* zeros) {
  int d = F->d, group = F->heads / F->kv_heads;
  int first = qb * QUERY_BLOCK, count = F->width - first < QUERY_BLOCK ? F->width - first : QUERY_BLOCK;
  int rows = count * group, padded = (rows + ROWS - 1) / ROWS * ROWS;
  vec* sum = (vec*)(((uintptr_t)scratch + sizeof(vec) - 1) / sizeof(vec) * sizeof(vec)); /* each row's lanes */
  float *o = (float*)(sum + padded), *s = o + (size_t)padded * d, *most = s + (size_t)padded * KEY_BLOCK;
  float* alpha = most + padded;
  uint16_t* p = (uint16_t*)(alpha + padded);
  const uint16_t* q[QUERY_BLOCK * 8 + ROWS]; /* checked: group <= 8 (specdec_flash_attention) */
  for (int r = 0; r < padded; r++) {
    q[r] = r < rows ? F->q + (int64_t)(kvh * group + r % group) * F->q_head + (int64_t)(first + r / group) * F->q_token
                    : zeros;
    most[r] = -INFINITY;
    sum[r] = (vec){0};
  }
  memset(o, 0, (size_t)padded * d * sizeof(float));
  int last_position = F->start + first + count - 1, blocks = last_position / KEY_BLOCK + 1;
  for (int b = 0; b < blocks; b++) {
    const uint16_t* kp = kpacked + ((size_t)kvh * F->blocks + b) * block_elements(F);
    const uint16_t* vp = vpacked + ((size_t)kvh * F->blocks + b) * block_elements(F);
    for (int r0 = 0; r0 < padded; r0 += SROWS) score_rows(F, q + r0, kp, s + (size_t)r0 * KEY_BLOCK);
    for (int r = 0; r < padded; r++) {
      int position = r < rows ? F->start + first + r / group : -1;
      int last = position - b * KEY_BLOCK;
      fold_row(s + (size_t)r * KEY_BLOCK, last < KEY_BLOCK ? last : KEY_BLOCK - 1, F->scale, most + r, sum + r,
               p + (size_t)r * KEY_BLOCK, alpha + r);
    }
    for (int r0 = 0; r0 < padded; r0 += ROWS)
      weigh_rows(F, p + (size_t)r0 * KEY_BLOCK, vp, alpha + r0, o + (size_t)r0 * d);
  }
  for (int r = 0; r < rows; r++) {
    int t = first + r / group, h = kvh * group + r % group;
    uint16_t* to = F->out + ((int64_t)t * F->heads + h) * d;
    float total = hsum(sum[r]);
    for (int i = 0; i < d; i += LANES) hstore(to + i, to_bf16(vload(o + (size_t)r * d + i) / total));
  }
}

/* specdec_flash_attention: q (heads, width, d) at strides q_head, q_token (1 along d), keys and values (kv_heads,
   slots, d) contiguous, out (width, heads, d); all bfloat16. SPECDEC_BAD_SHAPE for d not a positive multiple of
   DIMS, query heads not 1 to 8 times the key heads, a negative width or start; SPECDEC_BAD_INDEX where start +
   width exceeds the slots. Then SPECDEC_NO_MEMORY or OK. */
int specdec_flash_attention(const void* q, int64_t q_head, int64_t q_token, const void* keys, const void* values,
                            void* out, int heads, int kv_heads, int width, int start, int slots, int d, float scale,
                            int threads) {
  if (d < 1 || d % DIMS || kv_heads < 1 || heads < kv_heads || heads % kv_heads || heads / kv_heads > 8 || width < 0 ||
      start < 0 || slots < 0)
    return SPECDEC_BAD_SHAPE;
  if ((int64_t)start + width > slots) return SPECDEC_BAD_INDEX;
  if (width == 0) return SPECDEC_OK;
  int used = start + width, blocks = (used + KEY_BLOCK - 1) / KEY_BLOCK;
  flash_t F = {q, keys, values, out, q_head, q_token, heads, kv_heads, width, start, used, slots, d, blocks, scale};
  int group = heads / kv_heads, padded = (QUERY_BLOCK * group + ROWS - 1) / ROWS * ROWS;
  size_t packed = (size_t)kv_heads * blocks * block_elements(&F);
  size_t floats = (size_t)padded * ((size_t)d + KEY_BLOCK + 2 + LANES) + (size_t)padded * KEY_BLOCK / 2 + LANES;
  uint16_t *kpacked = malloc(2 * packed * sizeof(uint16_t)), *zeros = calloc((size_t)d, sizeof(uint16_t));
  if (!kpacked || !zeros) {
    free(kpacked);
    free(zeros);
    return SPECDEC_NO_MEMORY;
  }
  uint16_t* vpacked = kpacked + packed;
  threads = threads > 0 ? threads : 1;
  int tasks_per_head = (width + QUERY_BLOCK - 1) / QUERY_BLOCK, status = SPECDEC_OK;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < (int64_t)kv_heads * blocks; task++)
      pack_block(&F, (int)(task / blocks), (int)(task % blocks),
                 kpacked + (size_t)task * block_elements(&F), vpacked + (size_t)task * block_elements(&F));
    float* scratch = malloc(floats * sizeof(float));
    if (!scratch) {
#pragma omp atomic write
      status = SPECDEC_NO_MEMORY;
    }
    /* the last query blocks (the most keys) first, each task taken by the next free thread */
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)kv_heads * tasks_per_head; task++) {
      if (!scratch) continue;
      int qb = tasks_per_head - 1 - (int)(task / kv_heads), kvh = (int)(task % kv_heads);
      flash_task(&F, kpacked, vpacked, kvh, qb, scratch, zeros);
    }
    free(scratch);
  }
  free(kpacked);
  free(zeros);
  return status;
}
