// Row attention for CPUs: every query attends over exactly the key columns it may see, in column
// order, with the same float32 steps whatever else the call holds (fly_llm/attention.py).
//
// query [B, H, q, D], key/value [B, Hkv, kv, D] (float32 or bfloat16, any strides with D innermost),
// an optional boolean mask [B, q, kv] (true: may attend; absent: causal, query i sees columns
// 0 .. kv - q + i). Output [B, q, H, D] in the inputs' dtype. For one query and head:
//   s_t = scale * (q . k_t)   over its allowed columns t (ascending), dot products in one fixed order
//   p_t = exp(s_t - max s), Z = sum p_t (ascending), out = (sum p_t v_t) / Z (ascending)
// A query that may see nothing outputs zeros. Threads (at::parallel_for) split units of (batch row,
// kv head, up to 8 queries), each unit does the heads sharing its kv head; a query's arithmetic
// depends on that query, its allowed columns and their keys and values only (never on the lanes or
// positions they land in), so its output is the same bit for bit alone, in a 16-token verify, a
// 128-token prefill chunk or any batch, at any thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpLow = -87.3f;  // exp below this is < 1.2e-38: taken as exp(-87.3)

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// exp(x) for x <= 0 (Cephes' expf: n = round(x log2 e), r = x - n ln 2, a degree-5 polynomial, times 2^n).
__attribute__((target("avx2,fma")))
inline float exp_scalar(float x) {
  x = std::max(x, kExpLow);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, 4);
  return p;
}

__attribute__((target("avx512f")))
inline __m512 exp_avx512(__m512 x) {  // the same steps as exp_scalar, 16 lanes (bit for bit equal)
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i shifted = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), shifted));
}

// d values as float32 (a bfloat16 is the upper half of a float32: exact).
__attribute__((target("avx2")))
void widen(const at::BFloat16* in, float* out, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
  for (; i < d; ++i) out[i] = static_cast<float>(in[i]);
}

void widen(const float* in, float* out, int64_t d) { std::memcpy(out, in, d * sizeof(float)); }

