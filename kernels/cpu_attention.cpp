// Paged causal attention on the CPU, reading the KV pool in place (see kernels/cpu.py).
//
// Work items are (sequence, tile of its queries), or with few of them (sequence, tile, KV head);
// threads take items in turn from a shared counter. A "row" is one query under one query head.
// Batch invariance: a row's arithmetic depends only on its own position, query and KV. Its KV is
// walked in tiles of TILE positions from position 0, at fixed offsets; within a tile each score is
// one fixed summation tree over the head dimension, the softmax's maximum, sum and rescaling are
// per tile (online softmax), and the weighted values are added key after key over the row's own
// keys only. Which other rows share an item, a tile or a thread changes nothing.
//
// A float32 pool is read as it is. A bfloat16 pool's scores take bfloat16 pairs, as AVX512_BF16's
// vdpbf16ps does (each product exact in float32, added odd element first; emulated where the CPU
// lacks it), and its values are widened to float32; everything accumulates in float32. A quantized
// pool (int8 or fp8 e4m3 rows of head_dim values, then the row's bfloat16 scale) is dequantized as its
// tile is loaded, value x scale in float32 (exact: kernels.reference.dequantize_kv's bits), and
// attended in float32 whatever the queries' dtype.
//
// Written with GCC vector extensions (16 float lanes; one AVX-512 register where the CPU has it)
// and built with -ffp-contract=off: the only fused multiply-adds are the explicit ones.
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));
typedef uint16_t h16_un __attribute__((vector_size(32), aligned(2)));

constexpr int LANES = 16, TILE = 64, MAX_CHUNKS = 16;  // head_dim up to 256
constexpr int64_t PARALLEL = 2048;  // (row, key) pairs from which a call takes threads: below, under
                                    // a few microseconds of work, waking them would cost more than it saves

static const float NEG_INF = -__builtin_inff();

static inline v16 splat(float x) {  // a broadcast (v16{} + x would add 0.0f to x first)
#if defined(__AVX512F__)
  return (v16)_mm512_set1_ps(x);
#else
  v16 v;
  for (int i = 0; i < LANES; i++) v[i] = x;
  return v;
#endif
}
static inline v16 load(const void* p) {  // unaligned (memcpy: GCC's unaligned vector type goes through the stack)
  v16 x;
  memcpy(&x, p, sizeof x);
  return x;
}
static inline void store(float* p, v16 x) { memcpy(p, &x, sizeof x); }

static inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;  // two roundings, but the same ones for every row
#endif
}

static inline v16 bf16_to_float(const uint16_t* p) {  // 16 of them; bfloat16 is float32's upper half
#if defined(__AVX512F__)
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  return (v16)(__builtin_convertvector(*(const h16_un*)p, u16) << 16);
#endif
}

// acc + a . b per lane, a and b holding 16 pairs of bfloat16 each (their bit patterns): vdpbf16ps.
static inline v16 dot_pairs(v16 acc, v16 a, v16 b) {
#if defined(__AVX512BF16__)
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
  u16 x = (u16)a, y = (u16)b;
  const u16 high = u16{} + 0xffff0000u;
  acc = fmadd((v16)(x & high), (v16)(y & high), acc);  // exact products: one rounding each, as there
  return fmadd((v16)(x << 16), (v16)(y << 16), acc);
#endif
}

static inline uint16_t float_to_bf16(float x) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// e^x for x <= 0 (Cephes' expf: within 2 ulp); x is floored at -87, where e^x is still normal
// (the denormal range is 10-100x slower and its weights are noise next to the maximum's 1).
static inline v16 vexp(v16 x) {
  const v16 floor = splat(-87.0f), round = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  x = x < floor ? floor : x;
  v16 n = (x * 1.44269504088896341f + round) - round;
  v16 r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  v16 p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r + 1.0f);
  return p * (v16)((__builtin_convertvector(n, i16) + 127) << 23);
}

template <typename V>
static inline V vmax(V a, V b) { return a > b ? a : b; }

