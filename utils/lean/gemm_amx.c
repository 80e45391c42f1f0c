/* The bfloat16 GEMM on AMX (Intel's tile unit: Sapphire Rapids and later), for bfloat16 activations: the same
   y = x W^T (+ b) as gemm.c's vector kernel, on the tile unit: W's rows are read as they lie in memory (A tiles of
   16 weight rows x 32 inputs), the activations packed as B tiles (16 pairs of inputs x up to 16 rows, as many as
   the pass has), and a block of AMX_M weight rows is multiplied by every row at once. The unit does 8192
   multiply-adds an instruction, so sixteen rows cost what one does: the weights' reading alone (past sixteen, a
   second set of B tiles doubles the products). Width invariance: an output is one chain of tile products over its
   inputs in order, AMX_K at a time, whichever rows share the B tile; a row's column never meets another's. Used
   where the CPU has AMX and Linux lets this process use it (`specdec_amx`); the bits differ from the vector
   kernel's, so a machine uses one or the other. Built only where the compiler targets AMX (HAVE_AMX, gemm_amx.h). */
#include "gemm_amx.h"

#ifdef HAVE_AMX
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_x86.h"

/* Weight rows a block: two A tiles. Measured: 32 rows by one input step against 16 rows by one or two steps, 32 by
   two, and tiles of one weight row's consecutive pieces, 3-15% faster than each (docs/results.md, thirteenth round,
   "Other tile arrangements"). */
#define AMX_M 32
/* A's lines are prefetched into L1 this many steps ahead. Tile registers are not renamed: a step's A loads wait for
   the step before's products, and its products for the loads, so a load from L1 keeps that chain short
   (docs/results.md, eighteenth round, "Wide passes"; the figures in its "Figures behind the code's rules"). */
#define AMX_AHEAD 2

static int amx_state = -1; /* -1: not asked yet; 0: no; 1: the kernel's permission granted */

/* One call's operands and the tiles' shape. */
typedef struct {
  const uint16_t *W, *x, *bias;
  void* y;
  uint32_t* packed;   /* the B tiles, step after step */
  size_t step_values; /* 32-bit values a step's B tiles hold */
  int rows, out, in, y_bf16;
  int steps, sets, n0, n1; /* input steps; B tiles a step (one per 16 rows); the activation rows each holds */
} amx_t;

/* Tiles 4, 5: A (16 weight rows x 32 inputs); 6, 7: B for activation rows 0-15 and 16-31 (16 input pairs x n0, n1
   rows); 0, 1 and 2, 3: C for them (16 weight rows x n0, n1 rows). A B tile is as wide as its rows: a pass of one row
   packs 64 bytes a step, not a tile of zeros. */
static void amx_configure(int n0, int n1) {
  struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) config.rows[t] = 16;
  config.colsb[4] = config.colsb[5] = 64;
  config.colsb[0] = config.colsb[1] = config.colsb[6] = (uint16_t)(4 * n0);
  config.colsb[2] = config.colsb[3] = config.colsb[7] = (uint16_t)(4 * (n1 ? n1 : 1));
  _tile_loadconfig(&config);
}

/* y[r][j0 + m] = c[m][n] (+ bias[j0 + m]) for the tile's 16 weight rows (nj of them real) and 16 activation rows
   from r0 (nr real): one column of c (gathered) is one row of y. */
static inline void amx_write(const float c[16][16], const uint16_t* bias, void* y, int j0, int nj, int r0, int nr,
                             int out, int y_bf16) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  if (nj <= 0) return;
  __mmask16 real = nj >= 16 ? 0xffff : (__mmask16)((1u << nj) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(real, bias + j0)), 16));
  for (int n = 0; n < nr; n++) {
    __m512 v = _mm512_i32gather_ps(column, &c[0][n], 4);
    if (bias) v = _mm512_add_ps(v, b);
    size_t at = (size_t)(r0 + n) * out + j0;
    if (y_bf16) _mm256_mask_storeu_epi16((uint16_t*)y + at, real, bf16_round16(v));
    else _mm512_mask_storeu_ps((float*)y + at, real, v);
  }
}


/* B tile (step s, set): its row p holds input pair p of the step (two bfloat16 as one 32-bit value) for each of 16
   activation rows, zero past the pass's rows: a gather from 16 rows of x. Shared among the team's threads. */
static void amx_pack(const amx_t* J) {
  const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(J->in / 2));
  int in = J->in, rows = J->rows, sets = J->sets;
