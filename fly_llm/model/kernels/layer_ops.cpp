// The small per-token ops of a decoder layer, one native call each (fly_llm/model/kernels/layer_ops.py).
//
// rms_norm / add_rms_norm: transformers' Llama/Qwen2 RMSNorm (float32 inside, the normed value
// rounded to the input dtype before it is multiplied by the weight), add_rms_norm adding the
// residual first (rounded to the input dtype, as a bf16 `residual + x` is). rotary_: transformers'
// apply_rotary_pos_emb (rotate_half convention) in place on the first heads of each token, every
// product and the sum rounded to the input dtype as torch rounds them. silu_mul: SiLU(gate) * up
// of a fused [.., 2F] gate/up output, each rounded to the input dtype. rotary_store_: rotary_, then the
// key and value heads copied into a KV cache's buffers.
//
// Inputs are float32 or bfloat16 (weight, cos and sin in the same dtype), rows contiguous. The
// arithmetic is float32 with every rounding written out; a row's result depends on that row only
// (sums in one fixed order of 16 lanes), whatever the other rows, their number or the thread
// count (at::parallel_for splits rows only), and whatever vector width a clone below runs at:
// each lane's arithmetic is the same IEEE float32 operation at any width.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

// No fused multiply-adds: every product is rounded as torch rounds it, and each clone below
// computes the same bits (the AVX-512 clone would otherwise contract where the others cannot).
// No trapping math: the clamps and selects of these loops may then run on every lane (the values are
// the same; only floating-point exception flags, which nothing reads, may differ), so the AVX2 clone
// vectorizes them too (with trapping math GCC keeps them scalar there: a branch per element).
#pragma GCC optimize("fp-contract=off", "no-trapping-math")

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLY_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FLY_CLONES
#endif

namespace {

constexpr int64_t kLanes = 16;          // partial sums of a row's squares, added in lane order at the end
constexpr int64_t kGrainValues = 1 << 15;  // values per thread task: a decode step's rows run inline

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// x rounded to bfloat16 (nearest, ties to even, as c10::BFloat16 does) when `bf16`, else x.
inline float round_to(float x, bool bf16) {
  if (!bf16 || x != x) return x;
  const uint32_t b = bits_of(x);
  return float_of((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

// exp(x) in float32 (Cephes' expf: 2^n * p(r), x = n ln 2 + r; within 2 ulp), for x clamped to
// [-87.3, 88.3]; plain arithmetic, so that the compiler vectorizes it.
inline float exp_clamped(float x) {
  x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;  // not std::min/max: those are not inlined under the pragma
  const float shifter = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  return float_of(bits_of(p) + (static_cast<uint32_t>(static_cast<int32_t>(n)) << 23));
}

// ---- row kernels on float32 buffers ------------------------------------------------------------

FLY_CLONES
float sum_of_squares(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * x[i + l];
  for (int64_t l = 0; i + l < n; ++l) lanes[l] += x[i + l] * x[i + l];
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

FLY_CLONES
void scale_by_weight(const float* x, const float* weight, float inverse, int64_t n, bool bf16, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_to(round_to(x[i] * inverse, bf16) * weight[i], bf16);
}

FLY_CLONES
void add_rows(const float* x, const float* residual, int64_t n, bool bf16, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_to(x[i] + residual[i], bf16);
}

FLY_CLONES
void rotate(float* x, const float* cos, const float* sin, int64_t heads, int64_t dim, bool bf16) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* row = x + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = row[i], x2 = row[i + half];
      row[i] = round_to(round_to(x1 * cos[i], bf16) + round_to(-x2 * sin[i], bf16), bf16);
      row[i + half] = round_to(round_to(x2 * cos[i + half], bf16) + round_to(x1 * sin[i + half], bf16), bf16);
    }
  }
}

FLY_CLONES
void silu_times(const float* gate, const float* up, int64_t n, bool bf16, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = round_to(round_to(g / (1.f + exp_clamped(-g)), bf16) * up[i], bf16);
  }
}

// ---- float32 / bfloat16 rows in and out --------------------------------------------------------

void widen(const float* in, float* out, int64_t n) { std::memcpy(out, in, n * sizeof(float)); }
void widen(const at::BFloat16* in, float* out, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(in);
  for (int64_t i = 0; i < n; ++i) out[i] = float_of(static_cast<uint32_t>(raw[i]) << 16);
}

// `in` already rounded to bfloat16 where T is: the conversion only drops the zero low half.
void narrow(const float* in, float* out, int64_t n) { std::memcpy(out, in, n * sizeof(float)); }
void narrow(const float* in, at::BFloat16* out, int64_t n) {
  uint16_t* raw = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) raw[i] = static_cast<uint16_t>(bits_of(in[i]) >> 16);
}

