// Row attention for CPUs: every query attends over exactly the key columns it may see, in column
// order, with the same float32 steps whatever else the call holds (fly_llm/attention.py).
//
// query [B, H, q, D], key/value [B, Hkv, kv, D] (float32 or bfloat16, any strides with D innermost),
// an optional boolean mask [B, q, kv] (true: may attend; absent: causal, query i sees columns
// 0 .. kv - q + i). Output [B, q, H, D] in the inputs' dtype. For one query and head:
//   s_t = scale * (q . k_t)   over its allowed columns t (ascending), dot products in one fixed order
//   p_t = exp(s_t - max s), Z = sum p_t (ascending), out = (sum p_t v_t) / Z (ascending)
// A query that may see nothing outputs zeros. Threads (at::parallel_for) split (batch row, kv head,
// query) units, each unit does the heads sharing one kv head; a unit's arithmetic depends on its own
// query, its allowed columns and their keys and values only, so a query's output is the same bit for
// bit alone, in a 16-token verify, a 128-token prefill chunk or any batch, at any thread count.

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

template <typename T>
void widen(const T* in, float* out, int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, in, d * sizeof(float));
  } else {
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(in[i]);  // exact
  }
}

// The three inner loops, on AVX-512 (d a multiple of 16) or AVX2: one path per process.
struct Avx512 {
  __attribute__((target("avx512f")))
  static float dot(const float* a, const float* b, int64_t d) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
  __attribute__((target("avx512f")))
  static float exp_sum(float* s, int64_t n, float top) {  // s_t <- exp(s_t - top); returns the sum, ascending
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
  __attribute__((target("avx512f")))
  static void axpy(float* acc, float p, const float* v, int64_t d) {
    const __m512 w = _mm512_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
  }
};

struct Avx2 {  // plain loops the compiler vectorizes for AVX2 (any head size)
  __attribute__((target("avx2,fma")))
  static float dot(const float* a, const float* b, int64_t d) {
    float lanes[16] = {};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
    for (int l = 0; i + l < d; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
    float total = 0.f;
    for (float lane : lanes) total += lane;
    return total;
  }
  __attribute__((target("avx2,fma")))
  static float exp_sum(float* s, int64_t n, float top) {
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += (s[i] = exp_scalar(s[i] - top));
    return total;
  }
  __attribute__((target("avx2,fma")))
  static void axpy(float* acc, float p, const float* v, int64_t d) {
    for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, v[i], acc[i]);
  }
};

struct Shape {
  int64_t batch, heads, kv_heads, q_len, kv_len, dim;
  int64_t qs[4], ks[4], vs[4];  // strides of query, key, value
};

// One unit: batch row b, kv head g, query i, its `group` heads h = g * group + r.
template <typename Ops, typename T>
void unit(const T* query, const T* key, const T* value, const bool* mask, T* out, const Shape& s, float scale,
          int64_t b, int64_t g, int64_t i, std::vector<int32_t>& columns, std::vector<float>& scores,
          std::vector<float>& buffer) {
  const int64_t group = s.heads / s.kv_heads, d = s.dim;
  columns.clear();
  if (mask) {
    const bool* allowed = mask + (b * s.q_len + i) * s.kv_len;
    for (int64_t j = 0; j < s.kv_len; ++j)
      if (allowed[j]) columns.push_back(static_cast<int32_t>(j));
  } else {
    for (int64_t j = 0; j <= s.kv_len - s.q_len + i; ++j) columns.push_back(static_cast<int32_t>(j));
  }
  const int64_t n = static_cast<int64_t>(columns.size());
  T* dst = out + ((b * s.q_len + i) * s.heads + g * group) * d;  // out [B, q, H, D], contiguous
  if (n == 0) {
    for (int64_t e = 0; e < group * d; ++e) dst[e] = static_cast<T>(0.f);
    return;
  }
  scores.resize(group * n);
  buffer.resize((2 * group + 1) * d);
  float* q = buffer.data();              // [group, d]: the heads' queries, widened
  float* acc = q + group * d;            // [group, d]
  float* row = acc + group * d;          // [d]: one key or value, widened
  for (int64_t r = 0; r < group; ++r)
    widen(query + b * s.qs[0] + (g * group + r) * s.qs[1] + i * s.qs[2], q + r * d, d);
  for (int64_t t = 0; t < n; ++t) {
    widen(key + b * s.ks[0] + g * s.ks[1] + columns[t] * s.ks[2], row, d);
    for (int64_t r = 0; r < group; ++r) scores[r * n + t] = Ops::dot(q + r * d, row, d) * scale;
  }
  float total[64];
  for (int64_t r = 0; r < group; ++r) {
    float* sr = scores.data() + r * n;
    float top = sr[0];
    for (int64_t t = 1; t < n; ++t) top = std::max(top, sr[t]);
    total[r] = Ops::exp_sum(sr, n, top);
  }
  std::fill(acc, acc + group * d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    widen(value + b * s.vs[0] + g * s.vs[1] + columns[t] * s.vs[2], row, d);
    for (int64_t r = 0; r < group; ++r) Ops::axpy(acc + r * d, scores[r * n + t], row, d);
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.f / total[r];
    for (int64_t e = 0; e < d; ++e) dst[r * d + e] = static_cast<T>(acc[r * d + e] * inverse);
  }
}

template <typename Ops, typename T>
void run(const T* query, const T* key, const T* value, const bool* mask, T* out, const Shape& s, float scale) {
  const int64_t units = s.batch * s.kv_heads * s.q_len;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> columns;
    std::vector<float> scores, buffer;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = u % s.q_len, g = (u / s.q_len) % s.kv_heads, b = u / (s.q_len * s.kv_heads);
      unit<Ops>(query, key, value, mask, out, s, scale, b, g, i, columns, scores, buffer);
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
