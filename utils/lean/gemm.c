/* Our bfloat16-weight GEMM (specdec_gemm), built for the CPU it runs on by `utils/lean/build.py` (cc -O3
   -march=native -fopenmp -ffp-contract=off): y = x W^T (+ b) for bfloat16 weights W (out, in) and up to MAX_ROWS
   rows of x (rows, in); x, b and y in float32 or bfloat16. Written once over gemm_bf16_isa.h's vector operations
   (AVX-512, AVX2 + FMA or plain C, chosen at compile time); bfloat16 activations take the tile unit instead where
   the CPU has AMX (gemm_amx.c). The 4-bit GEMM is gemm_q4.c. OpenMP is optional (without -fopenmp the pragmas are
   ignored and every call runs on one thread).

   Why our own: torch's fastest product for one row streams the weights at ~80% of what a `sum` reads, and a
   float32 model on an AVX2 machine reads its weights in float32 though most checkpoints hold exact bfloat16
   values; this kernel reads bfloat16 weights and multiplies in float32 whatever the activations' dtype.

   Width invariance by construction: every output is one fixed chain of fused multiply-adds per vector lane (the
   even elements of each KB-block, then its odd ones, block after block) and one fixed horizontal sum, whatever the
   number of rows, the thread count or the block an output falls in: a row's result is the same bits in a pass of
   one row and in a pass of thirty-two. Where the CPU has AVX512_BF16 (Zen 4 and 5, Xeons from Cooper Lake),
   bfloat16 activations take its dot product instead (`chunk_pairs`): one VDPBF16PS a KB-block per lane, each lane
   the sum of its pairs' exact products, block after block (denormals flushed, as the instruction does): another
   fixed chain, so other bits, as invariant, and twice the multiply-adds a cycle of the float32 chain, with no copy
   of the activations into float32 (on a 2-vCPU Zen 4 the float32 chain lost to torch's products from 8 rows,
   twentieth round, docs/results.md).

   Shape of the work: each thread takes whole blocks of JB weight rows (JB1 for one activation row: gemm_bf16_isa.h);
   a block's rows are read chunk by chunk (KC elements), each chunk once from memory, prefetched PREFETCH bytes ahead
   into L2, then used by every group of RB activation rows while it sits in the cache; one bfloat16 activation row
   over at most STRAIGHT_IN inputs reads each weight row of its block straight through instead. None of JB, JB1, KC,
   KC_PAIRS, PREFETCH, RB and STRAIGHT_IN changes the bits. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "gemm_amx.h"
#include "gemm_bf16_isa.h"
#include "specdec.h"

#define MAX_ROWS SPECDEC_MAX_ROWS
/* Weight rows a thread's block: the accumulators of JB rows times RB activation rows stay in registers. Chosen with
   the kernel (ninth round, docs/results.md "A kernel of our own"); AVX2's measured (gemm_bf16_isa.h). */
#ifndef JB /* -DJB=... builds another to time (as JB1, RB, KC, KC_PAIRS, PREFETCH and Q4_X): none changes the bits */
#define JB 4
#endif
#define JBMAX (JB > JB1 ? JB : JB1) /* the accumulators' columns: a block of JB rows, or JB1 for one activation row */
/* Inputs a chunk: JB rows of KC bfloat16 read once from memory, then served from L1 to every group of RB activation
   rows, whose accumulators go to memory between chunks. The float32 chain's KC: 512 (4 KB of weights, the ninth
   round's choice; on AVX2 2048 measured 0.94-1.06x it, so kept). Bfloat16 pairs' KC_PAIRS: 4096, a 1536-wide input's
   whole row; against 512 on a 2-vCPU Zen 4 1.02-1.05x at 8 and 16 rows, 1.11-1.17x at 32, the same at one (2048 to
   8192 alike; twenty-second round, docs/results.md; one row over at most STRAIGHT_IN inputs now reads whole rows). */
