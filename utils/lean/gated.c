/* act(gate) * up (specdec_gated): silu or gelu's tanh approximation, then the product, each rounded to the dtype as
   torch's two eager steps round them. Products and sums fused as fused.h says. */
#include "specdec.h"
#include "simd.h"
#include "fused.h"

/* gelu's tanh approximation, torch's constants (the formula's, not tuned). */
#define GELU_SCALE 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_CUBIC 0.044715f
/* Values a task serves (a token's row split so that a few wide tokens still spread over the threads). Not
   measured: chosen with the kernel (eighteenth round, docs/results.md "The Gemma family"); no other value timed.
   It does not change the bits (each value alone). */
#define GATED_CHUNK 1024

/* out = act(gate) * up for `tokens` rows of gate_up = [gate | up] (n each, n % LANES == 0) -> (tokens, n): the
   activation rounded to the dtype, then the product rounded (torch's two eager steps' roundings). silu (kind 0):
   x sigmoid(x); gelu's tanh approximation (kind 1): torch's steps, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi)
   (x + 0.044715 x^3), so that it is 0 where tanh(y) rounds to -1, as torch's is. Both from e^-|z| (`vexp`): within
   a float32 ulp or a few of torch's (gelu: of tanh's, where 1 + tanh(y) cancels), so a bfloat16 value can sit one
   step away from torch's at a rounding's edge. Each value alone: the same bits whatever the pass's width. */
int specdec_gated(const void* gate_up, void* out, int tokens, int n, int kind, int bf16, int threads) {
  if (kind != SPECDEC_SILU && kind != SPECDEC_GELU_TANH) return SPECDEC_UNSUPPORTED;
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
      vec x = vload(g), z = kind == SPECDEC_GELU_TANH ? GELU_SCALE * (x + GELU_CUBIC * (x * x * x)) : x;
      vec magnitude = bits_vec(vec_bits(z) & 0x7fffffffu), act, one = (vec){0} + 1.0f;
      ivec negative = z < 0;
      if (kind == SPECDEC_GELU_TANH) { /* tanh(z) = sign(z) (1 - e) / (1 + e), e = e^-2|z| */
        vec e = vexp(-2.0f * magnitude), t = (one - e) / (one + e);
        act = 0.5f * x * (one + vselect(negative, -t, t));
      } else { /* sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below, e = e^-|z| */
        vec e = vexp(-magnitude);
        act = x * (vselect(negative, e, one) / (one + e));
      }
      vec product = vround(act, bf16) * vload(u);
      store_row(out, t * n + i, (const float*)&product, LANES, bf16);
    }
  }
  return SPECDEC_OK;
}