// The three inner loops, on AVX-512 (d a multiple of 16) or AVX2: one path per process. `keys` and
// `values` hold the unit columns from `first` on (one block of them); scores and values take the
// `group` heads that share a kv head (head r's query at q + r * d, its scores at stride `stride`,
// its accumulator at acc + r * d), so a key or value row read from L2 serves every head from L1;
// each head's arithmetic is the same as alone:
// scores: out_r[t] = scale * (q_r . keys[own[t] - first]);
// values: acc_r += sum_t p_r[t] * values[own[t] - first], t ascending per lane;
// exp_sum: s_t <- exp(s_t - top), returns their sum, t ascending.
struct Avx512 {
  // Four dot products; each key's 16 lanes are summed in the same tree whatever slot it takes.
  __attribute__((target("avx512f")))
  static __m128 dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                     int64_t d) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k0));
    __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k1));
    __m512 c = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k2));
    __m512 e = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k3));
    for (int64_t i = 16; i < d; i += 16) {
      const __m512 x = _mm512_loadu_ps(q + i);
      a = _mm512_fmadd_ps(x, _mm512_loadu_ps(k0 + i), a);
      b = _mm512_fmadd_ps(x, _mm512_loadu_ps(k1 + i), b);
      c = _mm512_fmadd_ps(x, _mm512_loadu_ps(k2 + i), c);
      e = _mm512_fmadd_ps(x, _mm512_loadu_ps(k3 + i), e);
    }
    // lanes i + (i + 8): [a 0-7 | b 0-7] and [c 0-7 | e 0-7]
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 ce = _mm512_add_ps(_mm512_shuffle_f32x4(c, e, 0x44), _mm512_shuffle_f32x4(c, e, 0xEE));
    // then i + (i + 4): [a 0-3 | b 0-3 | c 0-3 | e 0-3]
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, ce, 0x88), _mm512_shuffle_f32x4(ab, ce, 0xDD));
    // then i + (i + 2), then i + (i + 1): lane 0 of each 128-bit quarter
    const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    const __m512 z = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0, 0), z));
  }
  __attribute__((target("avx512f")))
  static void scores(const float* q, int64_t group, const float* keys, const int32_t* own, int64_t n, int64_t d,
                     float scale, float* out, int64_t stride, int32_t first) {
    for (int64_t t = 0; t < n; t += 4) {
      const float* k[4];
      for (int j = 0; j < 4; ++j) k[j] = keys + (own[std::min(t + j, n - 1)] - first) * d;
      for (int64_t r = 0; r < group; ++r) {
        alignas(16) float four[4];
        _mm_store_ps(four, _mm_mul_ps(dot4(q + r * d, k[0], k[1], k[2], k[3], d), _mm_set1_ps(scale)));
        for (int j = 0; j < 4 && t + j < n; ++j) out[r * stride + t + j] = four[j];
      }
    }
  }
  __attribute__((target("avx512f")))
  static float exp_sum(float* s, int64_t n, float top) {
    const __m512 t = _mm512_set1_ps(top);
    float total = 0.f;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), t));
      _mm512_mask_storeu_ps(s + i, live, e);
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, e);
      for (int64_t l = 0; l < 16 && i + l < n; ++l) total += lanes[l];
    }
    return total;
  }
  // H heads over L * 16 lanes from lane c: H * L accumulators in registers, each value loaded once.
  template <int H, int L>
  __attribute__((target("avx512f")))
  static void value_tile(const float* p, int64_t stride, const float* values, const int32_t* own, int64_t n,
                         int64_t d, float* acc, int32_t first, int64_t c) {
    __m512 sum[H][L];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < L; ++j) sum[h][j] = _mm512_loadu_ps(acc + h * d + c + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = values + (own[t] - first) * d + c;
      __m512 x[L];
      for (int j = 0; j < L; ++j) x[j] = _mm512_loadu_ps(v + 16 * j);
      for (int h = 0; h < H; ++h) {
        const __m512 w = _mm512_set1_ps(p[h * stride + t]);
        for (int j = 0; j < L; ++j) sum[h][j] = _mm512_fmadd_ps(w, x[j], sum[h][j]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < L; ++j) _mm512_storeu_ps(acc + h * d + c + 16 * j, sum[h][j]);
  }
  template <int H>
  __attribute__((target("avx512f")))
  static void value_heads(const float* p, int64_t stride, const float* values, const int32_t* own, int64_t n,
                          int64_t d, float* acc, int32_t first) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) value_tile<H, 4>(p, stride, values, own, n, d, acc, first, c);
    for (; c < d; c += 16) value_tile<H, 1>(p, stride, values, own, n, d, acc, first, c);
  }
  __attribute__((target("avx512f")))
  static void values(const float* p, int64_t stride, int64_t group, const float* values, const int32_t* own,
                     int64_t n, int64_t d, float* acc, int32_t first) {
    int64_t r = 0;  // heads in tiles of 3 (12 accumulators, 4 values, a weight: registers to spare)
    for (; r + 3 <= group; r += 3) value_heads<3>(p + r * stride, stride, values, own, n, d, acc + r * d, first);
    for (; r < group; ++r) value_heads<1>(p + r * stride, stride, values, own, n, d, acc + r * d, first);
  }
};