#ifndef KC
#define KC 512
#endif
#ifndef KC_PAIRS
#define KC_PAIRS 4096
#endif
/* How far ahead of the row being read its weights are prefetched, in bytes: 8 to 64 KB within the noise on a Zen 4
   (twenty-first round). Into L2 (prefetcht1, locality 2), as the 4-bit kernel's: a prefetch into L1 holds one of its
   few fill buffers until the line comes; on a 2-vCPU Zen 4 a one-row product read 18-19.5 GB/s so and 29-33 into L2,
   of a 30-37 GB/s read (no gain on the Xeon of the thirteenth round: docs/results.md). Not for one bfloat16 row over
   at most STRAIGHT_IN inputs, read straight through without it (below). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
/* One bfloat16 activation row over inputs up to this many: each weight row of a block read straight through, one
   after another, with no prefetch (`rows_straight`), rather than the block's rows side by side: one stream
   the hardware's prefetchers follow instead of eight. On a 2-vCPU Zen 4, alternated, the 1.5B's one-token pass
   1.18-1.20x where the VM's memory ran fast, 1.06x where it ran slow (256 cached tokens), 1.17x after 4096, the
   0.5B's 1.13x; alone, 1536 to 4864 inputs 1.02-1.28x, but at 8960 one row's chain of dependent products bounds the
   stream (0.90x), so wider inputs keep the rows side by side (twenty-sixth round, docs/results.md). The float32
   chain (two dependent multiply-adds a block) stays side by side: built for Haswell the pass ran 0.98x so. */
#ifndef STRAIGHT_IN
#define STRAIGHT_IN 4096
#endif
#define HALF (KB / 2)
/* Holds x in a register (AVX-512's 32 have room for RB rows' blocks): gcc otherwise reads it from memory again for
   each weight row's product, and the loads, not the products, then bound a chunk (on a 2-vCPU Zen 4 the float32
   chain 1.7-1.85x faster so at 4 to 32 rows: twenty-fifth round, docs/results.md). With AVX2's 16 gcc holds them. */
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define X_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define X_IN_REGISTER(x) (void)(x)
#endif

/* The input width must be a multiple of this (every build has a kernel). */
int specdec_block(void) { return KB; }

/* A chunk's accumulators copied into and out of a local array (registers) */
#define ACCUMULATORS_IN(a, acc, nr, nj) \
  for (int r = 0; r < (nr); r++)        \
    for (int b = 0; b < (nj); b++) (a)[r][b] = (acc)[r][b]
#define ACCUMULATORS_OUT(acc, a, nr, nj) \
  for (int r = 0; r < (nr); r++)         \
    for (int b = 0; b < (nj); b++) (acc)[r][b] = (a)[r][b]

/* acc[r][b] += weight row j0+b times activation row r0+r over elements [k0, k1); xp holds each KB-block of the
   activations as its even elements then its odd ones, in float32. */