static inline v8 low(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 high(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline v4 low(v8 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
static inline v4 high(v8 v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }

static inline float hmax(v16 v) {
  v4 b = vmax(low(vmax(low(v), high(v))), high(vmax(low(v), high(v))));
  return vmax(vmax(b[0], b[2]), vmax(b[1], b[3]));
}

static inline float hsum(v16 v) {  // a fixed tree: lanes i + i+8, then i + i+4, ...
  v8 a = low(v) + high(v);
  v4 b = low(a) + high(a);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Two vectors of per-lane partial sums (one key each, or keys interleaved by an earlier step)
// folded into one: each key's partials halve. Four steps take 16 keys' partials to 16 sums, every
// key by the same tree; the lanes end in bit-reversed key order.
static inline v16 fold8(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16 fold4(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline v16 fold2(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static inline v16 fold1(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Scores of one query against 16 keys, in key order: `partial(key)` gives a key's 16 lane sums.
template <typename Partial, typename E>
static inline v16 dots16(Partial partial, const E* const* keys) {
  static const int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};  // bit-reversed
  v16 a[8], b[4];
  for (int i = 0; i < 8; i++) a[i] = fold8(partial(keys[order[2 * i]]), partial(keys[order[2 * i + 1]]));
  for (int i = 0; i < 4; i++) b[i] = fold4(a[2 * i], a[2 * i + 1]);
  return fold1(fold2(b[0], b[1]), fold2(b[2], b[3]));
}

// The arguments, every field 8 bytes (kernels/cpu.py packs them): one layer's call, and the
// step's batch (the same for every layer).
struct Layer {
  const void* q;  // [T, Hq, D], D contiguous
  int64_t q_stride_t, q_stride_h;
  const void *k, *v;  // [blocks, block_size, Hkv, D], D contiguous
  int64_t stride_block, stride_slot, stride_head;
  void* out;  // contiguous [T, Hq, D]
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  double scale;
  int64_t bf16;  // q and out in bfloat16 (else float32); the pool too, unless quantized
  int64_t kv;    // the pool: 0 in q's dtype, 1 int8, 2 fp8 e4m3 (rows of head_dim + 2 bytes)
};

struct Step {
  const int32_t *cu_seqlens_q, *seq_lens, *block_tables;
  int64_t table_stride;
  const int32_t* items;  // [num_items, 3]: sequence, first query, query count
  int64_t num_items;
  int64_t pairs;  // (query, key) pairs over all items, at most
};

struct Batch : Layer, Step {};

struct Scratch {  // one thread's buffers; rows are padded to whole chunks
  std::vector<float> q, acc, m, l, p, corr;
  std::vector<uint16_t> q16;
  std::vector<unsigned char> keys, values;
  std::vector<int32_t> valid;
  std::vector<const void*> kp, vp;
};

thread_local Scratch scratch;  // kept from call to call

// fp8 e4m3 (no infinities; 0x7f and 0xff are NaN, never stored: quantize_kv clamps to +-448) to float.
static float fp8_to_float(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float x = e ? __builtin_ldexpf(1.0f + m / 8.0f, e - 7) : __builtin_ldexpf(m / 8.0f, -6);
  if (e == 15 && m == 7) x = __builtin_nanf("");
  return b & 0x80 ? -x : x;
}

static const struct Fp8Table {  // a lookup beats decoding the bits in registers here (measured: 10 vs 15 ms)
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; i++) v[i] = fp8_to_float((uint8_t)i);
  }
} fp8_table;

// A quantized row (kv 1: int8, 2: fp8) of n values and its bfloat16 scale, into float32: value x scale,
// each product exact, so the same bits as kernels.reference.dequantize_kv's.
static void dequantize(float* out, const uint8_t* row, int64_t n, int64_t kv) {
  uint32_t bits = (uint32_t)(row[n] | row[n + 1] << 8) << 16;
  float scale;
  memcpy(&scale, &bits, 4);
  if (kv == 1)
    for (int64_t d = 0; d < n; d++) out[d] = (float)(int8_t)row[d] * scale;
  else
    for (int64_t d = 0; d < n; d++) out[d] = fp8_table.v[row[d]] * scale;
}

// E: the element the scores take, float or uint16_t (bfloat16: a bfloat16 pool). KV: a quantized pool
// (int8 or fp8, Layer::kv), E then float: its rows are dequantized into float32 copies.
template <int NC, typename E, bool KV = false>
struct Item {
  const Batch& a;
  Scratch& s;
  int64_t seq, first, count, h0, h1, group, start;  // start: position of the item's first query
  float scale = (float)a.scale;  // float32 arithmetic, as torch's with a Python float
  static constexpr bool BF16 = std::is_same_v<E, uint16_t>;
  static constexpr int64_t width = NC * LANES;                              // a row of values or of q
  static constexpr int64_t key_width = BF16 ? (NC + 1) / 2 * 2 * LANES : width;  // a key: whole pairs of lanes
  static constexpr int64_t row = key_width > width ? key_width : width;     // a copied key or value
  static constexpr int GROUP = NC <= 4 ? 4 : 16 / NC;  // rows whose values are added together (in registers)

  void run() {
    int64_t rows = (h1 - h0) * count * group;
    if (BF16)
      s.q16.assign(rows * key_width, 0);
    else
      s.q.assign(rows * width, 0.0f);
    s.acc.assign(rows * width, 0.0f);
    s.m.assign(rows, NEG_INF);
    s.l.assign(rows, 0.0f);
    s.p.resize(GROUP * TILE);
    s.corr.resize(GROUP);
    s.valid.resize(GROUP);
    load_queries();
    int64_t last = start + count - 1;
    prefetch_tile(0, last);
    for (int64_t base = 0; base <= last; base += TILE) {
      int64_t keys = last + 1 - base < TILE ? last + 1 - base : TILE;
      load_tile(base, keys);
      prefetch_tile(base + TILE, last);
      for (int64_t h = h0; h < h1; h++) {
        int64_t head_rows = count * group, r0 = (h - h0) * head_rows;
        int64_t skip = base > start ? (base - start) * group : 0;  // rows before the tile: none of its keys
        for (int64_t r = r0 + skip; r < r0 + head_rows; r += GROUP)
          attend(h - h0, r, r + GROUP < r0 + head_rows ? GROUP : r0 + head_rows - r, base);
      }
    }
    write_out();
  }

  int64_t position(int64_t row) const { return start + row % (count * group) / group; }

  // Float32 queries times the scale; bfloat16 ones as they are (the scale goes on their scores).
  void load_queries() {
    for (int64_t h = h0; h < h1; h++)
      for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++) {
          int64_t r = ((h - h0) * count + i) * group + g;
          int64_t off = (a.cu_seqlens_q[seq] + first + i) * a.q_stride_t + (h * group + g) * a.q_stride_h;
          for (int64_t d = 0; d < a.head_dim; d++) {
            if (BF16) {
              s.q16[r * key_width + d] = ((const uint16_t*)a.q)[off + d];
            } else if (KV && a.bf16) {  // bfloat16 queries over a quantized pool: widened, exactly
              uint32_t bits = (uint32_t)((const uint16_t*)a.q)[off + d] << 16;
              float x;
              memcpy(&x, &bits, 4);
              s.q[r * width + d] = x * scale;
            } else {
              s.q[r * width + d] = ((const float*)a.q)[off + d] * scale;
            }
          }
        }
  }

  // Asks for the rows of the tile at `base` (up to position `last`) ahead of their use: the keys and
  // values of a sequence's blocks are scattered over the pool, and a tile's compute is about as long
  // as its rows take to come from memory, so the next tile's are fetched while this one is computed.
  void prefetch_tile(int64_t base, int64_t last) const {
    const int64_t bytes = a.head_dim * (KV ? 1 : (int64_t)sizeof(E));
    const int64_t unit = KV ? 1 : (int64_t)sizeof(E);   // the pool's strides are in its elements
    const int32_t* table = a.block_tables + seq * a.table_stride;
    for (int64_t p = base; p <= last && p < base + TILE; p++) {
      int64_t slot = table[p / a.block_size] * a.stride_block + p % a.block_size * a.stride_slot;
      for (int64_t h = h0; h < h1; h++) {
        const char* k = (const char*)a.k + (slot + h * a.stride_head) * unit;
        const char* v = (const char*)a.v + (slot + h * a.stride_head) * unit;
        for (int64_t off = 0; off < bytes; off += 64) {
          __builtin_prefetch(k + off, 0, 3);
          __builtin_prefetch(v + off, 0, 3);
        }
      }
    }
  }

  // Pointers to the tile's keys and values of each head of the item: into the pool itself when its
  // rows are whole chunks, else into zero-padded copies. Past `keys`, a zero row.
  void load_tile(int64_t base, int64_t keys) {
    int64_t heads = h1 - h0;
    bool direct = !KV && a.head_dim == row;
    s.kp.resize(heads * TILE);
    s.vp.resize(heads * TILE);
    if (!direct) {
      s.keys.assign(heads * TILE * row * sizeof(E), 0);
      s.values.assign(heads * TILE * row * sizeof(E), 0);
    }
    static const float zero[MAX_CHUNKS * LANES] = {};
    const int32_t* table = a.block_tables + seq * a.table_stride;
    int64_t block = base / a.block_size, offset = base % a.block_size;  // of position base + j
    for (int64_t j = 0; j < TILE; j++) {
      int64_t slot = j < keys ? table[block] * a.stride_block + offset * a.stride_slot : 0;
      if (++offset == a.block_size) block++, offset = 0;
      for (int64_t h = 0; h < heads; h++) {
        int64_t at = h * TILE + j;
        int64_t at_row = slot + (h0 + h) * a.stride_head;  // in elements: bytes for a quantized pool
        const E *k = (const E*)a.k + at_row, *v = (const E*)a.v + at_row;
        if (j >= keys) {
          s.kp[at] = s.vp[at] = zero;
        } else if (KV) {
          float *kd = (float*)&s.keys[at * row * sizeof(E)], *vd = (float*)&s.values[at * row * sizeof(E)];
          dequantize(kd, (const uint8_t*)a.k + at_row, a.head_dim, a.kv);
          dequantize(vd, (const uint8_t*)a.v + at_row, a.head_dim, a.kv);
          s.kp[at] = kd;
          s.vp[at] = vd;
        } else if (direct) {
          s.kp[at] = k;
          s.vp[at] = v;
        } else {
          s.kp[at] = memcpy(&s.keys[at * row * sizeof(E)], k, a.head_dim * sizeof(E));
          s.vp[at] = memcpy(&s.values[at * row * sizeof(E)], v, a.head_dim * sizeof(E));
        }
      }
    }
  }

  // Rows r .. r+n-1 (one KV head's, consecutive; n <= GROUP) against the tile at `base`.
  template <int N = 1>
  void attend(int64_t head, int64_t r, int64_t n, int64_t base) {
    if constexpr (N < GROUP)
      if (n > N) return attend<N + 1>(head, r, n, base);
    for (int i = 0; i < N; i++) {
      int64_t valid = position(r + i) - base + 1;
      s.valid[i] = valid < TILE ? (int32_t)valid : TILE;
    }
    weights<N>(r, &s.kp[head * TILE]);
    values<N>(r, &s.vp[head * TILE]);
  }

  // The rows' scores over the tile's first `valid` keys, and their softmax weights into s.p (zero
  // past `valid`); updates each row's maximum and sum and sets its factor for earlier values. Done
  // stage by stage over the rows, whose chains of dependent steps then overlap.
  template <int N>
  void weights(int64_t r, const void* const* kp) {
    constexpr int T = TILE / LANES;
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 x[N][T];
    float before[N], now[N];
    for (int i = 0; i < N; i++)
      for (int t = 0; t < T; t++)  // past the row's keys: -inf, the same as computing and masking
        x[i][t] = t * LANES >= s.valid[i] ? splat(NEG_INF) : scores(r + i, (const E* const*)kp + t * LANES);
    for (int i = 0; i < N; i++) {
      float top = NEG_INF;
      for (int t = 0; t < T; t++) {
        x[i][t] = lane + t * LANES < s.valid[i] ? x[i][t] : splat(NEG_INF);
        top = vmax(top, hmax(x[i][t]));
      }
      before[i] = s.m[r + i];
      now[i] = vmax(before[i], top);
    }
    v16 shift = v16{};  // every row's correction in one exp: lane i is row i's
    for (int i = 0; i < N; i++) shift[i] = before[i] - now[i];
    v16 corr = vexp(shift);
    for (int i = 0; i < N; i++) {
      v16 sum = v16{};
      for (int t = 0; t < T; t++) {
        v16 e = vexp(x[i][t] - now[i]);
        e = lane + t * LANES < s.valid[i] ? e : v16{};
        store(&s.p[i * TILE + t * LANES], e);
        sum += e;
      }
      s.corr[i] = before[i] == NEG_INF ? 0.0f : corr[i];
      s.m[r + i] = now[i];
      s.l[r + i] = s.l[r + i] * s.corr[i] + hsum(sum);
    }
  }

  v16 scores(int64_t r, const E* const* keys) {
    if constexpr (BF16) {
      constexpr int K = key_width / (2 * LANES);
      v16 q[K];
      for (int c = 0; c < K; c++) q[c] = load(&s.q16[r * key_width + c * 2 * LANES]);
      return dots16([&](const uint16_t* k) {
        v16 sum = dot_pairs(v16{}, q[0], load(k));
        for (int c = 1; c < K; c++) sum = dot_pairs(sum, q[c], load(k + c * 2 * LANES));
        return sum;
      }, keys) * scale;
    } else {
      v16 q[NC];
      for (int c = 0; c < NC; c++) q[c] = load(&s.q[r * width + c * LANES]);
      return dots16([&](const float* k) {
        v16 sum = q[0] * load(k);
        for (int c = 1; c < NC; c++) sum = fmadd(q[c], load(k + c * LANES), sum);
        return sum;
      }, keys);
    }
  }

  static v16 value(const E* v, int c) {  // chunk c of a value row, in float32
    if constexpr (BF16)
      return bf16_to_float(v + c * LANES);
    else
      return load(v + c * LANES);
  }

  // The rows' values: scaled by their correction, then each row's weighted values added key after
  // key, over its own keys only (adding a zero past them would turn a -0 into +0).
  template <int N>
  void values(int64_t r, const void* const* vpv) {
    const E* const* vp = (const E* const*)vpv;
    int32_t lo = TILE, hi = 0;
    v16 acc[N][NC];
    for (int i = 0; i < N; i++) {
      lo = s.valid[i] < lo ? s.valid[i] : lo;
      hi = s.valid[i] > hi ? s.valid[i] : hi;
      for (int c = 0; c < NC; c++) acc[i][c] = load(&s.acc[(r + i) * width + c * LANES]) * s.corr[i];
    }
    for (int32_t j = 0; j < lo; j++) {
      v16 w[N];
      for (int i = 0; i < N; i++) w[i] = splat(s.p[i * TILE + j]);
      for (int c = 0; c < NC; c++) {
        v16 x = value(vp[j], c);
        for (int i = 0; i < N; i++) acc[i][c] = fmadd(w[i], x, acc[i][c]);
      }
    }
    for (int32_t j = lo; j < hi; j++)  // the diagonal tile
      for (int i = 0; i < N; i++)
        if (j < s.valid[i])
          for (int c = 0; c < NC; c++) acc[i][c] = fmadd(splat(s.p[i * TILE + j]), value(vp[j], c), acc[i][c]);
    for (int i = 0; i < N; i++)
      for (int c = 0; c < NC; c++) store(&s.acc[(r + i) * width + c * LANES], acc[i][c]);
  }

  void write_out() {
    for (int64_t h = h0; h < h1; h++)
      for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++) {
          int64_t row = ((h - h0) * count + i) * group + g;
          int64_t off = ((a.cu_seqlens_q[seq] + first + i) * a.num_heads + h * group + g) * a.head_dim;
          float o[MAX_CHUNKS * LANES];
          for (int c = 0; c < NC; c++) store(o + c * LANES, load(&s.acc[row * width + c * LANES]) / s.l[row]);
          for (int64_t d = 0; d < a.head_dim; d++) {
            if (a.bf16)
              ((uint16_t*)a.out)[off + d] = float_to_bf16(o[d]);
            else
              ((float*)a.out)[off + d] = o[d];
          }
        }
  }
};

template <int NC, typename E, bool KV>
static void run_item(const Batch& a, Scratch& s, int64_t index, int64_t heads_per_item) {
  int64_t parts = a.num_kv_heads / heads_per_item;
  const int32_t* it = a.items + index / parts * 3;
  int64_t seq = it[0], h0 = index % parts * heads_per_item;
  int64_t q_len = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq];
  Item<NC, E, KV>{a, s, seq, it[1], it[2], h0, h0 + heads_per_item, a.num_heads / a.num_kv_heads,
           a.seq_lens[seq] - q_len + it[1]}.run();
}

typedef void (*ItemFn)(const Batch&, Scratch&, int64_t, int64_t);

// Rows are padded to 1, 2, 4, 8 or 16 chunks (fewer variants to compile; the padding adds zeros).
template <int NC, typename E, bool KV = false>
static ItemFn pick(int64_t chunks) {
  if constexpr (NC > MAX_CHUNKS) return nullptr;
  else return chunks <= NC ? run_item<NC, E, KV> : pick<2 * NC, E, KV>(chunks);
}

extern "C" int paged_attention(const Layer* layer, const Step* step, int32_t threads) {
  Batch batch;
  static_cast<Layer&>(batch) = *layer;
  static_cast<Step&>(batch) = *step;
  const Batch* a = &batch;
  int64_t chunks = (a->head_dim + LANES - 1) / LANES;
  ItemFn fn = a->kv ? pick<1, float, true>(chunks) : a->bf16 ? pick<1, uint16_t>(chunks) : pick<1, float>(chunks);
  if (!fn || a->num_heads % a->num_kv_heads) return -1;
  // few items: one per KV head, so that every thread has work
  int64_t per = a->num_items >= 4 * threads ? a->num_kv_heads : 1;
  int64_t total = a->num_items * (a->num_kv_heads / per);
  if (threads <= 1 || total <= 1 || a->pairs * a->num_heads < PARALLEL) {
    for (int64_t i = 0; i < total; i++) fn(*a, scratch, i, per);
    return 0;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) fn(*a, scratch, i, per);
  return 0;
}

// store_kv: token t's key and value rows [Hkv, D] (strided) into slot slots[t] of the pool (slot
// -1: a padding token, skipped). Every field 8 bytes, as kernels/cpu.py packs them.
struct Store {
  const char *key, *value;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;  // in bytes, as the rest
  char *k, *v;
  int64_t stride_block, stride_slot, stride_head;
  const int64_t* slots;
  int64_t num_tokens, num_kv_heads, row_bytes, block_size;
};

extern "C" void store_kv(const Store* s) {
  for (int64_t t = 0; t < s->num_tokens; t++) {
    int64_t slot = s->slots[t];
    if (slot < 0) continue;
    int64_t at = slot / s->block_size * s->stride_block + slot % s->block_size * s->stride_slot;
    for (int64_t h = 0; h < s->num_kv_heads; h++) {
      memcpy(s->k + at + h * s->stride_head, s->key + t * s->key_stride_t + h * s->key_stride_h, s->row_bytes);
      memcpy(s->v + at + h * s->stride_head, s->value + t * s->value_stride_t + h * s->value_stride_h, s->row_bytes);
    }
  }
}
