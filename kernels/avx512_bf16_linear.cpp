// A bfloat16 linear layer on AVX-512 BF16 (vdpbf16ps), for CPUs without AMX: y = x W^T (+ b),
// bfloat16 in and out, float32 inside (see kernels/bf16_linear.py, which packs the weight and picks
// this kernel or the AMX one).
//
// The weight comes in AMX's packed layout, which is also this instruction's: for each block of 16
// outputs, input pair p's 16 x 2 values are 64 contiguous bytes, pairs in order. A lane of an
// accumulator is one output: vdpbf16ps adds the products of one pair of inputs to it, pair after
// pair, so every output is one chain over its inputs in order.
//
// Batch invariance by construction: an output's bits depend on its own row of x and row of W only,
// never on the row count, the other rows, its place in a block, or the thread count (no thread
// splits a sum; every block size runs the same chain per output).
//
// A work item is NB x 16 outputs over a group of rows: its weight strip (K x 32 bfloat16 at most
// 96 KiB) stays in L1/L2 while the rows pass MB at a time. One row (a decode step of one request)
// streams the weights once, at the memory's bandwidth.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

struct Linear {
  const uint16_t* x;       // [M, K] bfloat16, K a multiple of 32, rows K apart
  const uint16_t* w;       // packed [N / 16][K / 2][16][2]
  const float* bias;       // [N] or null
  void* y;                 // [M, N] bfloat16, or float32 where f32 (logits: no rounding), rows N apart
  int64_t m, n, k;         // n a multiple of 16
  int64_t f32;             // 1: y is float32
};

// `ahead`: the weight strip this thread takes next, fetched into L2 as this one is computed (a strip
// is read from memory once, for all the rows of the group, and the memory is the slower part for
// it), or null.
template <int MB, int NB>
static inline void block(const Linear& a, int64_t row, int64_t col, const char* ahead) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = a.k / 2;
  const uint32_t* x = (const uint32_t*)(a.x + row * a.k);   // a row's inputs, a pair per 32 bits
  const uint16_t* w = a.w + (col / 16) * pairs * 32;
  for (int64_t p = 0; p < pairs; p++) {
    if (ahead)
      for (int j = 0; j < NB; j++) _mm_prefetch(ahead + (j * pairs + p) * 64, _MM_HINT_T1);
    __m512bh wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * pairs + p) * 32);
    for (int i = 0; i < MB; i++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * pairs + p]);
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) {
      __m512 v = acc[i][j];
      if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + col + j * 16));
      const int64_t at = (row + i) * a.n + col + j * 16;
      if (a.f32) {
        _mm512_storeu_ps((float*)a.y + at, v);
        continue;
      }
      __m256bh h = _mm512_cvtneps_pbh(v);  // round to nearest even, as torch's .to(bfloat16)
      memcpy((uint16_t*)a.y + at, &h, 32);
    }
}

template <int NB>
static void rows(const Linear& a, int64_t first, int64_t last, int64_t col, const char* ahead) {
  int64_t row = first;
  for (; row + 6 <= last; row += 6, ahead = nullptr) block<6, NB>(a, row, col, ahead);
  switch (last - row) {
    case 5: block<5, NB>(a, row, col, ahead); break;
    case 4: block<4, NB>(a, row, col, ahead); break;
    case 3: block<3, NB>(a, row, col, ahead); break;
    case 2: block<2, NB>(a, row, col, ahead); break;
    case 1: block<1, NB>(a, row, col, ahead); break;
  }
}

extern "C" void bf16_linear(const Linear* a, int32_t threads) {
  // One row: 16 outputs an item, for the threads to share the weights' bytes evenly; more rows: 32
  // outputs (6 rows x 2 blocks: 12 accumulators, 2 loads and 6 broadcasts per pair of inputs).
  const int64_t width = a->m == 1 ? 16 : 32;
  const int64_t col_items = (a->n + width - 1) / width;
  const int64_t group = std::max<int64_t>(6, std::min<int64_t>(96, (1 << 18) / (a->k * 2)) / 6 * 6);
  const int64_t groups = (a->m + group - 1) / group, items = groups * col_items;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < items; i++) {
    const int64_t first = (i / col_items) * group, last = std::min(first + group, a->m);
    const int64_t col = (i % col_items) * width;
    // with one row the hardware's prefetch keeps up (the weights stream at the memory's bandwidth)
    const char* ahead = width == 32 && col + 2 * width <= a->n ? (const char*)(a->w + (col + width) * a->k) : nullptr;
    if (col + 32 <= a->n && width == 32) rows<2>(*a, first, last, col, ahead);
    else rows<1>(*a, first, last, col, ahead);
  }
}
