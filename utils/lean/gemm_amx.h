/* The bfloat16 GEMM on Intel's tile unit (gemm_amx.c), as gemm.c's dispatch sees it. */
#ifndef SPECDEC_GEMM_AMX_H
#define SPECDEC_GEMM_AMX_H
#include <stdint.h>

#include "specdec.h"

/* gcc names the tile unit's extensions __AMX_TILE__ and __AMX_BF16__; clang (14 here) __AMXTILE__ and __AMXBF16__: a
   clang build took the vector kernel on a Xeon with tiles until both were read. */
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) && (defined(__AMX_BF16__) || defined(__AMXBF16__)) && \
    defined(__AVX512F__) && defined(__linux__)
#define HAVE_AMX 1
#endif

/* Inputs a tile step: 64 bytes of each weight row (the tile's width: the unit's, not a tuning choice); the input
   width must be a multiple of it for the tile kernel, else the vector kernel runs. */
#define AMX_K 32

#ifdef HAVE_AMX
/* y = x W^T (+ bias) for bfloat16 x and bias, rows 1..SPECDEC_MAX_ROWS, in % AMX_K == 0; called where
   specdec_amx() is 1. SPECDEC_OK or SPECDEC_NO_MEMORY. */
SPECDEC_INTERNAL int gemm_amx(const uint16_t* W, const uint16_t* x, const uint16_t* bias, void* y, int rows, int out,
                              int in, int y_bf16, int threads);
#endif
#endif
