// W4A8 linear for x86 CPUs: 4-bit weights, int8 activations, integer dot products.
//
// Input float32 or bfloat16, output in the same dtype. Weights (packed by fly_llm/kernels/w4a8.py):
// output columns in groups of 16, input features in blocks of 32. Weight w = d * q - m per (column,
// block), q in 0..15, d and m float16.
//   q: uint8 [groups, blocks, 4, 64]: chunk c holds k = 8c..8c+7 of the block; byte 4*col + j has
//      k = 8c + j in its low nibble and k = 8c + 4 + j in its high nibble (col 0..15, j 0..3).
//   d, m: float16 [groups, blocks, 16].
// Optionally the same d and m in two levels too (GGUF Q4_K's): top_d, top_m float16 [groups, blocks / 8,
// 16] per super-block of 8 blocks and sc, mn uint8 [groups, blocks, 16] per block, d being
// float16(top_d * sc) and m float16(top_m * mn) (the float32 product rounded to nearest even, as
// torch's .half()). On AVX-512 VNNI over up to 4 rows (memory-bound) the kernel streams these (296
// bytes a block and group instead of 320) and rebuilds d and m; over more rows, and on the AVX2 path
// (compute-bound: the rebuild cost more than the bytes saved, measured), it reads d and m. Same values
// either way: the same output bit for bit.
// Activations are quantized per row per block of 32 (as llama.cpp's Q8 blocks): s = max|x| / 127,
// a = round(x / s) in -127..127. For a row and a block the integer sum of q * a is exact, then
//   acc += (d * s) * sum(q * a) - m * (s * sum(a))
// in float, block after block. Every row takes exactly these steps in this order whatever the
// other rows, M or the thread count are (threads split output columns only), so a row's output
// is the same bit for bit in any batch, and the AVX-512 VNNI and AVX2 paths agree bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int kBlock = 32;      // input features per block
constexpr int kCols = 16;       // output columns per group
constexpr int kGroupBytes = 256;  // packed nibbles of one group and block
constexpr int kPanel = 32;      // rows whose accumulators are kept together
constexpr int kChunk = 32;      // blocks per pass over a panel (its weights stay in L1)

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512Vnni = 2 };

struct Activations {
  const int8_t* q;   // [M, K]
  const float* s;    // [M, blocks]: the block's scale
  const float* ms;   // [M, blocks]: scale * sum of the block's quantized values
  int64_t k, blocks;
};

struct Weights {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  const uint16_t* top_d;  // two levels (null where the weight has none)
  const uint16_t* top_m;
  const uint8_t* sc;
  const uint8_t* mn;
  int64_t blocks;
};

constexpr int kSuper = 8;  // blocks per super-block of the two-level layout
constexpr int kTwoLevelRows = 4;  // the most rows for which the kernel streams two-level scales
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// float16(top * sub) for 16 columns: the float32 product (exact: 11 x 8 bits) rounded to float16.
__attribute__((target("avx512f,f16c")))
__m512 rebuild16(const uint16_t* top, const uint8_t* sub) {
  const __m512 t = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top)));
  const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))));
  return _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(t, u), kNearest));
}

// Block b of a group: its d and m for all 16 columns.
template <bool kTwoLevel>
__attribute__((target("avx512f,f16c")))
void scales16(const Weights& w, int64_t group, int64_t b, __m512& d, __m512& m) {
  const int64_t at = (group * w.blocks + b) * kCols;
  if constexpr (kTwoLevel) {
    const int64_t top = (group * (w.blocks / kSuper) + b / kSuper) * kCols;
    d = rebuild16(w.top_d + top, w.sc + at);
    m = rebuild16(w.top_m + top, w.mn + at);
  } else {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + at)));
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + at)));
  }
}

int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [row0, row0 + R) of one group over blocks [b0, b1): acc[r * 16 + col] updated in place.
template <int R, bool kTwoLevel>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma")))
void tile_vnni(const Weights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0, int64_t b1,
               float* acc) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_loadu_ps(acc + r * kCols);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.q + at * kGroupBytes;
    __m512 d, m;
    scales16<kTwoLevel>(w, group, b, d, m);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(q + c * 64);
      const __m512i lo = _mm512_and_si512(raw, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(load4(x)));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(load4(x + 4)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * a.blocks + b;
      sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(a.s[i])), sum[r]);
      sum[r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(a.ms[i]), sum[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kCols, sum[r]);
}

// The same steps on 256-bit registers: each group as two halves of 8 columns; u8 x s8 pairs summed
// to int16 (vpmaddubsw: at most 2 * 15 * 127 each, 8 of them per block fit int16), then to int32.
template <int R>
__attribute__((target("avx2,f16c,fma")))
void tile_avx2(const Weights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0, int64_t b1,
               float* acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.q + at * kGroupBytes;
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(raw, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(x))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(x + 4))));
          dot[r][h] = _mm256_add_epi16(dot[r][h], pairs);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + at * kCols + h * 8)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + at * kCols + h * 8)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row0 + r) * a.blocks + b;
        float* out = acc + r * kCols + h * 8;
        __m256 sum = _mm256_loadu_ps(out);
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r][h], ones));
        sum = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(a.s[i])), sum);
        sum = _mm256_fnmadd_ps(m, _mm256_set1_ps(a.ms[i]), sum);
        _mm256_storeu_ps(out, sum);
      }
    }
  }
}