#pragma omp for schedule(static)
  for (int tile = 0; tile < J->steps * sets; tile++) {
    int s = tile / sets, r0 = 16 * (tile % sets), nr = rows - r0 < 16 ? rows - r0 : 16;
    __mmask16 real = (__mmask16)((1u << nr) - 1);
    const uint32_t* from = (const uint32_t*)J->x + (size_t)r0 * (in / 2) + (size_t)s * (AMX_K / 2);
    uint32_t* to = J->packed + (size_t)s * J->step_values + (size_t)16 * r0; /* set 1 follows set 0's 16 x n0 */
    for (int p = 0; p < 16; p++)
      _mm512_mask_storeu_epi32((void*)(to + (size_t)nr * p), real,
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, stride, from + p, 4));
  }
}

/* Weight rows j0..j0 + nj - 1 (A: AMX_M rows of `in`, zero rows past nj) times every activation row, to y. */
static void amx_block(const amx_t* J, const uint16_t* A, int j0, int nj) {
  int in = J->in, n0 = J->n0, n1 = J->n1, rows = J->rows;
  float c[16][16] __attribute__((aligned(64)));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int s = 0; s < J->steps; s++) {
    const uint16_t* a = A + (size_t)s * AMX_K;
    const uint32_t* b = J->packed + (size_t)s * J->step_values;
    if (s + AMX_AHEAD < J->steps)
      for (int m = 0; m < AMX_M; m++) _mm_prefetch((const char*)(a + (size_t)m * in + AMX_AHEAD * AMX_K), _MM_HINT_T0);
    _tile_loadd(4, a, in * 2);
    _tile_loadd(5, a + (size_t)16 * in, in * 2);
    _tile_loadd(6, b, 4 * n0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (J->sets == 2) {
      _tile_loadd(7, b + 16 * n0, 4 * n1);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  /* tile t: weight rows j0 + 16 (t % 2) on, activation rows 16 (t / 2) on */
  _tile_stored(0, c, 64);
  amx_write(c, J->bias, J->y, j0, nj, 0, rows < 16 ? rows : 16, J->out, J->y_bf16);
  _tile_stored(1, c, 64);
  amx_write(c, J->bias, J->y, j0 + 16, nj - 16, 0, rows < 16 ? rows : 16, J->out, J->y_bf16);
  if (J->sets == 2) {
    _tile_stored(2, c, 64);
    amx_write(c, J->bias, J->y, j0, nj, 16, rows - 16, J->out, J->y_bf16);
    _tile_stored(3, c, 64);
    amx_write(c, J->bias, J->y, j0 + 16, nj - 16, 16, rows - 16, J->out, J->y_bf16);
  }
}

int gemm_amx(const uint16_t* W, const uint16_t* x, const uint16_t* bias, void* y, int rows, int out, int in,
             int y_bf16, int threads) {
  int n0 = rows < 16 ? rows : 16;
  amx_t J = {W, x, bias, y, NULL, (size_t)16 * rows, rows, out, in, y_bf16, in / AMX_K, rows > 16 ? 2 : 1, n0,
             rows - n0};
  J.packed = (uint32_t*)aligned_alloc(64, ((size_t)J.steps * J.step_values * 4 + 63) / 64 * 64);
  if (!J.packed) return SPECDEC_NO_MEMORY;
  int blocks = (out + AMX_M - 1) / AMX_M, failed = 0;
  (void)threads; /* read by the OpenMP pragmas only */
#pragma omp parallel num_threads(threads)
  {
    amx_pack(&J);
    amx_configure(J.n0, J.n1);
    uint16_t* tail = NULL; /* the last block's weight rows padded with zero rows, where out % AMX_M != 0 */
#pragma omp for schedule(static)
    for (int jb = 0; jb < blocks; jb++) {
      int j0 = jb * AMX_M, nj = out - j0 < AMX_M ? out - j0 : AMX_M;
      const uint16_t* A = W + (size_t)j0 * in;
      if (nj < AMX_M) {
        tail = (uint16_t*)calloc((size_t)AMX_M * in, sizeof(uint16_t));
        if (!tail) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        memcpy(tail, A, (size_t)nj * in * sizeof(uint16_t));
        A = tail;
      }
      amx_block(&J, A, j0, nj);
    }
    free(tail);
    _tile_release();
  }
  free(J.packed);
  return failed ? SPECDEC_NO_MEMORY : SPECDEC_OK;
}
#endif

/* 1 where bfloat16 activations take the tile unit (built for it, and Linux granted this process its state), else 0. */
int specdec_amx(void) {
#ifdef HAVE_AMX
  if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return amx_state;
#else
  return 0;
#endif
}
