// The small operations of a bfloat16 decoder layer, each one pass over its rows instead of torch's
// several (see kernels/cpu_ops.py): the residual add and RMSNorm, the rotary embedding, and the
// SwiGLU gate. Each row is computed by one thread in one fixed order, so a row's bits never depend
// on the other rows or the thread count.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void store_bf16(uint16_t* p, __m512 v) {   // round to nearest even, as torch's .to(bfloat16)
  __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256((__m256i*)p, (__m256i)h);
}

static inline __m512 round_bf16(__m512 v) {              // v rounded to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline int64_t threads_for(int64_t rows, int64_t width, int32_t threads) {
  return rows * width >= (1 << 16) ? threads : 1;        // a decode step's rows are not worth a fork
}

// x [rows, d] (+ residual [rows, d], the sum kept in `sum`): y = bf16(s * rsqrt(mean(s^2) + eps) * w),
// s the row (its bfloat16 sum with the residual), in float32. d a multiple of 16.
extern "C" void add_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, uint16_t* y,
                                  uint16_t* sum, int64_t rows, int64_t d, float eps, int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, d, threads))
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t* xr = x + r * d;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      __m512 v = load_bf16(xr + i);
      if (residual) {
        v = round_bf16(_mm512_add_ps(v, load_bf16(residual + r * d + i)));
        store_bf16(sum + r * d + i, v);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float rstd = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)d + eps);
    const uint16_t* sr = residual ? sum + r * d : xr;
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_bf16(sr + i), _mm512_set1_ps(rstd)), load_bf16(weight + i));
      store_bf16(y + r * d + i, v);
    }
  }
}

// e^v for float32 lanes: v = n ln2 + t, |t| <= ln2 / 2, e^t by Cephes' expf polynomial (about 1 ulp),
// scaled by 2^n. Arguments are clamped to where the result is a finite float.
static inline __m512 exp_ps(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 t = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  t = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), t);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, t), t, _mm512_add_ps(t, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// x [rows, 2 n] = [gate | up] -> y [rows, n] = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + e^-g) in
// float32: the rounding steps of workers.layers.activation.silu_and_mul. n a multiple of 16.
extern "C" void silu_mul_bf16(const uint16_t* x, uint16_t* y, int64_t rows, int64_t n, int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, n, threads))
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t* gate = x + r * 2 * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 g = load_bf16(gate + i);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store_bf16(y + r * n + i, _mm512_mul_ps(silu, load_bf16(gate + n + i)));
    }
  }
}

// The rotary embedding in place on x [tokens, heads, d] (rows `stride` apart, heads d apart) with
// token t's tables cos[t], sin[t] [d] (bfloat16, the sine's first half negated): x = bf16(bf16(x cos) +
// bf16(roll(x) sin)), roll swapping the halves: the rounding steps of workers.layers.rotary.rotate.
// d / 2 a multiple of 16.
extern "C" void rope_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t tokens, int64_t heads,
                          int64_t d, int64_t stride, int32_t threads) {
  const int64_t h = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads_for(tokens, heads * d, threads))
  for (int64_t t = 0; t < tokens; t++) {
    const uint16_t* c = cos + t * d;
    const uint16_t* s = sin + t * d;
    for (int64_t j = 0; j < heads; j++) {
      uint16_t* row = x + t * stride + j * d;
      for (int64_t i = 0; i < h; i += 16) {
        const __m512 a = load_bf16(row + i), b = load_bf16(row + h + i);
        const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, load_bf16(c + i))),
                                        round_bf16(_mm512_mul_ps(b, load_bf16(s + i))));
        const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load_bf16(c + h + i))),
                                        round_bf16(_mm512_mul_ps(a, load_bf16(s + h + i))));
        store_bf16(row + i, lo);
        store_bf16(row + h + i, hi);
      }
    }
  }
}

// Each row's first maximum of x [rows, n] (bfloat16 or float32), as torch's max(dim=-1).indices picks it:
// the lowest index of the largest value, a NaN counting as the largest (the first NaN wins).
static inline __m512 load16(const uint16_t* p) { return load_bf16(p); }
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline float value(const uint16_t* p) {
  uint32_t bits = (uint32_t)*p << 16;
  float v;
  memcpy(&v, &bits, 4);
  return v;
}
static inline float value(const float* p) { return *p; }

template <typename T>
static void argmax(const T* x, int64_t* out, int64_t rows, int64_t n, int32_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows, n, threads))
  for (int64_t r = 0; r < rows; r++) {
    const T* row = x + r * n;
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    __m512i where = _mm512_set1_epi32(-1), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                        14, 15);
    int64_t nan = -1, i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load16(row + i);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {          // a NaN: the first one is the answer
        for (int64_t j = i; j < i + 16 && nan < 0; j++)
          if (value(row + j) != value(row + j)) nan = j;
        break;
      }
      const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);   // strictly larger: the first stays
      best = _mm512_mask_mov_ps(best, more, v);
      where = _mm512_mask_mov_epi32(where, more, index);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    }
    if (nan >= 0) {
      out[r] = nan;
      continue;
    }
    float top = _mm512_reduce_max_ps(best);
    int64_t at = n;                                           // the lowest lane index holding the top
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, best);
    _mm512_store_epi32(indices, where);
    for (int j = 0; j < 16; j++)
      if (values[j] == top && indices[j] >= 0 && indices[j] < at) at = indices[j];
    if (at == n && i > 0) at = 0;                             // all -inf so far: the first is the maximum
    for (; i < n; i++) {                                      // the tail past the last 16
      const float v = value(row + i);
      if (v != v) {
        at = i;
        break;
      }
      if (v > top || at == n) top = v, at = i;
    }
    out[r] = at;
  }
}

extern "C" void argmax_bf16(const uint16_t* x, int64_t* out, int64_t rows, int64_t n, int32_t threads) {
  argmax(x, out, rows, n, threads);
}

extern "C" void argmax_f32(const float* x, int64_t* out, int64_t rows, int64_t n, int32_t threads) {
  argmax(x, out, rows, n, threads);
}