static inline __attribute__((always_inline)) void chunk(const uint16_t* W, const float* xp, int in, int j0, int nj,
                                                        int r0, int nr, vf acc[RB][JBMAX], int k0, int k1) {
  vf a[RB][JBMAX]; /* the accumulators in registers: `acc`'s vector type may alias any memory, so updating it in place
                   would store every sum back and load every weight again (measured: the pair kernel at 32 rows ran
                   at 0.4 of torch's product so) */
  ACCUMULATORS_IN(a, acc, nr, nj);
  for (int k = k0; k < k1; k += KB) {
    vf x[RB][2]; /* each activation row's block once, held in registers for the nj weight rows */
    for (int r = 0; r < nr; r++) {
      x[r][0] = vload(xp + (size_t)(r0 + r) * in + k), x[r][1] = vload(xp + (size_t)(r0 + r) * in + k + HALF);
      X_IN_REGISTER(x[r][0]);
      X_IN_REGISTER(x[r][1]);
    }
    for (int b = 0; b < nj; b++) {
      const uint16_t* w_at = W + (size_t)(j0 + b) * in + k;
      __builtin_prefetch((const char*)w_at + PREFETCH, 0, PREFETCH_LOCALITY);
      vi w = load_w(w_at);
      vf even = even_half(w), odd = odd_half(w);
      for (int r = 0; r < nr; r++) {
        a[r][b] = vfma(even, x[r][0], a[r][b]);
        a[r][b] = vfma(odd, x[r][1], a[r][b]);
      }
    }
  }
  ACCUMULATORS_OUT(acc, a, nr, nj);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAIRS 1 /* bfloat16 activations by VDPBF16PS (module comment) */
/* acc[r][b] += weight row j0+b times bfloat16 activation row r0+r over elements [k0, k1), each lane the sum of
   its pairs' products: VDPBF16PS. */
static inline __attribute__((always_inline)) void chunk_pairs(const uint16_t* W, const uint16_t* x, int in, int j0,
                                                              int nj, int r0, int nr, vf acc[RB][JBMAX], int k0,
                                                              int k1) {
  vf a[RB][JBMAX]; /* in registers, as `chunk`'s */
  ACCUMULATORS_IN(a, acc, nr, nj);
  for (int k = k0; k < k1; k += KB) {
    __m512bh w[JBMAX]; /* each weight row's block once, each activation row's once: JB x RB products, JB + RB loads */
    for (int b = 0; b < nj; b++) {
      const uint16_t* w_at = W + (size_t)(j0 + b) * in + k;
      __builtin_prefetch((const char*)w_at + PREFETCH, 0, PREFETCH_LOCALITY);
      w[b] = (__m512bh)load_w(w_at);
    }
    for (int r = 0; r < nr; r++) {
      __m512bh xv = (__m512bh)load_w(x + (size_t)(r0 + r) * in + k);
      for (int b = 0; b < nj; b++) a[r][b] = _mm512_dpbf16_ps(a[r][b], w[b], xv);
    }
  }
  ACCUMULATORS_OUT(acc, a, nr, nj);
}

/* acc[0][b] = weight row j0+b times the one bfloat16 activation row: `chunk_pairs`' chain for one row over all its
   inputs, each weight row read straight through before the next (STRAIGHT_IN). Called outside the chunks' loop
   nest: inside it (as one chunk of `in` inputs) the same loop measured no faster than the rows side by side. */
static inline __attribute__((always_inline)) void rows_straight(const uint16_t* W, const uint16_t* x, int in, int j0,
                                                                int nj, vf acc[RB][JBMAX]) {
  for (int b = 0; b < nj; b++) {
    vf a = vzero();
    const uint16_t* w_row = W + (size_t)(j0 + b) * in;
    for (int k = 0; k < in; k += KB) a = _mm512_dpbf16_ps(a, (__m512bh)load_w(w_row + k), (__m512bh)load_w(x + k));
    acc[0][b] = a;
  }
}
#else
#define PAIRS 0
#endif

/* xp: each KB-block of each row of x as its even elements then its odd ones, in float32. */
static void pack_rows(const void* x, float* xp, int rows, int in, int x_bf16) {
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < in; k += KB)
      for (int i = 0; i < KB; i++) {
        size_t from = (size_t)r * in + k + i;
        float v = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[from]) : ((const float*)x)[from];
        xp[(size_t)r * in + k + (i & 1) * HALF + i / 2] = v;
      }
}

/* A whole block's last group of nr < RB activation rows (AVX2's odd counts of rows: a pass over 3, 5 or 9 tokens), by
   a call whose nr is a constant, unrolled as the full groups are: generic, a group of one row took 1.5x the time of a
   group of two on a Zen 3, and 3 rows 1.77x the time they take so (thirty-third round, docs/results.md). */
#if RB > 3
#define REST_OF_3(kernel, xs) else if (nr == 3) kernel(W, xs, in, j0, JB, r0, 3, acc[g], k0, k1);
#else
#define REST_OF_3(kernel, xs)
#endif
#if RB > 2
#define REST_OF_2(kernel, xs) else if (nr == 2) kernel(W, xs, in, j0, JB, r0, 2, acc[g], k0, k1);
#else
#define REST_OF_2(kernel, xs)
#endif
#define REST_OF_ROWS(kernel, xs)                                       \
  do {                                                                 \
    if (nr == 1) kernel(W, xs, in, j0, JB, r0, 1, acc[g], k0, k1);    \
    REST_OF_2(kernel, xs) REST_OF_3(kernel, xs)                         \
    else kernel(W, xs, in, j0, JB, r0, nr, acc[g], k0, k1);            \
  } while (0)

/* Weight rows j0..j0 + nj - 1 (nj <= JB) times every row of xs, plus the bias, to y: xs is `pack_rows`' float32
   copy, or (`pairs`) the bfloat16 activations themselves. */
