/* A decoder-only model's whole stack of layers in one call, built with the other kernels' files into one library by
   `utils/lean/build.py` and driven by `utils/lean/decoder.py`. Each layer is the lean forward's (`llama.py`'s and
   `gemma.py`'s `_block`), step for step and with the same kernels: the norm, the q/k/v product, q's and k's norms
   (Qwen3, Gemma 3), the rotary step and the buffer's write, attention, the output product and its norm (Gemma 2 and
   3), the residual addition with the MLP's norm, the gate/up product, act(gate) * up, the down product and its norm
   (Gemma 2 and 3), and the residual addition (made by the next layer's norm, the last one's here). What it saves is
   the Python between them: about twelve calls a layer, each with its tensors allocated and its arguments converted
   (an eighth of a 0.5B's one-token pass, docs/results.md, seventeenth round).

   The weights' pointers come once per model (`LAYER_POINTERS` a layer), the buffer's once per pass; a linear is
   our bfloat16 kernel (`specdec_gemm`) or our 4-bit one (`specdec_gemm_q4`), the same kind in every layer. A layer
   of a model that mixes two kinds (Gemma 2 and 3) takes the sliding window's mask and, Gemma 3, its own rotary
   tables where its `layer_kinds` bits say so. */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"
#include "specdec.h"

enum { QKV = SPECDEC_QKV, O = SPECDEC_O, GATE_UP = SPECDEC_GATE_UP, DOWN = SPECDEC_DOWN, LINEARS = SPECDEC_LINEARS };
enum { ATTENTION_NORM = SPECDEC_ATTENTION_NORM, MLP_NORM = SPECDEC_MLP_NORM, Q_NORM = SPECDEC_Q_NORM,
       K_NORM = SPECDEC_K_NORM, POST_ATTENTION_NORM = SPECDEC_POST_ATTENTION_NORM,
       POST_MLP_NORM = SPECDEC_POST_MLP_NORM, FIRST_LINEAR = SPECDEC_FIRST_LINEAR,
       LAYER_POINTERS = SPECDEC_LAYER_POINTERS };
enum { SLIDING = SPECDEC_SLIDING, SECOND_ROPE = SPECDEC_SECOND_ROPE };
typedef specdec_shape_t shape_t;

static int linear(const void* const* p, int which, const void* x, void* y, int tokens, int out, int in,
                  const shape_t* s) {
  if (s->kinds[which] != 0 && s->kinds[which] != 1) return SPECDEC_UNSUPPORTED;
  if (s->kinds[which] == 1)
    return specdec_gemm_q4((const uint8_t*)p[0], (const uint16_t*)p[1], x, p[2], y, tokens, out, in,
                           (int)s->groups[which], (int)s->bf16, (int)s->bf16, (int)s->threads);
  return specdec_gemm((const uint16_t*)p[0], x, p[2], y, tokens, out, in, (int)s->bf16, (int)s->bf16, (int)s->threads);
}

/* Each token's heads (n of them, d values each, `stride` values apart from one token to the next) normalised in
   place: Qwen3's and Gemma 3's q and k norms. */
static int head_norms(void* x, const void* weight, int tokens, int64_t stride, int n, int d, const shape_t* s) {
  int size = s->bf16 ? 2 : 4, status = SPECDEC_OK;
  for (int t = 0; t < tokens && !status; t++) {
    void* at = (char*)x + (size_t)t * stride * size;
    status = specdec_rms_norm(at, NULL, weight, at, n, d, s->eps, (int)s->plus_one, (int)s->bf16, (int)s->norm_bf16,
                              (int)s->threads);
  }
  return status;
}

/* x normalised in place, where `weight` is given (a norm the model has). */
static int norm_in_place(void* x, const void* weight, int tokens, int n, const shape_t* s) {
  if (!weight) return SPECDEC_OK;
  return specdec_rms_norm(x, NULL, weight, x, tokens, n, s->eps, (int)s->plus_one, (int)s->bf16, (int)s->norm_bf16,
                          (int)s->threads);
}