using Tile = void (*)(const Weights&, const Activations&, int64_t, int64_t, int64_t, int64_t, float*);
constexpr int kVnniRows = 8;  // 8 int32 + 8 float accumulators + weights fit 32 zmm registers
constexpr int kAvx2Rows = 4;  // 8 int16 accumulators + weights fit 16 ymm registers
const Tile kVnniTiles[] = {tile_vnni<1, false>, tile_vnni<2, false>, tile_vnni<3, false>, tile_vnni<4, false>,
                           tile_vnni<5, false>, tile_vnni<6, false>, tile_vnni<7, false>, tile_vnni<8, false>};
const Tile kVnniTwoLevelTiles[] = {tile_vnni<1, true>, tile_vnni<2, true>, tile_vnni<3, true>, tile_vnni<4, true>};
static_assert(sizeof(kVnniTwoLevelTiles) / sizeof(Tile) == kTwoLevelRows, "a two-level tile for each row count");
const Tile kAvx2Tiles[] = {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>};

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kAuto;  // neither path can run
}

// One block of 32: int8 values round(x / s) (ties to even, as torch.round), s = max|x| / 127, and
// returns sum of the values. Divides (not multiplies by 1/s), so it equals the reference's rounding.
__attribute__((target("avx2,fma")))
int32_t quantize_block(const float* x, int8_t* q, float* scale) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], peak = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_and_ps(v[i], magnitude));
  }
  __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
  p4 = _mm_max_ss(p4, _mm_movehdup_ps(p4));
  const float s = _mm_cvtss_f32(p4) / 127.f;
  *scale = s;
  if (!(s > 0.f)) {
    std::memset(q, 0, kBlock);
    return 0;
  }
  const __m256 sv = _mm256_set1_ps(s);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));  // MXCSR: nearest, ties even
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

// 32 bfloat16 values as float32 (exact: a bfloat16 is the upper half of a float32).
__attribute__((target("avx2")))
void widen_block(const at::BFloat16* x, float* out) {
  for (int i = 0; i < kBlock; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
}

// Per row and block of 32: int8 values, the scale, and scale * their sum (threads split rows).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* s, float* ms) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float wide[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = r * blocks + b;
        const T* in = x + r * k + b * kBlock;
        const float* block = nullptr;
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          widen_block(in, wide);
          block = wide;
        } else {
          block = in;
        }
        const int32_t total = quantize_block(block, q + r * k + b * kBlock, s + i);
        ms[i] = s[i] * static_cast<float>(total);
      }
    }
  });
}

// Quantize the rows of x, then out = x W^T (+ bias) in the panels and groups described above.
template <typename T>
void run(const T* x, T* out, const Weights& w, int64_t rows, int64_t n, const float* bias, int64_t isa) {
  const int64_t k = w.blocks * kBlock, groups = (n + kCols - 1) / kCols;
  auto q = torch::empty({rows, k}, torch::kInt8);
  auto s = torch::empty({rows, w.blocks}, torch::kFloat32);
  auto ms = torch::empty({rows, w.blocks}, torch::kFloat32);
  quantize_rows(x, rows, k, q.data_ptr<int8_t>(), s.data_ptr<float>(), ms.data_ptr<float>());
  const Activations act{q.data_ptr<int8_t>(), s.data_ptr<float>(), ms.data_ptr<float>(), k, w.blocks};
  const bool vnni = isa == kAvx512Vnni;
  const int tile_rows = vnni ? kVnniRows : kAvx2Rows;

  for (int64_t panel = 0; panel < rows; panel += kPanel) {  // prefill: a panel's activations stay in cache
    const int64_t panel_rows = std::min<int64_t>(kPanel, rows - panel);
    const bool two_level = vnni && w.sc != nullptr && panel_rows <= kTwoLevelRows;  // see the top of this file
    const Tile* tiles = two_level ? kVnniTwoLevelTiles : vnni ? kVnniTiles : kAvx2Tiles;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      alignas(64) float acc[kPanel * kCols];
      for (int64_t g = g0; g < g1; ++g) {
        std::fill(acc, acc + panel_rows * kCols, 0.f);
        for (int64_t b0 = 0; b0 < w.blocks; b0 += kChunk) {  // each weight chunk is read once for the panel
          const int64_t b1 = std::min(w.blocks, b0 + kChunk);
          for (int64_t r = 0; r < panel_rows; r += tile_rows) {
            const int64_t count = std::min<int64_t>(tile_rows, panel_rows - r);
            tiles[count - 1](w, act, g, panel + r, b0, b1, acc + r * kCols);
          }
        }
        const int64_t col0 = g * kCols, cols = std::min<int64_t>(kCols, n - col0);
        for (int64_t r = 0; r < panel_rows; ++r) {
          T* dst = out + (panel + r) * n + col0;  // float → bfloat16 rounds to nearest even, as torch's .to()
          for (int64_t c = 0; c < cols; ++c)
            dst[c] = static_cast<T>(acc[r * kCols + c] + (bias ? bias[col0 + c] : 0.f));
        }
      }
    });
  }
}

}  // namespace