template <typename T>
constexpr bool is_bf16() { return std::is_same<T, at::BFloat16>::value; }

// Rows [begin, end) of `rows` x `n` values, `per_row` (row index, scratch) on each, threads over rows.
template <typename F>
void for_rows(int64_t rows, int64_t n, int64_t scratch, F per_row) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
                     thread_local std::vector<float> buffer;  // grown, never shrunk: no allocation per call
                     if (static_cast<int64_t>(buffer.size()) < scratch) buffer.resize(scratch);
                     for (int64_t r = begin; r < end; ++r) per_row(r, buffer.data());
                   });
}

template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, double eps, int64_t rows, int64_t n, T* sum,
               T* out) {
  std::vector<float> w(n);
  widen(weight, w.data(), n);
  for_rows(rows, n, 2 * n, [&](int64_t r, float* buffer) {
    float* h = buffer;
    float* tmp = buffer + n;
    widen(x + r * n, h, n);
    if (residual) {
      widen(residual + r * n, tmp, n);
      add_rows(h, tmp, n, is_bf16<T>(), h);
      narrow(h, sum + r * n, n);
    }
    const float variance = sum_of_squares(h, n) / static_cast<float>(n);
    const float inverse = 1.f / std::sqrt(variance + static_cast<float>(eps));
    scale_by_weight(h, w.data(), inverse, n, is_bf16<T>(), tmp);
    narrow(tmp, out + r * n, n);
  });
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              op, ": the weight must be a contiguous [hidden] vector of x's dtype");
}

template <typename T>
void norm_typed(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                double eps, torch::Tensor& sum, torch::Tensor& out) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(), eps, rows, n,
               residual ? sum.data_ptr<T>() : nullptr, out.data_ptr<T>());
}

// (x + residual or an undefined tensor without a residual, RMSNorm of the sum or of x).
std::tuple<torch::Tensor, torch::Tensor> norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                              const torch::Tensor& weight, double eps) {
  auto out = torch::empty_like(x);
  auto sum = residual ? torch::empty_like(x) : torch::Tensor();
  if (x.scalar_type() == torch::kBFloat16)
    norm_typed<at::BFloat16>(x, residual, weight, eps, sum, out);
  else
    norm_typed<float>(x, residual, weight, eps, sum, out);
  return {sum, out};
}

template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t batch, int64_t tokens, int64_t width, int64_t heads,
                 int64_t dim, const int64_t* cs) {  // cs: strides of cos/sin [B, S, D]
  for_rows(batch * tokens, heads * dim, heads * dim + 2 * dim, [&](int64_t r, float* buffer) {
    const int64_t b = r / tokens, s = r % tokens;
    float* row = buffer;
    float* c = buffer + heads * dim;
    float* si = c + dim;
    T* dst = x + r * width;
    widen(dst, row, heads * dim);
    widen(cos + b * cs[0] + s * cs[1], c, dim);
    widen(sin + b * cs[0] + s * cs[1], si, dim);
    rotate(row, c, si, heads, dim, is_bf16<T>());
    narrow(row, dst, heads * dim);
  });
}

template <typename T>
void silu_rows(const T* gate_up, int64_t rows, int64_t f, T* out) {
  for_rows(rows, 2 * f, 3 * f, [&](int64_t r, float* buffer) {
    widen(gate_up + r * 2 * f, buffer, 2 * f);
    silu_times(buffer, buffer + f, f, is_bf16<T>(), buffer + 2 * f);
    narrow(buffer + 2 * f, out + r * f, f);
  });
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  return std::get<1>(norm(x, c10::nullopt, weight, eps));
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: the residual must be contiguous, of x's shape and dtype");
  return norm(x, residual, weight, eps);
}