/* h (rows * width tokens of `hidden`, the embeddings) -> h after every layer, in place. `work`: room for
   tokens * (2 hidden + the q/k/v width + 2 heads head_dim + 3 intermediate) values of the pass's dtype; `kv`: each
   layer's keys then values buffer (rows, kv_heads, slots, head_dim); `layer_kinds`: each layer's kind bits; cos and
   sin: the rotary tables (positions, s->rotary), cos2 and sin2 the second kind's (or NULL); positions and
   write_index (rows, width); mask (rows, 1, width, used), added to the scores, and `sliding` the sliding window's
   (or NULL). Returns SPECDEC_OK, else the failing step's status (a specdec_status) times 100 plus the step (1 norm,
   2 q/k/v, 3 rotary, 4 attention, 5 output, 6 norm, 7 gate/up, 8 activation, 9 down, 10 q/k norms, 11 output norm,
   12 MLP output norm); a shape whose sizes do not fit the kernels' int counts fails as step 1's SPECDEC_BAD_SHAPE.
   Each slot and position is checked against the buffer and the tables' `table_rows` (specdec_rope_write_checked). */
int specdec_decoder(void* h, void* work, const void* const* layers, void* const* kv, const int64_t* layer_kinds,
                    int n_layers, const void* cos, const void* sin, const void* cos2, const void* sin2,
                    const int64_t* positions, const int64_t* write_index, const void* mask, const void* sliding,
                    const shape_t* s) {
  int64_t all = s->rows * s->width;
  if (s->rows < 0 || s->width < 0 || all > INT_MAX || s->hidden > INT_MAX || s->intermediate > INT_MAX ||
      s->slots > INT_MAX || s->used > INT_MAX || s->heads * s->head_dim > INT_MAX || n_layers < 0)
    return SPECDEC_BAD_SHAPE * 100 + 1;
  int tokens = (int)all, bf16 = (int)s->bf16, threads = (int)s->threads;
  int hidden = (int)s->hidden, attended = (int)(s->heads * s->head_dim), size = bf16 ? 2 : 4;
  int plus_one = (int)s->plus_one, d = (int)s->head_dim;
  char* at = (char*)work;
  void *x = at, *delta = at + (size_t)tokens * hidden * size, *qkv = at + (size_t)2 * tokens * hidden * size;
  void* q = (char*)qkv + (size_t)tokens * s->outs[QKV] * size;
  void* attention = (char*)q + (size_t)tokens * attended * size;
  void* gate_up = (char*)attention + (size_t)tokens * attended * size;
  void* act = (char*)gate_up + (size_t)tokens * s->outs[GATE_UP] * size;
  int status = SPECDEC_OK;
#define STEP(call, step)                          \
  if ((status = (call)) != 0) return status * 100 + (step)
  for (int l = 0; l < n_layers; l++) {
    const void* const* p = layers + (size_t)l * LAYER_POINTERS;
    const void* const* w = p + FIRST_LINEAR;
    void *keys = kv[2 * l], *values = kv[2 * l + 1];
    int second = (layer_kinds[l] & SECOND_ROPE) != 0, window = (layer_kinds[l] & SLIDING) != 0;
    STEP(specdec_rms_norm(h, l ? delta : NULL, p[ATTENTION_NORM], x, tokens, hidden, s->eps, plus_one, bf16,
                          (int)s->norm_bf16, threads), 1);
    STEP(linear(w + 3 * QKV, QKV, x, qkv, tokens, (int)s->outs[QKV], hidden, s), 2);
    if (p[Q_NORM]) {
      STEP(head_norms(qkv, p[Q_NORM], tokens, s->outs[QKV], (int)s->heads, d, s), 10);
      STEP(head_norms((char*)qkv + (size_t)attended * size, p[K_NORM], tokens, s->outs[QKV], (int)s->kv_heads, d, s),
           10);
    }
    STEP(specdec_rope_write_checked(qkv, second ? cos2 : cos, second ? sin2 : sin, s->table_rows, positions, write_index,
                                    q, keys, values, (int)s->rows, (int)s->width, (int)s->heads, (int)s->kv_heads,
                                    (int)s->slots, d, (int)s->rotary, bf16, threads), 3);
    STEP(specdec_attention(q, s->width * attended, s->head_dim, attended, keys, values, window ? sliding : mask,
                           window ? s->sliding_row : s->mask_row, window ? s->sliding_token : s->mask_token,
                           attention, (int)s->rows, (int)s->heads, (int)s->kv_heads, (int)s->width, (int)s->used,
                           (int)s->slots, d, s->scale, s->cap, bf16, threads), 4);
    STEP(linear(w + 3 * O, O, attention, delta, tokens, hidden, attended, s), 5);
    STEP(norm_in_place(delta, p[POST_ATTENTION_NORM], tokens, hidden, s), 11);
    STEP(specdec_rms_norm(h, delta, p[MLP_NORM], x, tokens, hidden, s->eps, plus_one, bf16, (int)s->norm_bf16, threads),
         6);
    STEP(linear(w + 3 * GATE_UP, GATE_UP, x, gate_up, tokens, (int)s->outs[GATE_UP], hidden, s), 7);
    STEP(specdec_gated(gate_up, act, tokens, (int)s->intermediate, (int)s->activation, bf16, threads), 8);
    STEP(linear(w + 3 * DOWN, DOWN, act, delta, tokens, hidden, (int)s->intermediate, s), 9);
    STEP(norm_in_place(delta, p[POST_MLP_NORM], tokens, hidden, s), 12);
  }
#undef STEP
  for (int64_t i = 0; i < (int64_t)tokens * hidden; i++) { /* the last layer's residual addition, rounded as torch's */
    if (bf16)
      ((uint16_t*)h)[i] = f32_to_bf16(bf16_to_f32(((uint16_t*)h)[i]) + bf16_to_f32(((const uint16_t*)delta)[i]));
    else
      ((float*)h)[i] += ((const float*)delta)[i];
  }
  return SPECDEC_OK;
}