int64_t cpu_isa() { return best_isa(); }

// y = x W^T (+ bias) for x [M, K] float32 or bfloat16 (y in the same dtype; the bias float32), W packed
// as above with n output columns (top_d, top_m, sc, mn: its scales in two levels too, or none of them);
// isa 0 = the best this CPU has.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wd,
                     const torch::Tensor& wm, const c10::optional<torch::Tensor>& top_d,
                     const c10::optional<torch::Tensor>& top_m, const c10::optional<torch::Tensor>& sc,
                     const c10::optional<torch::Tensor>& mn, const c10::optional<torch::Tensor>& bias, int64_t n,
                     int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "w4a8: x must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(wq.scalar_type() == torch::kUInt8 && wq.dim() == 4 && wq.size(2) * wq.size(3) == kGroupBytes,
              "w4a8: packed weights must be uint8 [groups, blocks, 4, 64]");
  TORCH_CHECK(wd.scalar_type() == torch::kFloat16 && wm.scalar_type() == torch::kFloat16,
              "w4a8: scales and minimums must be float16");
  const int64_t rows = x.size(0), k = x.size(1), groups = wq.size(0), blocks = wq.size(1);
  TORCH_CHECK(k % kBlock == 0, "w4a8: the input width ", k, " is not a multiple of ", kBlock);
  TORCH_CHECK(blocks * kBlock == k, "w4a8: input width ", k, " does not match the weights' ", blocks * kBlock);
  TORCH_CHECK(n > (groups - 1) * kCols && n <= groups * kCols, "w4a8: ", n, " outputs do not fit ", groups, " groups");
  TORCH_CHECK(wd.numel() == groups * blocks * kCols && wm.numel() == wd.numel(), "w4a8: scale shapes");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n),
              "w4a8: bias must be a contiguous float32 [n]");
  const bool two_level = sc.has_value();
  TORCH_CHECK(top_d.has_value() == two_level && top_m.has_value() == two_level && mn.has_value() == two_level,
              "w4a8: two-level scales need all of top_d, top_m, sc and mn");
  if (two_level) {
    TORCH_CHECK(blocks % kSuper == 0, "w4a8: two-level scales need whole super-blocks of ", kSuper, " blocks");
    for (const auto* t : {&*top_d, &*top_m})
      TORCH_CHECK(t->scalar_type() == torch::kFloat16 && t->is_contiguous() &&
                  t->numel() == groups * (blocks / kSuper) * kCols, "w4a8: top_d and top_m must be contiguous "
                  "float16 [groups, blocks / 8, 16]");
    for (const auto* t : {&*sc, &*mn})
      TORCH_CHECK(t->scalar_type() == torch::kUInt8 && t->is_contiguous() && t->numel() == groups * blocks * kCols,
                  "w4a8: sc and mn must be contiguous uint8 [groups, blocks, 16]");
  }
  const int64_t available = best_isa();
  if (isa == kAuto) isa = available;
  TORCH_CHECK(isa != kAuto, "w4a8: this CPU has neither AVX-512 VNNI nor AVX2 with FMA");
  TORCH_CHECK(isa <= available, "w4a8: the requested instruction set is not available on this CPU");

  const torch::Tensor xc = x.contiguous(), qc = wq.contiguous(), dc = wd.contiguous(), mc = wm.contiguous();
  const auto half = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  const Weights w{qc.data_ptr<uint8_t>(), half(dc), half(mc), two_level ? half(*top_d) : nullptr,
                  two_level ? half(*top_m) : nullptr, two_level ? sc->data_ptr<uint8_t>() : nullptr,
                  two_level ? mn->data_ptr<uint8_t>() : nullptr, blocks};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  auto y = torch::empty({rows, n}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    run(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), w, rows, n, b, isa);
  else
    run(xc.data_ptr<float>(), y.data_ptr<float>(), w, rows, n, b, isa);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &linear, "W4A8 linear: y = x W^T (+ bias)", pybind11::arg("x"), pybind11::arg("q"),
             pybind11::arg("d"), pybind11::arg("m"), pybind11::arg("top_d"), pybind11::arg("top_m"),
             pybind11::arg("sc"), pybind11::arg("mn"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("isa"));
  module.def("cpu_isa", &cpu_isa, "2: AVX-512 VNNI, 1: AVX2, 0: neither");
}