torch::Tensor rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                      int64_t dim) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.stride(0) == x.size(1) * x.size(2),
              "rotary_: x must be a contiguous [B, S, width]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "rotary_: x must be float32 or bfloat16");
  TORCH_CHECK(dim > 0 && dim % 2 == 0 && heads >= 0 && heads * dim <= x.size(2), "rotary_: ", heads, " heads of ",
              dim, " do not fit a row of ", x.size(2));
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && cos.dim() == 3 &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(1) && cos.size(2) == dim && cos.stride(2) == 1 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin must be [B, S, dim] of x's dtype, dim innermost");
  const int64_t cs[2] = {cos.stride(0), cos.stride(1)};
  if (x.scalar_type() == torch::kBFloat16) {
    using B = at::BFloat16;
    rotary_rows<B>(x.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), x.size(0), x.size(1), x.size(2), heads,
                   dim, cs);
  } else {
    rotary_rows<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1),
                       x.size(2), heads, dim, cs);
  }
  return x;
}

// rotary_ on the query and key heads of a fused q/k/v output x [B, S, (heads + 2 kv_heads) * dim], then its
// key and value heads copied into a cache's buffers keys/values [B, kv_heads, capacity, dim] at columns
// start .. start + S - 1: a layer's rotary and cache write in one call (copies: the bits of the rotated x).
torch::Tensor rotary_store_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                            int64_t kv_heads, int64_t dim, torch::Tensor& keys, torch::Tensor& values, int64_t start) {
  TORCH_CHECK(x.dim() == 3 && heads >= 0 && kv_heads > 0 && x.size(2) == (heads + 2 * kv_heads) * dim,
              "rotary_store_: x must be [B, S, (heads + 2 kv_heads) * dim]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == x.size(0) &&
                  keys.size(1) == kv_heads && keys.size(3) == dim && keys.is_contiguous() && values.is_contiguous() &&
                  keys.scalar_type() == x.scalar_type() && values.scalar_type() == x.scalar_type(),
              "rotary_store_: keys and values must be contiguous [B, kv_heads, capacity, dim] of x's dtype");
  TORCH_CHECK(start >= 0 && start + x.size(1) <= keys.size(2), "rotary_store_: columns ", start, " .. ",
              start + x.size(1), " do not fit a capacity of ", keys.size(2));
  rotary_(x, cos, sin, heads + kv_heads, dim);
  const int64_t tokens = x.size(1), width = x.size(2), capacity = keys.size(2), size = x.element_size();
  const auto* source = static_cast<const char*>(x.data_ptr());
  auto* key = static_cast<char*>(keys.data_ptr());
  auto* value = static_cast<char*>(values.data_ptr());
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t s = 0; s < tokens; ++s)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const char* row = source + ((b * tokens + s) * width + (heads + h) * dim) * size;
        const int64_t column = ((b * kv_heads + h) * capacity + start + s) * dim * size;
        std::memcpy(key + column, row, dim * size);
        std::memcpy(value + column, row + kv_heads * dim * size, dim * size);
      }
  return x;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be contiguous with an even last dimension");
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16,
              "silu_mul: gate_up must be float32 or bfloat16");
  auto sizes = gate_up.sizes().vec();
  const int64_t f = sizes.back() / 2, rows = f ? gate_up.numel() / (2 * f) : 0;
  sizes.back() = f;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16)
    silu_rows<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), rows, f, out.data_ptr<at::BFloat16>());
  else
    silu_rows<float>(gate_up.data_ptr<float>(), rows, f, out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("rms_norm", &rms_norm, "RMSNorm of each row of x (transformers' arithmetic)");
  module.def("add_rms_norm", &add_rms_norm, "(x + residual, RMSNorm of it)");
  module.def("rotary_", &rotary_, "rotary embedding in place on the first `heads` heads of each [B, S] row");
  module.def("rotary_store_", &rotary_store_, "rotary_ on q and k of a fused q/k/v output, then k and v into a cache");
  module.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused [.., 2F] gate/up");
}
