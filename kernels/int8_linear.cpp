// A linear layer with int8 or 4-bit weights on AVX-512: y = x W^T (+ b), x float32 (see
// kernels/int8_linear.py). The weights come in three kinds:
//
//   PER_CHANNEL  int8 Q with one float32 scale per output: y = (x Q^T) * scale, the scale applied
//                to each output's sum (what --quantization int8 makes);
//   INT8_GROUPS  int8 Q with a float32 scale per output and group of inputs (a GGUF's Q8_0: 32):
//                W = Q * scale;
//   INT4_GROUPS  4-bit codes, two a byte (input 2j in the low nibble), with a scale and a zero
//                code per output and group (compressed-tensors W4A16, a GGUF's Q4_0):
//                W = (code - zero) * scale.
//
// Decode reads every weight once per step, so its time is the weights' bytes: int8 halves
// bfloat16's, 4-bit quarters it. Each weight is widened to float32 in registers (exactly; a grouped
// weight is then multiplied by its scale, one rounding, as the layer's dequantize() computes it),
// and multiplied into 16 lanes of float32 accumulators, 16 inputs at a time in order; the lanes are
// summed in one fixed order at the end, scaled (per channel), then the bias added. A 4 x 4 block of
// outputs shares its loads, and a work item is 16 outputs over a group of rows, so its weight strip
// stays in L1 while the rows pass. A grouped weight is scaled once per load, for all the block's
// rows: its outputs are exactly a float32 matmul of the dequantized weights, summed in that order.
//
// Batch invariance by construction: an output's bits depend on its own row of x and row of W only,
// never on the row count, the other rows, its place in a block, or the thread count (no thread
// splits a sum, and every block size runs the same chain per output).
#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

enum Kind { PER_CHANNEL = 0, INT8_GROUPS = 1, INT4_GROUPS = 2 };

struct Linear {
  const float* x;          // [M, K] float32, K a multiple of 16, rows K apart
  const void* w;           // int8 [N, K], or 4-bit codes uint8 [N, K/2]; N a multiple of 16
  const float* scale;      // [N], or [N, K/group]
  const float* bias;       // [N] or null
  float* y;                // [M, N] float32, rows N apart
  int64_t m, n, k;
  int64_t kind;            // Kind
  int64_t group;           // inputs per scale (grouped kinds), a multiple of 16
  const uint8_t* zero;     // INT4_GROUPS: zero codes uint8 [N, K/group], or null for 8 (symmetric)
};

// The 16 float32 values a 4-bit code stands for in output `row`'s group `g`: (code - zero) * scale,
// rounded once, as the layer's dequantize() computes them. A code then becomes its weight by one
// permute (vpermps), so a group's arithmetic is done once, not for every load.
static inline __m512 int4_values(const Linear& a, int64_t row, int64_t g) {
  const int64_t i = row * (a.k / a.group) + g;
  const __m512i codes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i zero = _mm512_set1_epi32(a.zero ? a.zero[i] : 8);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(codes, zero)), _mm512_set1_ps(a.scale[i]));
}

// 16 weights of output `row` from input k, as float32 (grouped kinds: scaled). `values`: INT4_GROUPS'
// int4_values of the group k is in.
template <int KIND>
static inline __m512 weights(const Linear& a, int64_t row, int64_t k, __m512 values) {
  if constexpr (KIND == INT4_GROUPS) {
    const uint8_t* w = (const uint8_t*)a.w + row * (a.k / 2) + k / 2;
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)w);
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));   // inputs k..k+15 in order
    return _mm512_permutexvar_ps(codes, values);
  } else {
    const int8_t* w = (const int8_t*)a.w + row * a.k + k;
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    if constexpr (KIND == INT8_GROUPS) return _mm512_mul_ps(q, _mm512_set1_ps(a.scale[row * (a.k / a.group) + k / a.group]));
    return q;
  }
}

template <int MB, int KIND>
static void block(const Linear& a, int64_t row, int64_t col) {
  __m512 acc[MB][4];
  __m512 values[4] = {};
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
  const float* x = a.x + row * a.k;
  for (int64_t k = 0; k < a.k; k += 16) {
    if constexpr (KIND == INT4_GROUPS)
      if (k % a.group == 0)
        for (int j = 0; j < 4; j++) values[j] = int4_values(a, col + j, k / a.group);
    __m512 xv[MB];
    for (int i = 0; i < MB; i++) xv[i] = _mm512_loadu_ps(x + i * a.k + k);
    for (int j = 0; j < 4; j++) {
      __m512 wv = weights<KIND>(a, col + j, k, values[j]);
      for (int i = 0; i < MB; i++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < 4; j++) {
      float v = _mm512_reduce_add_ps(acc[i][j]);
      if constexpr (KIND == PER_CHANNEL) v *= a.scale[col + j];
      if (a.bias) v += a.bias[col + j];
      a.y[(row + i) * a.n + col + j] = v;
    }
}

template <int KIND>
static void run(const Linear* a, int32_t threads) {
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
          case 4: block<4, KIND>(*a, row, col); break;
          case 3: block<3, KIND>(*a, row, col); break;
          case 2: block<2, KIND>(*a, row, col); break;
          default: block<1, KIND>(*a, row, col);
        }
      }
    }
  }
}

extern "C" void int8_linear(const Linear* a, int32_t threads) {
  switch (a->kind) {
    case INT8_GROUPS: run<INT8_GROUPS>(a, threads); break;
    case INT4_GROUPS: run<INT4_GROUPS>(a, threads); break;
    default: run<PER_CHANNEL>(a, threads);
  }
}
