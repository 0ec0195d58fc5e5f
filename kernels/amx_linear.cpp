// A bfloat16 linear layer on Intel AMX: y = x W^T (+ b), bfloat16 in and out, float32 inside
// (see kernels/bf16_linear.py).
//
// Batch invariance by construction: every output element is one tile accumulator's sum over the
// inputs, 32 at a time in order, and a work item is a whole block of outputs, so an element's bits
// depend on its own row of x and column of W only, never on the row count, the other rows, the
// block a row falls in, or the thread count (no thread ever splits a sum).
//
// Tiles: 0-3 accumulators (16 x 16 float32), 4-5 rows of x (16 x 32 bfloat16), 6-7 the packed
// weight (16 pairs of inputs x 16 outputs, VNNI). The weight is packed once, in Python, as
// [N / 16][K / 32][16][16][2]: block (n, k) holds W[n*16 + c][k*32 + 2r + i] at [r][c][i].
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

struct Linear {
  const uint16_t* x;       // [M, K] bfloat16, M a multiple of 16, K of 32, rows K apart
  const uint16_t* w;       // packed [N / 16][K / 32][16][16][2]
  const float* bias;       // [N] or null
  void* y;                 // [M, N] bfloat16, or float32 where f32 (logits: no rounding), rows N apart
  int64_t m, n, k;         // n a multiple of 16
  int64_t f32;             // 1: y is float32
};

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void configure_tiles() {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Blocks of MB x 16 rows and NB x 16 outputs (MB, NB in {1, 2}).
template <int MB, int NB>
static void block(const Linear& a, int64_t row, int64_t col, float* buf) {
  const int64_t xs = a.k * 2, kb = a.k / 32;
  const uint16_t* x = a.x + row * a.k;
  const uint16_t* w0 = a.w + (col / 16) * kb * 512;
  const uint16_t* w1 = w0 + kb * 512;
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MB == 2) _tile_zero(2);
  if (MB == 2 && NB == 2) _tile_zero(3);
  for (int64_t i = 0; i < kb; i++) {
    _tile_loadd(4, x + i * 32, xs);
    _tile_loadd(6, w0 + i * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) {
      _tile_loadd(7, w1 + i * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MB == 2) {
      _tile_loadd(5, x + 16 * a.k + i * 32, xs);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, buf, 128);
  if (NB == 2) _tile_stored(1, buf + 16, 128);
  if (MB == 2) _tile_stored(2, buf + 16 * 32, 128);
  if (MB == 2 && NB == 2) _tile_stored(3, buf + 16 * 32 + 16, 128);
  for (int r = 0; r < MB * 16; r++) {
    for (int c = 0; c < NB; c++) {
      __m512 v = _mm512_loadu_ps(buf + r * 32 + c * 16);
      if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + col + c * 16));
      const int64_t at = (row + r) * a.n + col + c * 16;
      if (a.f32) {
        _mm512_storeu_ps((float*)a.y + at, v);
        continue;
      }
      __m256bh h = _mm512_cvtneps_pbh(v);  // round to nearest even, as torch's .to(bfloat16)
      memcpy((uint16_t*)a.y + at, &h, 32);
    }
  }
}

extern "C" int amx_init() {  // the process's permission to use the tile registers (Linux)
  return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}

// A work item is 32 outputs over a group of rows, 32 at a time: its weight block (K x 32) stays in
// L1 for the group, and the group's rows (at most 1 MiB) stay in L2 while the threads walk every
// output for them. Items go group by group, so threads share a group's rows.
extern "C" void amx_linear(const Linear* a, int32_t threads) {
  const int64_t row_blocks = (a->m + 31) / 32, col_blocks = (a->n + 31) / 32;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(8, (1 << 20) / (a->k * 2 * 32)));
  const int64_t groups = (row_blocks + group - 1) / group, items = groups * col_blocks;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    alignas(64) float buf[32 * 32];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) {
      const int64_t first = (i / col_blocks) * group, col = (i % col_blocks) * 32;
      const bool two_n = col + 32 <= a->n;
      for (int64_t b = first; b < std::min(first + group, row_blocks); b++) {
        const int64_t row = b * 32;
        const bool two_m = row + 32 <= a->m;
        if (two_m && two_n) block<2, 2>(*a, row, col, buf);
        else if (two_m) block<2, 1>(*a, row, col, buf);
        else if (two_n) block<1, 2>(*a, row, col, buf);
        else block<1, 1>(*a, row, col, buf);
      }
    }
    _tile_release();
  }
}