static void gemm_block(const uint16_t* W, const void* xs, int pairs, const void* bias, void* y, int rows, int out,
                       int in, int j0, int nj, int x_bf16, int y_bf16) {
  const float* xp = (const float*)xs;
  int groups = (rows + RB - 1) / RB;
  vf acc[(MAX_ROWS + RB - 1) / RB][RB][JBMAX];
  for (int g = 0; g < groups; g++)
    for (int r = 0; r < RB; r++)
      for (int b = 0; b < JBMAX; b++) acc[g][r][b] = vzero();
  int kc = pairs ? KC_PAIRS : KC;
#if PAIRS
  if (pairs && rows == 1 && in <= STRAIGHT_IN) /* one activation row: each weight row read straight through */
    rows_straight(W, (const uint16_t*)xs, in, j0, nj, acc[0]);
  else
#endif
    for (int k0 = 0; k0 < in; k0 += kc) {
      int k1 = k0 + kc < in ? k0 + kc : in;
      for (int g = 0; g < groups; g++) {
        int r0 = g * RB, nr = rows - r0 < RB ? rows - r0 : RB;
#if PAIRS
        if (pairs) {
          if (nj == JB && nr == RB) chunk_pairs(W, (const uint16_t*)xs, in, j0, JB, r0, RB, acc[g], k0, k1);
          else if (nj == JB1 && rows == 1) chunk_pairs(W, (const uint16_t*)xs, in, j0, JB1, 0, 1, acc[g], k0, k1);
          else if (nj == JB) REST_OF_ROWS(chunk_pairs, (const uint16_t*)xs);
          else chunk_pairs(W, (const uint16_t*)xs, in, j0, nj, r0, nr, acc[g], k0, k1);
          continue;
        }
#endif
        if (nj == JB && nr == RB) chunk(W, xp, in, j0, JB, r0, RB, acc[g], k0, k1); /* unrolled: the common cases */
        else if (nj == JB1 && rows == 1) chunk(W, xp, in, j0, JB1, 0, 1, acc[g], k0, k1);
        else if (nj == JB) REST_OF_ROWS(chunk, xp);
        else chunk(W, xp, in, j0, nj, r0, nr, acc[g], k0, k1);
      }
    }
  for (int r = 0; r < rows; r++)
    for (int b = 0; b < nj; b++) {
      float v = vsum(acc[r / RB][r % RB][b]);
      if (bias) v += x_bf16 ? bf16_to_f32(((const uint16_t*)bias)[j0 + b]) : ((const float*)bias)[j0 + b];
      size_t at = (size_t)r * out + j0 + b;
      if (y_bf16) ((uint16_t*)y)[at] = f32_to_bf16(v);
      else ((float*)y)[at] = v;
    }
}

/* x_bf16, y_bf16: 1 where x (and the bias), y are bfloat16, 0 where float32; bias: NULL or `out` values.
   Returns SPECDEC_OK; SPECDEC_BAD_SHAPE where rows is not 1..MAX_ROWS, in not a positive multiple of KB or out
   negative; SPECDEC_NO_MEMORY. */
int specdec_gemm(const uint16_t* W, const void* x, const void* bias, void* y, int rows, int out, int in,
                 int x_bf16, int y_bf16, int threads) {
  if (rows < 1 || rows > MAX_ROWS || in < 1 || in % KB || out < 0) return SPECDEC_BAD_SHAPE;
  if (out == 0) return SPECDEC_OK;
  (void)threads; /* read by the OpenMP pragmas only: unused without -fopenmp */
#ifdef HAVE_AMX
  if (x_bf16 && specdec_amx() == 1 && in % AMX_K == 0)
    return gemm_amx(W, (const uint16_t*)x, (const uint16_t*)bias, y, rows, out, in, y_bf16, threads);
#endif
  int pairs = PAIRS && x_bf16;
  float* xp = pairs ? NULL : (float*)malloc((size_t)rows * in * sizeof(float));
  if (!pairs && !xp) return SPECDEC_NO_MEMORY;
  if (!pairs) pack_rows(x, xp, rows, in, x_bf16);
  const void* xs = pairs ? x : (const void*)xp;
  int width = rows == 1 ? JB1 : JB, blocks = (out + width - 1) / width; /* weight rows a block */
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int jb = 0; jb < blocks; jb++) {
    int j0 = jb * width;
    gemm_block(W, xs, pairs, bias, y, rows, out, in, j0, out - j0 < width ? out - j0 : width, x_bf16, y_bf16);
  }
  free(xp);
  return SPECDEC_OK;
}
