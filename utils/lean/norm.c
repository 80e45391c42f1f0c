/* RMSNorm, with the residual addition before it (specdec_rms_norm): one call where torch's eager steps take
   several (each ~5-10 us of dispatch on a one-token pass). Tensors are float32, or bfloat16 (`bf16` set) stored as
   uint16; every sum is taken in float32. Where torch's eager steps round between operations (bfloat16), the same
   roundings are made here, so the norm's last multiplication gives torch's bits; the sum of squares is taken in an
   order of its own (LANES accumulators, then a fixed tree), one token at a time: the same bits whatever the pass's
   width or thread count. */
#include <math.h>
#include <stdlib.h>

#include "simd.h"
#include "specdec.h"

/* One token's norm (x, its delta and the weight in float32 in row[0..n), row[n..2n), row[2n..3n)). */
static void norm_token(void* x, const void* delta, void* out, float* row, int64_t base, int n, float eps,
                       int plus_one, int bf16) {
  float *more = row + n, *w = row + 2 * n;
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
      norm_token(x, delta, out, row, (int64_t)t * n, n, eps, plus_one, bf16);
    }
    free(row);
  }
  return status;
}