// The AVX2 path (any head size: 8-lane chunks, then scalar columns).
// scores: four keys at a time, each in 16 lanes (two vectors) of FMAs, summed in one fixed tree; values: each lane of acc one column, its FMAs in t order;
// exp_sum: exp_scalar's steps on 8 lanes (bit for bit), the sum in t order. A query's bits depend on its own
// columns only.
struct Avx2 {
  __attribute__((target("avx2,fma")))
  static float sum8(__m256 x) {  // lanes (i, i + 4), then (i, i + 2), then (0, 1)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // Four keys' dot products with q, each in two 8-lane accumulators (columns l mod 16 of the 16-column chunks),
  // an 8-column chunk left over in the first, scalar columns in a tail: the same steps for a key in any slot.
  __attribute__((target("avx2,fma")))
  static void dot4(const float* q, const float* const k[4], int64_t d, float out[4]) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      const __m256 x = _mm256_loadu_ps(q + i), y = _mm256_loadu_ps(q + i + 8);
      for (int j = 0; j < 4; ++j) {
        a[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j] + i), a[j]);
        b[j] = _mm256_fmadd_ps(y, _mm256_loadu_ps(k[j] + i + 8), b[j]);
      }
    }
    if (i + 8 <= d) {
      const __m256 x = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[j] + i), a[j]);
      i += 8;
    }
    for (int j = 0; j < 4; ++j) {
      float tail = 0.f;
      for (int64_t e = i; e < d; ++e) tail = std::fma(q[e], k[j][e], tail);
      out[j] = sum8(_mm256_add_ps(a[j], b[j])) + tail;
    }
  }
  __attribute__((target("avx2,fma")))
  static void scores(const float* q, int64_t group, const float* keys, const int32_t* own, int64_t n, int64_t d,
                     float scale, float* out, int64_t stride, int32_t first) {
    for (int64_t t = 0; t < n; t += 4) {
      const float* k[4];
      for (int j = 0; j < 4; ++j) k[j] = keys + (own[std::min(t + j, n - 1)] - first) * d;
      for (int64_t r = 0; r < group; ++r) {
        float four[4];
        dot4(q + r * d, k, d, four);
        for (int j = 0; j < 4 && t + j < n; ++j) out[r * stride + t + j] = four[j] * scale;
      }
    }
  }
  __attribute__((target("avx2,fma")))
  static __m256 exp8(__m256 x) {  // exp_scalar's steps, 8 lanes
    x = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i shifted = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), shifted));
  }
  __attribute__((target("avx2,fma")))
  static float exp_sum(float* s, int64_t n, float top) {
    float total = 0.f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(top))));
      for (int l = 0; l < 8; ++l) total += s[i + l];
    }
    for (; i < n; ++i) total += (s[i] = exp_scalar(s[i] - top));
    return total;
  }
  // H heads over L * 8 lanes from column c: H * L accumulators in registers, each value loaded once.
  template <int H, int L>
  __attribute__((target("avx2,fma")))
  static void value_tile(const float* p, int64_t stride, const float* values, const int32_t* own, int64_t n,
                         int64_t d, float* acc, int32_t first, int64_t c) {
    __m256 sum[H][L];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < L; ++j) sum[h][j] = _mm256_loadu_ps(acc + h * d + c + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = values + (own[t] - first) * d + c;
      __m256 x[L];
      for (int j = 0; j < L; ++j) x[j] = _mm256_loadu_ps(v + 8 * j);
      for (int h = 0; h < H; ++h) {
        const __m256 w = _mm256_set1_ps(p[h * stride + t]);
        for (int j = 0; j < L; ++j) sum[h][j] = _mm256_fmadd_ps(w, x[j], sum[h][j]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < L; ++j) _mm256_storeu_ps(acc + h * d + c + 8 * j, sum[h][j]);
  }
  template <int H>
  __attribute__((target("avx2,fma")))
  static void value_heads(const float* p, int64_t stride, const float* values, const int32_t* own, int64_t n,
                          int64_t d, float* acc, int32_t first) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) value_tile<H, 4>(p, stride, values, own, n, d, acc, first, c);
    for (; c + 8 <= d; c += 8) value_tile<H, 1>(p, stride, values, own, n, d, acc, first, c);
    for (int h = 0; h < H && c < d; ++h)
      for (int64_t t = 0; t < n; ++t) {
        const float* v = values + (own[t] - first) * d;
        for (int64_t e = c; e < d; ++e) acc[h * d + e] = std::fma(p[h * stride + t], v[e], acc[h * d + e]);
      }
  }
  __attribute__((target("avx2,fma")))
  static void values(const float* p, int64_t stride, int64_t group, const float* values, const int32_t* own,
                     int64_t n, int64_t d, float* acc, int32_t first) {
    int64_t r = 0;  // heads in pairs (8 accumulators, 4 values, a weight: registers to spare)
    for (; r + 2 <= group; r += 2) value_heads<2>(p + r * stride, stride, values, own, n, d, acc + r * d, first);
    for (; r < group; ++r) value_heads<1>(p + r * stride, stride, values, own, n, d, acc + r * d, first);
  }
};

struct Shape {
  int64_t batch, heads, kv_heads, q_len, kv_len, dim;
  int64_t qs[4], ks[4], vs[4];  // strides of query, key, value
};

constexpr int64_t kQueries = 8;  // queries per unit: they share the unit's widened keys and values

constexpr int64_t kColumns = 256;  // columns per pass over the unit's rows: their keys/values stay in L2

