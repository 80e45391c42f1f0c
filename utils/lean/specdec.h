/* The kernels' entry points (one source file per kernel family: gemm.c, gemm_amx.c, gemm_q4.c, norm.c, rope.c,
   attention.c, flash.c, gated.c, decoder.c), as `utils/lean/native.py` calls them through ctypes and as
   tests/native/test_kernels.c calls them. Every operation returns a `specdec_status`: SPECDEC_OK, or why it
   did nothing (checked before anything is written). The three queries (specdec_block, specdec_q4_block,
   specdec_amx) return what they say instead.

   Sizes are `int` where a tensor dimension is (a caller's shape); every offset and size computed from them is
   int64_t or size_t, so rows * in and the like do not overflow. */
#ifndef SPECDEC_H
#define SPECDEC_H
#include <stdint.h>

/* 1 and 2 keep the values layer.c (now norm.c, rope.c, attention.c, gated.c) returned before these names
   (decoder.py prints status // 100). */
enum specdec_status {
  SPECDEC_OK = 0,
  SPECDEC_BAD_SHAPE = 1,   /* a size negative (or zero where one is needed) or not a multiple of the kernel's block */
  SPECDEC_NO_MEMORY = 2,   /* scratch memory could not be allocated */
  SPECDEC_BAD_INDEX = 3,   /* a slot, position or key count outside the buffer or table it indexes */
  SPECDEC_UNSUPPORTED = 4, /* a kind (quantization group, activation, linear kind) this build has no kernel for */
};

#define SPECDEC_MAX_ROWS 32 /* the most activation rows the GEMMs take in one call */

/* A function shared between our source files but not part of this interface: kept out of the library's symbols. */
#if defined(__GNUC__) || defined(__clang__)
#define SPECDEC_INTERNAL __attribute__((visibility("hidden")))
#else
#define SPECDEC_INTERNAL
#endif

/* gemm.c (specdec_block, specdec_gemm), gemm_amx.c (specdec_amx), gemm_q4.c (the rest) */
int specdec_block(void);    /* the bfloat16 GEMM's input multiple (nonzero in every build) */
int specdec_q4_block(void); /* the 4-bit GEMM's input multiple (nonzero in every build) */
int specdec_amx(void);      /* 1 where bfloat16 activations take the tile unit, else 0 */
int specdec_gemm(const uint16_t* W, const void* x, const void* bias, void* y, int rows, int out, int in, int x_bf16,
                 int y_bf16, int threads);
int specdec_gemm_q4(const uint8_t* Wq, const uint16_t* dm, const void* x, const void* bias, void* y, int rows, int out,
                    int in, int group, int x_bf16, int y_bf16, int threads);
int specdec_dequantize_q4(const uint8_t* Wq, const uint16_t* dm, void* w, int out, int in, int group, int y_bf16,
                          int threads);

/* norm.c */
int specdec_rms_norm(void* x, const void* delta, const void* weight, void* out, int tokens, int n, float eps,
                     int plus_one, int bf16, int weight_bf16, int threads);
/* rope.c */
int specdec_rope_write_checked(const void* qkv, const void* cos, const void* sin, int64_t table_rows,
                               const int64_t* positions, const int64_t* write_index, void* q_out, void* keys,
                               void* values, int rows, int width, int heads, int kv_heads, int slots, int d, int rotary,
                               int bf16, int threads);
int specdec_rope_write(const void* qkv, const void* cos, const void* sin, const int64_t* positions,
                       const int64_t* write_index, void* q_out, void* keys, void* values, int rows, int width,
                       int heads, int kv_heads, int slots, int d, int bf16, int threads);
/* attention.c */
int specdec_attention(const void* q, int64_t q_row, int64_t q_head, int64_t q_token, const void* keys,
                      const void* values, const void* mask, int64_t m_row, int64_t m_token, void* out, int rows,
                      int heads, int kv_heads, int width, int used, int slots, int d, float scale, float cap, int bf16,
                      int threads);