int specdec_spec_numbers(int64_t* out, int n) {
  const int64_t numbers[] = {SPECDEC_SLIDING, SPECDEC_SECOND_ROPE, SPECDEC_SILU, SPECDEC_GELU_TANH,
                             SPECDEC_LAYER_POINTERS};
  int count = (int)(sizeof numbers / sizeof numbers[0]);
  for (int i = 0; i < count && i < n; i++) out[i] = numbers[i];
  return count < n ? count : n;
}

int specdec_shape_layout(int64_t* out, int n) {
  const int64_t layout[] = {
      sizeof(specdec_shape_t),
      offsetof(specdec_shape_t, rows), offsetof(specdec_shape_t, width), offsetof(specdec_shape_t, used),
      offsetof(specdec_shape_t, slots), offsetof(specdec_shape_t, hidden), offsetof(specdec_shape_t, intermediate),
      offsetof(specdec_shape_t, heads), offsetof(specdec_shape_t, kv_heads), offsetof(specdec_shape_t, head_dim),
      offsetof(specdec_shape_t, mask_row), offsetof(specdec_shape_t, mask_token), offsetof(specdec_shape_t, kinds),
      offsetof(specdec_shape_t, outs), offsetof(specdec_shape_t, groups), offsetof(specdec_shape_t, bf16),
      offsetof(specdec_shape_t, norm_bf16), offsetof(specdec_shape_t, threads), offsetof(specdec_shape_t, plus_one),
      offsetof(specdec_shape_t, activation), offsetof(specdec_shape_t, sliding_row),
      offsetof(specdec_shape_t, sliding_token), offsetof(specdec_shape_t, table_rows), offsetof(specdec_shape_t, rotary),
      offsetof(specdec_shape_t, eps), offsetof(specdec_shape_t, scale), offsetof(specdec_shape_t, cap)};
  int count = (int)(sizeof layout / sizeof layout[0]);
  for (int i = 0; i < count && i < n; i++) out[i] = layout[i];
  return count < n ? count : n;
}
