/* The rotary embedding with the keys' and values' write into the static buffer (specdec_rope_write_checked): one
   call where torch's eager steps take several. Tensors are float32, or bfloat16 (`bf16` set) stored as uint16;
   each product and sum is rounded to the dtype as torch's eager steps round it, so the rotated values are torch's
   bits. One token at a time: the same bits whatever the pass's width or thread count. A partial rotary step
   (Phi-4-mini's `partial_rotary_factor`) turns each head's first `rotary` dimensions, its tables that wide, and
   passes the rest as they are, as transformers' `apply_rotary_pos_emb` does for such a model. */
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "specdec.h"

/* One head's rotary embedding, transformers' x cos + rotate_half(x) sin over its first `rotary` of d dimensions
   (the rest copied), each product and the sum rounded to the dtype as torch's eager steps are. */
static inline void rotate(const float* x, const float* c, const float* s, float* y, int d, int rotary, int bf16) {
  int half = rotary / 2, i = 0;
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
  memcpy(y + rotary, x + rotary, (size_t)(d - rotary) * sizeof(float));
}

/* One token's rotary step and write (see below): its heads of qkv (`stride` values a token) rotated, the queries to
   q_out, the keys and the values (copied) to the buffer's `slot` of row r. scratch: 4 d floats. */
static void rope_token(const void* qkv, const void* cos, const void* sin, int64_t position, int64_t slot, int64_t token,
                       int64_t r, void* q_out, void* keys, void* values, int heads, int kv_heads, int slots, int d,
                       int rotary, int bf16, float* scratch) {
  int64_t stride = (int64_t)(heads + 2 * kv_heads) * d;
  size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
  float *x = scratch, *y = scratch + d, *c = scratch + 2 * d, *s = scratch + 3 * d;
  load_row(c, cos, position * rotary, rotary, bf16);
  load_row(s, sin, position * rotary, rotary, bf16);
  for (int h = 0; h < heads + kv_heads; h++) {
    load_row(x, qkv, token * stride + (int64_t)h * d, d, bf16);
    rotate(x, c, s, y, d, rotary, bf16);
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
   (table_rows, rotary), read at `positions` (rows, width); `rotary`: the dimensions of a head they turn (even, at
   most d; d: whole heads). Every slot is checked to lie in [0, slots) and every position in [0, table_rows) before
   anything is written: SPECDEC_BAD_INDEX where one does not. */
int specdec_rope_write_checked(const void* qkv, const void* cos, const void* sin, int64_t table_rows,
                               const int64_t* positions, const int64_t* write_index, void* q_out, void* keys,
                               void* values, int rows, int width, int heads, int kv_heads, int slots, int d, int rotary,
                               int bf16, int threads) {
  if (d < 2 || d % 2 || rotary < 2 || rotary % 2 || rotary > d || rows < 0 || width < 0 || heads < 0 ||
      kv_heads < 0 || slots < 0 || table_rows < 0)
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
                 heads, kv_heads, slots, d, rotary, bf16, scratch);
    }
    free(scratch);
  }
  return status;
}

/* The same without the table's length, over whole heads: slots checked, positions only for >= 0 (the caller vouches
   for the rest). Kept for callers built before specdec_rope_write_checked. */
int specdec_rope_write(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                       const int64_t* write_index, void* q_out, void* keys, void* values, int rows, int width,
                       int heads, int kv_heads, int slots, int d, int bf16, int threads) {
  return specdec_rope_write_checked(qkv, cos, sin, INT64_MAX, positions, write_index, q_out, keys, values, rows,
                                    width, heads, kv_heads, slots, d, d, bf16, threads);
}