/* flash.c */
int specdec_flash_attention(const void* q, int64_t q_head, int64_t q_token, const void* keys, const void* values,
                            void* out, int heads, int kv_heads, int width, int start, int slots, int d, float scale,
                            int threads);
/* gated.c */
int specdec_gated(const void* gate_up, void* out, int tokens, int n, int kind, int bf16, int threads);

/* decoder.c: a decoder-only model's whole stack of layers in one call. */
enum { SPECDEC_QKV, SPECDEC_O, SPECDEC_GATE_UP, SPECDEC_DOWN, SPECDEC_LINEARS }; /* a layer's linears, in order */
/* A layer's pointers: its norms' weights (the last four NULL where the model has none), then per linear (in the
   order above) its weight, its scales (4 bits; else NULL) and its bias (in the pass's dtype; NULL without one). */
enum { SPECDEC_ATTENTION_NORM, SPECDEC_MLP_NORM, SPECDEC_Q_NORM, SPECDEC_K_NORM, SPECDEC_POST_ATTENTION_NORM,
       SPECDEC_POST_MLP_NORM, SPECDEC_FIRST_LINEAR, SPECDEC_LAYER_POINTERS = SPECDEC_FIRST_LINEAR + 3 * SPECDEC_LINEARS };
enum { SPECDEC_SLIDING = 1, SPECDEC_SECOND_ROPE = 2 }; /* a layer's kind bits */
enum { SPECDEC_SILU = 0, SPECDEC_GELU_TANH = 1 };     /* `specdec_gated`'s activation kinds */

/* A pass's shape and numbers (`decoder.py`'s `Shape` mirrors it field for field). */
typedef struct {
  int64_t rows, width, used, slots; /* rows of `width` new tokens; the buffer's slots a pass reads and holds */
  int64_t hidden, intermediate, heads, kv_heads, head_dim;
  int64_t mask_row, mask_token;                          /* the mask's strides (its last one 1) */
  int64_t kinds[SPECDEC_LINEARS], outs[SPECDEC_LINEARS]; /* each linear's kernel (0 bfloat16, 1 4-bit), output width */
  int64_t groups[SPECDEC_LINEARS];       /* a 4-bit linear's quantization group (32 or 64 inputs a scale) */
  int64_t bf16, norm_bf16, threads;      /* the pass in bfloat16 (else float32); the norms' weights in bfloat16 */
  int64_t plus_one, activation;          /* norms times (1 + weight) (Gemma's); `specdec_gated`'s kind */
  int64_t sliding_row, sliding_token;    /* the sliding window mask's strides (its last one 1) */
  int64_t table_rows;                    /* the rotary tables' positions (a position past them is refused) */
  int64_t rotary;                        /* the dimensions of a head the rotary step turns (head_dim: all) */
  float eps, scale, cap;                 /* the norms' epsilon; attention's scale and logits' cap (0: none) */
} specdec_shape_t;

/* specdec_shape_t's layout: its size, then each field's offset in declaration order (`decoder.py` checks its
   ctypes mirror against it before the first pass). Returns the number of values written (at most n). */
int specdec_shape_layout(int64_t* out, int n);
/* The numbers a family's spec is told to decoder.c in (`utils/lean/spec.py` checks its own against them): the layer
   kind bits SLIDING and SECOND_ROPE, the activation kinds SILU and GELU_TANH, and a layer's pointer count.
   Returns the number of values written (at most n). */
int specdec_spec_numbers(int64_t* out, int n);

int specdec_decoder(void* h, void* work, const void* const* layers, void* const* kv, const int64_t* layer_kinds,
                    int n_layers, const void* cos, const void* sin, const void* cos2, const void* sin2,
                    const int64_t* positions, const int64_t* write_index, const void* mask, const void* sliding,
                    const specdec_shape_t* s);
#endif
