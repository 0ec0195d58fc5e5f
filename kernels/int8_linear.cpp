// A linear layer with int8 weights on AVX-512: y = (x Q^T) * scale (+ b), x float32, Q int8 with one
// float32 scale per output (see kernels/int8_linear.py).
//
// Decode reads every weight once per step, so its time is the weights' bytes: int8 halves
// bfloat16's. Each weight is widened to float32 in registers (exactly) and multiplied into 16 lanes
// of float32 accumulators, 16 inputs at a time in order; the lanes are summed in one fixed order
// at the end, scaled, then the bias added. A 4 x 4 block of outputs shares its loads, and a work
// item is 16 outputs over a group of rows, so its weight strip stays in L1 while the rows pass.
//
// Batch invariance by construction: an output's bits depend on its own row of x and row of Q only,
// never on the row count, the other rows, its place in a block, or the thread count (no thread
// splits a sum, and every block size runs the same chain per output).
#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

struct Linear {
  const float* x;          // [M, K] float32, K a multiple of 16, rows K apart
  const int8_t* w;         // [N, K] int8, N a multiple of 16, rows K apart
  const float* scale;      // [N]
  const float* bias;       // [N] or null
  float* y;                // [M, N] float32, rows N apart
  int64_t m, n, k;
};

template <int MB>
static void block(const Linear& a, int64_t row, int64_t col) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
  const float* x = a.x + row * a.k;
  const int8_t* w = a.w + col * a.k;
  for (int64_t k = 0; k < a.k; k += 16) {
    __m512 xv[MB];
    for (int i = 0; i < MB; i++) xv[i] = _mm512_loadu_ps(x + i * a.k + k);
    for (int j = 0; j < 4; j++) {
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + j * a.k + k))));
      for (int i = 0; i < MB; i++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < 4; j++) {
      float v = _mm512_reduce_add_ps(acc[i][j]) * a.scale[col + j];
      if (a.bias) v += a.bias[col + j];
      a.y[(row + i) * a.n + col + j] = v;
    }
}

extern "C" void int8_linear(const Linear* a, int32_t threads) {
  const int64_t col_items = a->n / 16;
  const int64_t group = std::max<int64_t>(4, std::min<int64_t>(64, (1 << 18) / (a->k * 4)) / 4 * 4);
  const int64_t groups = (a->m + group - 1) / group, items = groups * col_items;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < items; i++) {
    const int64_t first = (i / col_items) * group, last = std::min(first + group, a->m);
    const int64_t col0 = (i % col_items) * 16;
    for (int64_t row = first; row < last; row += 4) {
      for (int64_t col = col0; col < col0 + 16; col += 4) {
        switch (std::min<int64_t>(4, last - row)) {
          case 4: block<4>(*a, row, col); break;
          case 3: block<3>(*a, row, col); break;
          case 2: block<2>(*a, row, col); break;
          default: block<1>(*a, row, col);
        }
      }
    }
  }
}