// Per-thread scratch of a unit.
struct Scratch {
  std::vector<uint8_t> seen;       // [kv]: a column some query of the unit may see
  std::vector<int32_t> columns;    // the unit's columns (those seen), ascending
  std::vector<int32_t> own;        // per query, its positions in `columns`, ascending (at `start`)
  std::vector<int64_t> start, at;  // per query: where its positions begin; the next one to process
  std::vector<float> block, queries, scores, acc;  // block: one block's widened keys or values
};

// Whether query i of row b may see column j.
inline bool allowed(const bool* mask, const Shape& s, int64_t b, int64_t i, int64_t j) {
  return mask ? mask[(b * s.q_len + i) * s.kv_len + j] : j <= s.kv_len - s.q_len + i;
}

// One unit: batch row b, kv head g, queries [i0, i1), each with the `group` heads sharing kv head g.
// Each (query, head) row takes its own columns in ascending order, in two passes (scores, then
// values) over blocks of kColumns unit columns (those any of its queries may see), every row of the
// unit per block: a block's keys (pass 0) or values (pass 1) are widened once into a buffer that
// stays in L2, so a long context is read once per pass and never written back whole. The blocks
// only interleave different rows' work, each row's arithmetic stays in column order.
template <typename Ops, typename T>
void unit(const T* query, const T* key, const T* value, const bool* mask, T* out, const Shape& s, float scale,
          int64_t b, int64_t g, int64_t i0, int64_t i1, Scratch& x) {
  const int64_t d = s.dim, group = s.heads / s.kv_heads, nq = i1 - i0;
  x.seen.assign(s.kv_len, 0);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < s.kv_len; ++j) x.seen[j] |= allowed(mask, s, b, i, j);
  x.columns.clear();
  for (int64_t j = 0; j < s.kv_len; ++j)
    if (x.seen[j]) x.columns.push_back(static_cast<int32_t>(j));
  const int64_t m = static_cast<int64_t>(x.columns.size());
  x.block.resize(std::min(m, kColumns) * d);
  x.own.clear();
  x.start.assign(nq + 1, 0);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t t = 0; t < m; ++t)
      if (allowed(mask, s, b, i0 + i, x.columns[t])) x.own.push_back(static_cast<int32_t>(t));
    x.start[i + 1] = static_cast<int64_t>(x.own.size());
  }
  x.queries.resize(nq * group * d);
  x.scores.resize(x.own.size() * group);  // row (i, r): group * start[i] + r * n_i
  x.acc.assign(nq * group * d, 0.f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t r = 0; r < group; ++r)
      widen(query + b * s.qs[0] + (g * group + r) * s.qs[1] + (i0 + i) * s.qs[2], x.queries.data() + (i * group + r) * d, d);
  auto row_scores = [&](int64_t i, int64_t r) {
    return x.scores.data() + group * x.start[i] + r * (x.start[i + 1] - x.start[i]);
  };
  for (int pass = 0; pass < 2; ++pass) {  // 0: scores, 1: values
    x.at.assign(x.start.begin(), x.start.end() - 1);
    const T* source = pass == 0 ? key + b * s.ks[0] + g * s.ks[1] : value + b * s.vs[0] + g * s.vs[1];
    const int64_t stride = pass == 0 ? s.ks[2] : s.vs[2];
    for (int64_t c0 = 0; c0 < m; c0 += kColumns) {
      for (int64_t t = c0; t < std::min(m, c0 + kColumns); ++t)
        widen(source + x.columns[t] * stride, x.block.data() + (t - c0) * d, d);
      const int32_t first = static_cast<int32_t>(c0);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t from = x.at[i];
        int64_t to = from;
        while (to < x.start[i + 1] && x.own[to] < c0 + kColumns) ++to;
        x.at[i] = to;
        if (to == from) continue;
        const int32_t* own = x.own.data() + from;
        const int64_t offset = from - x.start[i], stride = x.start[i + 1] - x.start[i];
        if (pass == 0)
          Ops::scores(x.queries.data() + i * group * d, group, x.block.data(), own, to - from, d, scale,
                      row_scores(i, 0) + offset, stride, first);
        else
          Ops::values(row_scores(i, 0) + offset, stride, group, x.block.data(), own, to - from, d,
                      x.acc.data() + i * group * d, first);
      }
    }
    if (pass == 1) break;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t n = x.start[i + 1] - x.start[i];
      for (int64_t r = 0; r < group && n; ++r) {
        float* row = row_scores(i, r);
        const float top = *std::max_element(row, row + n);
        x.queries[(i * group + r) * d] = Ops::exp_sum(row, n, top);  // the query is no longer needed: its sum
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    T* dst = out + ((b * s.q_len + i0 + i) * s.heads + g * group) * d;  // out [B, q, H, D], contiguous
    const bool empty = x.start[i + 1] == x.start[i];  // a query that may see nothing: zeros
    for (int64_t r = 0; r < group; ++r) {
      const float inverse = empty ? 0.f : 1.f / x.queries[(i * group + r) * d];
      const float* acc = x.acc.data() + (i * group + r) * d;
      for (int64_t e = 0; e < d; ++e) dst[r * d + e] = static_cast<T>(acc[e] * inverse);
    }
  }
}

template <typename Ops, typename T>
void run(const T* query, const T* key, const T* value, const bool* mask, T* out, const Shape& s, float scale) {
  const int64_t blocks = (s.q_len + kQueries - 1) / kQueries, units = s.batch * s.kv_heads * blocks;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    Scratch x;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t block = u % blocks, g = (u / blocks) % s.kv_heads, b = u / (blocks * s.kv_heads);
      const int64_t i0 = block * kQueries, i1 = std::min(s.q_len, i0 + kQueries);
      unit<Ops>(query, key, value, mask, out, s, scale, b, g, i0, i1, x);
    }
  });
}

template <typename T>
void dispatch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const bool* mask,
              torch::Tensor& out, const Shape& s, float scale, bool vector) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  if (vector)
    run<Avx512>(qp, kp, vp, mask, op, s, scale);
  else
    run<Avx2>(qp, kp, vp, mask, op, s, scale);
}

}  // namespace

// 2: the AVX-512 path runs for this head size, 1: the AVX2 path, 0: neither can run on this CPU.
int64_t path(int64_t dim) { return has_avx512() && dim % 16 == 0 ? 2 : has_avx2() ? 1 : 0; }

// The attention described above; `vector` false forces the AVX2 path (tests).
torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                        const c10::optional<torch::Tensor>& mask, double scale, bool vector) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "row attention: 4-D query, key and value");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type() &&
                  (query.scalar_type() == torch::kFloat32 || query.scalar_type() == torch::kBFloat16),
              "row attention: query, key and value must all be float32 or all bfloat16");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(3),
              "row attention: key/value [B, Hkv, kv, D] must match query [B, H, q, D]");
  TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0 && query.size(1) / key.size(1) <= 64,
              "row attention: the query heads must be a multiple (at most 64) of the key/value heads");
  const torch::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const torch::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const torch::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  Shape s{query.size(0), query.size(1), key.size(1), query.size(2), key.size(2), query.size(3), {}, {}, {}};
  TORCH_CHECK(s.kv_len >= s.q_len || mask, "row attention: causal without a mask needs kv >= q");
  for (int a = 0; a < 4; ++a) s.qs[a] = q.stride(a), s.ks[a] = k.stride(a), s.vs[a] = v.stride(a);
  torch::Tensor m;
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 3 && mask->size(0) == s.batch &&
                    mask->size(1) == s.q_len && mask->size(2) == s.kv_len,
                "row attention: the mask must be boolean [B, q, kv]");
    m = mask->contiguous();
  }
  auto out = torch::empty({s.batch, s.q_len, s.heads, s.dim}, query.options());
  const bool* mp = mask ? m.data_ptr<bool>() : nullptr;
  TORCH_CHECK(path(s.dim) > 0, "row attention: this CPU has neither AVX-512 nor AVX2 with FMA");
  const bool vector_path = vector && path(s.dim) == 2;
  if (q.scalar_type() == torch::kBFloat16)
    dispatch<at::BFloat16>(q, k, v, mp, out, s, static_cast<float>(scale), vector_path);
  else
    dispatch<float>(q, k, v, mp, out, s, static_cast<float>(scale), vector_path);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attention", &attention, "row attention: [B, H, q, D] x [B, Hkv, kv, D] -> [B, q, H, D]",
             pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("mask"),
             pybind11::arg("scale"), pybind11::arg("vector") = true);
  module.def("path", &path, "2: AVX-512, 1: AVX2, 0: neither runs for this head size here");
}
