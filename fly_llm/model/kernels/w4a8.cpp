// W4A8 linear for x86 CPUs: 4-bit weights, int8 activations, integer dot products.
//
// Input float32 or bfloat16, output in the same dtype. Weights (packed by fly_llm/kernels/w4a8.py):
// output columns in groups of 16, input features in blocks of 32. Weight w = d * q - m per (column,
// block), q in 0..15, or 0..31 with a fifth bit (GGUF's Q5_K and Q5_1: HB = 1 bit plane).
//   q: uint8 [groups, blocks, 4, 64]: chunk c holds k = 8c..8c+7 of the block; byte 4*col + j has
//      k = 8c + j in its low nibble and k = 8c + 4 + j in its high nibble (col 0..15, j 0..3).
//   planes (HB = 1 only): uint64 [groups, blocks, 4, 1, 2]: the fifth bits of chunk c's low (0) and high
//      (1) nibble positions: bit i of the mask is byte i of that chunk's 64 bytes (as the symmetric
//      blocks' planes below).
// d and m come in one of three forms (`Scales`):
//   kHalf: float16 d, m [groups, blocks, 16] (weights rounded to 4 bits here; GGUF's Q4_1 and Q5_1);
//   kFloat: float32 d, m [groups, blocks, 16];
//   kTwoLevel: GGUF Q4_K's and Q5_K's two levels, top_d, top_m float16 [groups, blocks / 8, 16] per super-block of 8
//      blocks and sc, mn uint8 [groups, blocks, 16] per block: d = float(top_d) * sc and m = float(top_m) * mn,
//      the float32 products (exact: 11 x 8 bits), as ggml's dequantization computes them. Both paths and
//      every row count rebuild them (296 bytes a block and group, not 320 or 384; 64 more with the fifth bits).
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
constexpr int kAhead = 8;       // blocks of a group ahead whose weights are prefetched (benchmarks/results/kernel)

enum Isa : int64_t { kAuto = 0, kAvx2 = 1, kAvx512Vnni = 2 };

struct Activations {
  const int8_t* q;   // [M, K]
  const float* s;    // [M, blocks]: the block's scale
  const float* ms;   // [M, blocks]: scale * sum of the block's quantized values
  const int32_t* hs; // [M, blocks, 2]: sums of the block's first and last 16 quantized values
  int64_t k, blocks;
};

struct Weights {
  const uint8_t* q;
  const uint64_t* planes;  // the fifth bits (HB = 1); null without them
  const void* d;  // kHalf: uint16_t (float16), kFloat: float; null for kTwoLevel
  const void* m;
  const uint16_t* top_d;  // kTwoLevel only
  const uint16_t* top_m;
  const uint8_t* sc;
  const uint8_t* mn;
  int64_t blocks;
};

constexpr int kSuper = 8;  // blocks per super-block of the two-level layout

enum Scales : int { kHalf = 0, kFloat = 1, kTwoLevel = 2 };  // the forms of d and m (top of this file)

// float(top) * sub for 16 columns: the float32 product (exact: 11 x 8 bits).
__attribute__((target("avx512f,f16c")))
__m512 rebuild16(const uint16_t* top, const uint8_t* sub) {
  const __m512 t = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top)));
  const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))));
  return _mm512_mul_ps(t, u);
}

// The same for 8 columns.
__attribute__((target("avx2,f16c")))
__m256 rebuild8(const uint16_t* top, const uint8_t* sub) {
  const __m256 t = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(top)));
  const __m256 u = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub))));
  return _mm256_mul_ps(t, u);
}

// Block b of a group: its d and m for all 16 columns.
template <Scales S>
__attribute__((target("avx512f,f16c")))
void scales16(const Weights& w, int64_t group, int64_t b, __m512& d, __m512& m) {
  const int64_t at = (group * w.blocks + b) * kCols;
  if constexpr (S == kTwoLevel) {
    const int64_t top = (group * (w.blocks / kSuper) + b / kSuper) * kCols;
    d = rebuild16(w.top_d + top, w.sc + at);
    m = rebuild16(w.top_m + top, w.mn + at);
  } else if constexpr (S == kFloat) {
    d = _mm512_loadu_ps(static_cast<const float*>(w.d) + at);
    m = _mm512_loadu_ps(static_cast<const float*>(w.m) + at);
  } else {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.d) + at)));
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.m) + at)));
  }
}

// Columns [h * 8, h * 8 + 8) of block b of a group: their d and m.
template <Scales S>
__attribute__((target("avx2,f16c")))
void scales8(const Weights& w, int64_t group, int64_t b, int h, __m256& d, __m256& m) {
  const int64_t at = (group * w.blocks + b) * kCols + h * 8;
  if constexpr (S == kTwoLevel) {
    const int64_t top = (group * (w.blocks / kSuper) + b / kSuper) * kCols + h * 8;
    d = rebuild8(w.top_d + top, w.sc + at);
    m = rebuild8(w.top_m + top, w.mn + at);
  } else if constexpr (S == kFloat) {
    d = _mm256_loadu_ps(static_cast<const float*>(w.d) + at);
    m = _mm256_loadu_ps(static_cast<const float*>(w.m) + at);
  } else {
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w.d) + at)));
    m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w.m) + at)));
  }
}

// Asks for the `lines` cache lines at p + kAhead * `stride` bytes: block b + kAhead of the same stream,
// which a one-row step otherwise waits for (a hint: an address past the weights is harmless).
inline void prefetch_ahead(const void* p, int64_t stride, int lines) {
  const char* at = static_cast<const char*>(p) + kAhead * stride;
  for (int l = 0; l < lines; ++l) _mm_prefetch(at + 64 * l, _MM_HINT_T0);
}

int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

uint64_t load8(const uint64_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Chunk c's HB high bit planes (`bits`: a block's planes) added above the nibbles lo and hi: bit p of the
// high part is 16 << p (the bits are not set below it, so adding sets them).
template <int HB>
__attribute__((target("avx512f,avx512bw")))
void add_high16(const uint64_t* bits, int c, __m512i& lo, __m512i& hi) {
  for (int p = 0; p < HB; ++p) {
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(load8(bits + (c * HB + p) * 2)), lo, bit);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(load8(bits + (c * HB + p) * 2 + 1)), hi, bit);
  }
}

// 32 bits of a plane as 32 bytes, 0xFF where the bit is set (bit i -> byte i).
__attribute__((target("avx2")))
__m256i expand_bits(uint32_t mask) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(mask)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
}

// The high parts (0..15 from HB planes) of chunk c's bytes [32 * ch, 32 * ch + 32) at the low (lo) and
// high (hi) nibble positions.
template <int HB>
__attribute__((target("avx2")))
void high_parts8(const uint64_t* bits, int c, int ch, __m256i& lo, __m256i& hi) {
  lo = hi = _mm256_setzero_si256();
  for (int p = 0; p < HB; ++p) {
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << p));
    const uint32_t mlo = static_cast<uint32_t>(load8(bits + (c * HB + p) * 2) >> (32 * ch));
    const uint32_t mhi = static_cast<uint32_t>(load8(bits + (c * HB + p) * 2 + 1) >> (32 * ch));
    lo = _mm256_or_si256(lo, _mm256_and_si256(expand_bits(mlo), bit));
    hi = _mm256_or_si256(hi, _mm256_and_si256(expand_bits(mhi), bit));
  }
}

// Chunk c's bytes [32 ch, 32 ch + 32) of a block (`q`: its 256 bytes) as levels at the low (lo) and high (hi)
// nibble positions, the HB high bit planes (`bits`: the block's planes; HB <= 2) joined above the nibbles:
// nibble + 16 * high (high parts below 4: no carry across bytes).
template <int HB>
__attribute__((target("avx2"), always_inline)) inline
void levels8(const uint8_t* q, const uint64_t* bits, int c, int ch, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + ch * 32));
  lo = _mm256_and_si256(raw, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  if constexpr (HB > 0) {
    __m256i high_lo, high_hi;
    high_parts8<HB>(bits, c, ch, high_lo, high_hi);
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(high_lo, 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(high_hi, 4));
  }
}

// Rows [row0, row0 + R) of one group over blocks [b0, b1): acc[r * 16 + col] updated in place; HB = 1:
// with the fifth bits (levels up to 31: vpdpbusd's u8 x s8 products do not saturate).
template <int R, Scales S, int HB>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma")))
void tile_vnni(const Weights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0, int64_t b1,
               float* acc) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_loadu_ps(acc + r * kCols);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.q + at * kGroupBytes;
    const uint64_t* bits = w.planes + at * 4 * HB * 2;
    prefetch_ahead(q, kGroupBytes, kGroupBytes / 64);
    if constexpr (HB > 0) prefetch_ahead(bits, 64 * HB, HB);
    __m512 d, m;
    scales16<S>(w, group, b, d, m);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(q + c * 64);
      __m512i lo = _mm512_and_si512(raw, nibble);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      add_high16<HB>(bits, c, lo, hi);
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
// to int16 (vpmaddubsw: at most 2 * 15 * 127 each, 8 of them per block fit int16), then to int32. With
// the fifth bits (HB = 1, levels up to 31) a chunk's four products per lane still fit int16 and are
// widened to int32 chunk by chunk: the same integer sums.
template <int R, Scales S, int HB>
__attribute__((target("avx2,f16c,fma")))
void tile_avx2(const Weights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0, int64_t b1,
               float* acc) {
  static_assert(HB == 0 || HB == 1, "levels of at most 5 bits keep vpmaddubsw's pairs within int16");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.q + at * kGroupBytes;
    const uint64_t* bits = w.planes + at * 4 * HB * 2;
    prefetch_ahead(q, kGroupBytes, kGroupBytes / 64);
    if constexpr (HB > 0) prefetch_ahead(bits, 64 * HB, HB);
    __m256i dot[R][2];  // int16 lanes; int32 with the fifth bits
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        levels8<HB>(q, bits, c, h, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(x))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(x + 4))));
          if constexpr (HB > 0) dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
          else dot[r][h] = _mm256_add_epi16(dot[r][h], pairs);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      scales8<S>(w, group, b, h, d, m);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row0 + r) * a.blocks + b;
        float* out = acc + r * kCols + h * 8;
        __m256 sum = _mm256_loadu_ps(out);
        __m256i dot32 = dot[r][h];
        if constexpr (HB == 0) dot32 = _mm256_madd_epi16(dot32, ones);
        const __m256 dots = _mm256_cvtepi32_ps(dot32);
        sum = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(a.s[i])), sum);
        sum = _mm256_fnmadd_ps(m, _mm256_set1_ps(a.ms[i]), sum);
        _mm256_storeu_ps(out, sum);
      }
    }
  }
}

template <typename W>
using TileOf = void (*)(const W&, const Activations&, int64_t, int64_t, int64_t, int64_t, float*);
using Tile = TileOf<Weights>;
constexpr int kVnniRows = 8;  // 8 int32 + 8 float accumulators + weights fit 32 zmm registers
constexpr int kAvx2Rows = 4;  // 8 accumulators (int16; int32 with the fifth bits) + weights fit 16 ymm registers
template <Scales S, int HB>
struct Tiles {
  static constexpr Tile vnni[] = {tile_vnni<1, S, HB>, tile_vnni<2, S, HB>, tile_vnni<3, S, HB>,
                                  tile_vnni<4, S, HB>, tile_vnni<5, S, HB>, tile_vnni<6, S, HB>,
                                  tile_vnni<7, S, HB>, tile_vnni<8, S, HB>};
  static constexpr Tile avx2[] = {tile_avx2<1, S, HB>, tile_avx2<2, S, HB>, tile_avx2<3, S, HB>, tile_avx2<4, S, HB>};
};

// ---- Symmetric blocks: GGUF's Q8_0, Q5_0, Q4_0 and Q6_K as published ----
//
// A weight is w = d * sc * (q - zero): q an unsigned level of 4 + HB bits (0 <= HB <= 4), zero a
// fixed offset (Q8_0: 128 (its int8 levels + 128), Q6_K: 32, Q5_0: 16, Q4_0: 8), sc an int8 per 16
// inputs (Q6_K; none: 1) and d a float16 per `span` blocks of 32 (Q6_K: 8, the others: 1).
//   lo: uint8 [groups, blocks, 4, 64]: q's low nibbles, laid out as the 4-bit weights above.
//   planes: uint64 [groups, blocks, 4, HB, 2]: bit p of q's high part, for chunk c and the low (0) and
//      high (1) nibble positions: bit i of the mask is byte i of that chunk's 64 bytes.
//   Or the levels as whole bytes (always for 8 bits, Q8_0; for 6 bits where there is no VNNI: w4a8.py's
//   `whole_bytes`): lo uint8 [groups, blocks, 4, 128], chunk c's 64 bytes of the low nibble positions then
//   its 64 of the high ones (each in the nibbles' order), and no planes; q - zero must be an int8. An AVX2
//   core then reads a level with one load instead of rebuilding it from HB bit planes.
//   sc: int8 [groups, blocks, 2, 16]; d: float16 [groups, blocks / span, 16].
// For a row and a block the integer isum = sum over halves h of sc_h * (sum_h(q * a) - zero * sum_h(a))
// is exact (at most 2^23 in magnitude), then acc += float(isum) * (d * s), block after block: the same
// float steps on both paths and in any batch, so both paths agree bit for bit.
constexpr int kWhole = 8;  // the HB a tile is instantiated with for levels kept as whole bytes (any bits)

// Bytes of one group and block's levels: nibbles (and planes apart), or whole bytes.
template <int HB>
constexpr int64_t kLevelBytes = HB == kWhole ? 2 * kGroupBytes : kGroupBytes;

struct SymWeights {
  const uint8_t* lo;
  const uint64_t* planes;
  const int8_t* sc;  // null: 1
  const uint16_t* d;
  int64_t blocks, zero;
  int span_shift;  // log2(span): block b's d is at b >> span_shift (no division in the loop)
};

// The float16 d of block b of a group, its 16 columns.
const uint16_t* block_d(const SymWeights& w, int64_t group, int64_t b) {
  return w.d + (group * (w.blocks >> w.span_shift) + (b >> w.span_shift)) * kCols;
}

// Block b's sub-scales for 16 columns (halves 0 and 1) as int32.
__attribute__((target("avx512f")))
void sub_scales16(const SymWeights& w, int64_t at, __m512i& sc0, __m512i& sc1) {
  sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + at * 2 * kCols)));
  sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + at * 2 * kCols + kCols)));
}

// kSub: the two halves' sums kept apart (each times its sub-scale); else one sum. Each starts at
// -zero * (its half's sum of activations), so it ends as sum(q * a) - zero * sum(a): the same integers.
template <int R, int HB, bool kSub>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma")))
void sym_tile_vnni(const SymWeights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0, int64_t b1,
                   float* acc) {
  constexpr int kSums = kSub ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_loadu_ps(acc + r * kCols);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.lo + at * kLevelBytes<HB>;
    const uint64_t* bits = HB == kWhole ? nullptr : w.planes + at * 4 * HB * 2;
    prefetch_ahead(q, kLevelBytes<HB>, kLevelBytes<HB> / 64);
    if constexpr (HB > 0 && HB != kWhole) prefetch_ahead(bits, 64 * HB, HB);  // HB planes of 64 bytes a block
    __m512i dot[R][kSums];
    for (int r = 0; r < R; ++r) {
      const int32_t* hs = a.hs + 2 * ((row0 + r) * a.blocks + b);
      if constexpr (kSub) {
        dot[r][0] = _mm512_set1_epi32(static_cast<int32_t>(-w.zero * hs[0]));
        dot[r][1] = _mm512_set1_epi32(static_cast<int32_t>(-w.zero * hs[1]));
      } else {
        dot[r][0] = _mm512_set1_epi32(static_cast<int32_t>(-w.zero * (hs[0] + hs[1])));
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      if constexpr (HB == kWhole) {
        lo = _mm512_loadu_si512(q + c * 128);
        hi = _mm512_loadu_si512(q + c * 128 + 64);
      } else {
        const __m512i raw = _mm512_loadu_si512(q + c * 64);
        lo = _mm512_and_si512(raw, nibble);
        hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        add_high16<HB>(bits, c, lo, hi);
      }
      constexpr int kStride = kSub ? 1 : 0;  // chunks 0, 1: the first half; 2, 3: the second
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
        __m512i& d = dot[r][(c / 2) * kStride];
        d = _mm512_dpbusd_epi32(d, lo, _mm512_set1_epi32(load4(x)));
        d = _mm512_dpbusd_epi32(d, hi, _mm512_set1_epi32(load4(x + 4)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_d(w, group, b))));
    __m512i sc0, sc1;
    if constexpr (kSub) sub_scales16(w, at, sc0, sc1);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * a.blocks + b;
      __m512i isum = dot[r][0];
      if constexpr (kSub) isum = _mm512_add_epi32(_mm512_mullo_epi32(sc0, dot[r][0]), _mm512_mullo_epi32(sc1, dot[r][1]));
      sum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(a.s[i])), sum[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kCols, sum[r]);
}

// The epilogue of a symmetric tile on 256-bit registers: columns [8 ch, 8 ch + 8) of block b, rows
// [row0, row0 + R), from each row's two halves' int32 sums of level * activation (`dot`): subtract
// zero * (the half's sum of activations) unless kCentered (the sums are of (level - zero) * activation
// already), weigh the halves by their sub-scales (kSub), then acc += float(isum) * (d * s).
template <int R, bool kSub, bool kCentered = false>
__attribute__((target("avx2,f16c,fma"), always_inline)) inline
void sym_store8(const SymWeights& w, const Activations& a, int64_t group, int64_t row0, int64_t b, int ch,
                const __m256i (&dot)[R][2], float* acc) {
  const int64_t at = group * w.blocks + b;
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block_d(w, group, b) + ch * 8)));
  __m256i sc0 = _mm256_set1_epi32(1), sc1 = sc0;
  if constexpr (kSub) {
    sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + at * 2 * kCols + ch * 8)));
    sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + at * 2 * kCols + kCols + ch * 8)));
  }
  for (int r = 0; r < R; ++r) {
    const int64_t i = (row0 + r) * a.blocks + b;
    __m256i h[2];
    for (int half = 0; half < 2; ++half)
      h[half] = kCentered ? dot[r][half]
                          : _mm256_sub_epi32(dot[r][half], _mm256_set1_epi32(static_cast<int32_t>(w.zero * a.hs[2 * i + half])));
    __m256i isum;
    if constexpr (kSub) isum = _mm256_add_epi32(_mm256_mullo_epi32(sc0, h[0]), _mm256_mullo_epi32(sc1, h[1]));
    else isum = _mm256_add_epi32(h[0], h[1]);
    float* out = acc + r * kCols + ch * 8;
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(a.s[i])),
                                          _mm256_loadu_ps(out)));
  }
}

// The same steps on 256-bit registers for levels of at most 6 bits (HB <= 2: Q6_K, Q5_0, Q4_0), a group as
// two halves of 8 columns. A level's nibble and high part are joined before the products (nibble + 16 * high,
// 0..63 in one byte): a vpmaddubsw pair is then at most 2 * 63 * 127 and a chunk's two (its low and high
// nibble positions) 32004, within int16, widened to int32 chunk by chunk (vpmaddwd). One product per weight
// and int32 sums: four rows' accumulators fit the 16 ymm registers, so a weight block is unpacked once per
// four rows. The integer sums are sum(level * a), the VNNI tile's, then the same float steps (sym_store8), so
// both paths agree bit for bit.
template <int R, int HB, bool kSub>
__attribute__((target("avx2,f16c,fma")))
void sym_tile_avx2_joined(const SymWeights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0,
                          int64_t b1, float* acc) {
  static_assert(HB <= 2, "levels of at most 6 bits keep a chunk's vpmaddubsw pairs within int16");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = group * w.blocks + b;
    const uint8_t* q = w.lo + at * kGroupBytes;
    const uint64_t* bits = w.planes + at * 4 * HB * 2;
    prefetch_ahead(q, kGroupBytes, kGroupBytes / 64);
    if constexpr (HB > 0) prefetch_ahead(bits, 64 * HB, HB);
    for (int ch = 0; ch < 2; ++ch) {
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        levels8<HB>(q, bits, c, ch, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(x))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(x + 4))));
          dot[r][c / 2] = _mm256_add_epi32(dot[r][c / 2], _mm256_madd_epi16(pairs, ones));
        }
      }
      sym_store8<R, kSub>(w, a, group, row0, b, ch, dot, acc);
    }
  }
}

// The same steps on 256-bit registers for whole-byte levels, a group as two halves of 8 columns. l = q - zero
// is an int8 (checked by linear_sym); vpmaddubsw takes |l| (at most 128) times the activation with l's sign
// (vpsignb), so a pair is at most 2 * 128 * 127, within int16, widened to int32 at once. The sums are
// sum((q - zero) * a): the same integers as the VNNI tile's, then the same float steps (sym_store8).
template <int R, bool kSub>
__attribute__((target("avx2,f16c,fma")))
void sym_tile_avx2_whole(const SymWeights& w, const Activations& a, int64_t group, int64_t row0, int64_t b0,
                         int64_t b1, float* acc) {
  const __m256i zero = _mm256_set1_epi8(static_cast<char>(w.zero));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* q = w.lo + (group * w.blocks + b) * kLevelBytes<kWhole>;
    prefetch_ahead(q, kLevelBytes<kWhole>, kLevelBytes<kWhole> / 64);
    for (int ch = 0; ch < 2; ++ch) {
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i lo = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 128 + ch * 32)), zero);
        const __m256i hi = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 128 + 64 + ch * 32)), zero);
        const __m256i lo_size = _mm256_abs_epi8(lo), hi_size = _mm256_abs_epi8(hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (row0 + r) * a.k + b * kBlock + c * 8;
          const __m256i xl = _mm256_sign_epi8(_mm256_set1_epi32(load4(x)), lo);
          const __m256i xh = _mm256_sign_epi8(_mm256_set1_epi32(load4(x + 4)), hi);
          dot[r][c / 2] = _mm256_add_epi32(dot[r][c / 2],
                                           _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo_size, xl), ones),
                                                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi_size, xh), ones)));
        }
      }
      sym_store8<R, kSub, true>(w, a, group, row0, b, ch, dot, acc);
    }
  }
}

using SymTile = TileOf<SymWeights>;
constexpr int kSymRows = 4;  // 8 int32 accumulators + 2 (whole: 4) weights + 2 broadcasts + constants

// The AVX2 tile over R rows: joined levels (HB <= 2) or whole bytes.
template <int R, int HB, bool kSub>
constexpr SymTile sym_tile_avx2() {
  static_assert(HB <= 2 || HB == kWhole, "nibbles with 0, 1 or 2 bit planes, or whole bytes");
  if constexpr (HB <= 2) return sym_tile_avx2_joined<R, HB, kSub>;
  else return sym_tile_avx2_whole<R, kSub>;
}

template <int HB, bool kSub>
struct SymTiles {
  static constexpr SymTile vnni[] = {sym_tile_vnni<1, HB, kSub>, sym_tile_vnni<2, HB, kSub>, sym_tile_vnni<3, HB, kSub>,
                                     sym_tile_vnni<4, HB, kSub>, sym_tile_vnni<5, HB, kSub>, sym_tile_vnni<6, HB, kSub>,
                                     sym_tile_vnni<7, HB, kSub>, sym_tile_vnni<8, HB, kSub>};
  static constexpr int avx2_rows = kSymRows;
  static constexpr SymTile avx2[] = {sym_tile_avx2<1, HB, kSub>(), sym_tile_avx2<2, HB, kSub>(),
                                     sym_tile_avx2<3, HB, kSub>(), sym_tile_avx2<4, HB, kSub>()};
};

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kAuto;  // neither path can run
}

// The sum of 8 int32 lanes.
__attribute__((target("avx2")))
int32_t sum8(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

// One block of 32: int8 values round(x / s) (ties to even, as torch.round), s = max|x| / 127, and
// writes the sums of its first and last 16 values to half[0], half[1]. Divides (not multiplies by 1/s), so it equals the reference's rounding.
__attribute__((target("avx2,fma")))
void quantize_block(const float* x, int8_t* q, float* scale, int32_t* half) {
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
    half[0] = half[1] = 0;
    return;
  }
  const __m256 sv = _mm256_set1_ps(s);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));  // MXCSR: nearest, ties even
  const __m256i first = _mm256_add_epi32(n[0], n[1]), last = _mm256_add_epi32(n[2], n[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  half[0] = sum8(first);
  half[1] = sum8(last);
}

// 32 bfloat16 values as float32 (exact: a bfloat16 is the upper half of a float32).
__attribute__((target("avx2")))
void widen_block(const at::BFloat16* x, float* out) {
  for (int i = 0; i < kBlock; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
}

// Per row and block of 32: int8 values, the scale, scale * their sum and their two half sums (threads
// split rows).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* q, float* s, float* ms, int32_t* hs) {
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
        quantize_block(block, q + r * k + b * kBlock, s + i, hs + 2 * i);
        ms[i] = s[i] * static_cast<float>(hs[2 * i] + hs[2 * i + 1]);
      }
    }
  });
}

// Quantize the rows of x, then out = x W^T (+ bias) in the panels and groups described above;
// `table[r - 1]` is the tile over r rows, `tile_rows` its widest.
template <typename T, typename W>
void run(const T* x, T* out, const W& w, int64_t rows, int64_t n, const float* bias, int tile_rows,
         const TileOf<W>* table) {
  const int64_t blocks = w.blocks, k = blocks * kBlock, groups = (n + kCols - 1) / kCols;
  const torch::Tensor q = torch::empty({rows, k}, torch::kInt8);
  const torch::Tensor s = torch::empty({rows, blocks}, torch::kFloat32);
  const torch::Tensor ms = torch::empty({rows, blocks}, torch::kFloat32);
  const torch::Tensor hs = torch::empty({rows, blocks, 2}, torch::kInt32);
  quantize_rows(x, rows, k, q.data_ptr<int8_t>(), s.data_ptr<float>(), ms.data_ptr<float>(), hs.data_ptr<int32_t>());
  const Activations act{q.data_ptr<int8_t>(), s.data_ptr<float>(), ms.data_ptr<float>(), hs.data_ptr<int32_t>(), k,
                        blocks};

  for (int64_t panel = 0; panel < rows; panel += kPanel) {  // prefill: a panel's activations stay in cache
    const int64_t panel_rows = std::min<int64_t>(kPanel, rows - panel);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      alignas(64) float acc[kPanel * kCols];
      for (int64_t g = g0; g < g1; ++g) {
        std::fill(acc, acc + panel_rows * kCols, 0.f);
        for (int64_t b0 = 0; b0 < w.blocks; b0 += kChunk) {  // each weight chunk is read once for the panel
          const int64_t b1 = std::min(w.blocks, b0 + kChunk);
          for (int64_t r = 0; r < panel_rows; r += tile_rows) {
            const int64_t count = std::min<int64_t>(tile_rows, panel_rows - r);
            table[count - 1](w, act, g, panel + r, b0, b1, acc + r * kCols);
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

// out = x W^T (+ bias) in x's dtype.
template <typename W>
torch::Tensor run_any(const torch::Tensor& x, const W& w, int64_t n, const float* bias, int tile_rows,
                      const TileOf<W>* table) {
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    run(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), w, x.size(0), n, bias, tile_rows, table);
  else
    run(xc.data_ptr<float>(), y.data_ptr<float>(), w, x.size(0), n, bias, tile_rows, table);
  return y;
}

// The path to take: `isa` (0: the best here), checked against this CPU.
int64_t resolve_isa(int64_t isa) {
  const int64_t available = best_isa();
  if (isa == kAuto) isa = available;
  TORCH_CHECK(isa != kAuto, "w4a8: this CPU has neither AVX-512 VNNI nor AVX2 with FMA");
  TORCH_CHECK(isa <= available, "w4a8: the requested instruction set is not available on this CPU");
  return isa;
}

// Checks shared by both weight layouts: x, the input width, the output count and the bias.
void check_common(const torch::Tensor& x, int64_t groups, int64_t blocks, int64_t n,
                  const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "w4a8: x must be a 2-D float32 or bfloat16 tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "w4a8: the input width ", k, " is not a multiple of ", kBlock);
  TORCH_CHECK(blocks * kBlock == k, "w4a8: input width ", k, " does not match the weights' ", blocks * kBlock);
  TORCH_CHECK(n > (groups - 1) * kCols && n <= groups * kCols, "w4a8: ", n, " outputs do not fit ", groups, " groups");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n),
              "w4a8: bias must be a contiguous float32 [n]");
}

template <int HB, bool kSub>
torch::Tensor run_sym(const torch::Tensor& x, const SymWeights& w, int64_t n, const float* bias, int64_t isa) {
  using Table = SymTiles<HB, kSub>;
  if (isa == kAvx512Vnni) return run_any(x, w, n, bias, kVnniRows, Table::vnni);
  return run_any(x, w, n, bias, Table::avx2_rows, Table::avx2);
}

}  // namespace

int64_t cpu_isa() { return best_isa(); }

// The tiles of weights whose d and m are in form S, with HB bit planes, for this path.
template <Scales S, int HB>
torch::Tensor run_tiles(const torch::Tensor& x, const Weights& w, int64_t n, const float* bias, int64_t isa) {
  using Table = Tiles<S, HB>;
  if (isa == kAvx512Vnni) return run_any(x, w, n, bias, kVnniRows, Table::vnni);
  return run_any(x, w, n, bias, kAvx2Rows, Table::avx2);
}

// The same with the fifth bits where the weights have them.
template <Scales S>
torch::Tensor run_scales(const torch::Tensor& x, const Weights& w, int64_t n, const float* bias, int64_t isa) {
  return w.planes != nullptr ? run_tiles<S, 1>(x, w, n, bias, isa) : run_tiles<S, 0>(x, w, n, bias, isa);
}

// y = x W^T (+ bias) for x [M, K] float32 or bfloat16 (y in the same dtype; the bias float32), W packed
// as above with n output columns: d and m (float16 or float32, both the same) or, instead of them, the
// two levels top_d, top_m, sc, mn (all four); `planes` the levels' fifth bits or none; isa 0 = the best
// this CPU has.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wq, const c10::optional<torch::Tensor>& planes,
                     const c10::optional<torch::Tensor>& wd,
                     const c10::optional<torch::Tensor>& wm, const c10::optional<torch::Tensor>& top_d,
                     const c10::optional<torch::Tensor>& top_m, const c10::optional<torch::Tensor>& sc,
                     const c10::optional<torch::Tensor>& mn, const c10::optional<torch::Tensor>& bias, int64_t n,
                     int64_t isa) {
  TORCH_CHECK(wq.scalar_type() == torch::kUInt8 && wq.dim() == 4 && wq.size(2) * wq.size(3) == kGroupBytes &&
              wq.is_contiguous(), "w4a8: packed weights must be contiguous uint8 [groups, blocks, 4, 64]");
  const int64_t groups = wq.size(0), blocks = wq.size(1);
  check_common(x, groups, blocks, n, bias);
  TORCH_CHECK(!planes || (planes->scalar_type() == torch::kUInt8 && planes->is_contiguous() &&
                          planes->numel() == groups * blocks * 4 * 2 * 8),
              "w4a8: the fifth bits' planes must be contiguous uint8 [groups, blocks, 4, 1, 2, 8]");
  const uint64_t* fifth = planes ? reinterpret_cast<const uint64_t*>(planes->data_ptr<uint8_t>()) : nullptr;
  const bool two_level = sc.has_value();
  TORCH_CHECK(top_d.has_value() == two_level && top_m.has_value() == two_level && mn.has_value() == two_level,
              "w4a8: two-level scales need all of top_d, top_m, sc and mn");
  TORCH_CHECK(wd.has_value() == !two_level && wm.has_value() == !two_level,
              "w4a8: a weight has either d and m or two-level scales, not both");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  isa = resolve_isa(isa);
  if (two_level) {
    TORCH_CHECK(blocks % kSuper == 0, "w4a8: two-level scales need whole super-blocks of ", kSuper, " blocks");
    for (const auto* t : {&*top_d, &*top_m})
      TORCH_CHECK(t->scalar_type() == torch::kFloat16 && t->is_contiguous() &&
                  t->numel() == groups * (blocks / kSuper) * kCols, "w4a8: top_d and top_m must be contiguous "
                  "float16 [groups, blocks / 8, 16]");
    for (const auto* t : {&*sc, &*mn})
      TORCH_CHECK(t->scalar_type() == torch::kUInt8 && t->is_contiguous() && t->numel() == groups * blocks * kCols,
                  "w4a8: sc and mn must be contiguous uint8 [groups, blocks, 16]");
    const auto half = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
    const Weights w{wq.data_ptr<uint8_t>(), fifth, nullptr, nullptr, half(*top_d), half(*top_m), sc->data_ptr<uint8_t>(),
                    mn->data_ptr<uint8_t>(), blocks};
    return run_scales<kTwoLevel>(x, w, n, b, isa);
  }
  const auto dtype = wd->scalar_type();
  TORCH_CHECK((dtype == torch::kFloat16 || dtype == torch::kFloat32) && wm->scalar_type() == dtype &&
              wd->is_contiguous() && wm->is_contiguous(), "w4a8: d and m must be contiguous, both float16 or both "
              "float32");
  TORCH_CHECK(wd->numel() == groups * blocks * kCols && wm->numel() == wd->numel(), "w4a8: scale shapes");
  const Weights w{wq.data_ptr<uint8_t>(), fifth, wd->data_ptr(), wm->data_ptr(), nullptr, nullptr, nullptr, nullptr,
                  blocks};
  return dtype == torch::kFloat32 ? run_scales<kFloat>(x, w, n, b, isa) : run_scales<kHalf>(x, w, n, b, isa);
}

// y = x W^T (+ bias) for a weight of symmetric blocks (see SymWeights): `bits` high bits above the
// nibble (0, 1, 2 or 4), `zero` the levels' offset, `sc` per 16 inputs or none, d per `span` blocks; the
// levels as nibbles and planes, or as whole bytes (lo [groups, blocks, 4, 128], no planes).
torch::Tensor linear_sym(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& planes,
                         const c10::optional<torch::Tensor>& sc, const torch::Tensor& d,
                         const c10::optional<torch::Tensor>& bias, int64_t n, int64_t bits, int64_t zero, int64_t span,
                         int64_t isa) {
  TORCH_CHECK(bits == 0 || bits == 1 || bits == 2 || bits == 4, "w4a8: high bits must be 0, 1, 2 or 4, not ", bits);
  TORCH_CHECK(lo.scalar_type() == torch::kUInt8 && lo.dim() == 4 && lo.size(2) == 4 &&
              (lo.size(3) == 64 || lo.size(3) == 128) && lo.is_contiguous(),
              "w4a8: symmetric levels must be contiguous uint8 [groups, blocks, 4, 64] (whole bytes: 4, 128)");
  const bool whole = lo.size(3) == 128;
  TORCH_CHECK(whole || bits != 4, "w4a8: 8-bit levels are whole bytes [groups, blocks, 4, 128]");
  const int64_t groups = lo.size(0), blocks = lo.size(1);
  check_common(x, groups, blocks, n, bias);
  TORCH_CHECK(zero >= 0 && zero < (int64_t{16} << bits), "w4a8: the offset ", zero, " is not a level");
  TORCH_CHECK(!whole || (zero <= 128 && (int64_t{16} << bits) - 1 - zero <= 127), "w4a8: whole-byte levels less the "
              "offset must be int8s, not with the offset ", zero, " for ", 4 + bits, "-bit levels");
  TORCH_CHECK(span >= 1 && (span & (span - 1)) == 0 && blocks % span == 0, "w4a8: ", blocks,
              " blocks are not whole spans of ", span, " (a power of two)");
  TORCH_CHECK(planes.scalar_type() == torch::kUInt8 && planes.is_contiguous() &&
              planes.numel() == (whole ? 0 : groups * blocks * 4 * bits * 2 * 8),
              "w4a8: planes must be contiguous uint8 [groups, blocks, 4, bits, 2, 8] (none for whole bytes)");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.numel() == groups * (blocks / span) * kCols,
              "w4a8: d must be contiguous float16 [groups, blocks / span, 16]");
  TORCH_CHECK(!sc || (sc->scalar_type() == torch::kInt8 && sc->is_contiguous() &&
                      sc->numel() == groups * blocks * 2 * kCols),
              "w4a8: sc must be contiguous int8 [groups, blocks, 2, 16]");
  isa = resolve_isa(isa);
  const SymWeights w{lo.data_ptr<uint8_t>(), reinterpret_cast<const uint64_t*>(planes.data_ptr<uint8_t>()),
                     sc ? sc->data_ptr<int8_t>() : nullptr,
                     reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), blocks, zero,
                     __builtin_ctzll(static_cast<unsigned long long>(span))};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (whole) return sc ? run_sym<kWhole, true>(x, w, n, b, isa) : run_sym<kWhole, false>(x, w, n, b, isa);
  switch (bits * 2 + (sc ? 1 : 0)) {
    case 0: return run_sym<0, false>(x, w, n, b, isa);
    case 1: return run_sym<0, true>(x, w, n, b, isa);
    case 2: return run_sym<1, false>(x, w, n, b, isa);
    case 3: return run_sym<1, true>(x, w, n, b, isa);
    case 4: return run_sym<2, false>(x, w, n, b, isa);
    default: return run_sym<2, true>(x, w, n, b, isa);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &linear, "W4A8 linear: y = x W^T (+ bias)", pybind11::arg("x"), pybind11::arg("q"),
             pybind11::arg("planes"), pybind11::arg("d"), pybind11::arg("m"), pybind11::arg("top_d"), pybind11::arg("top_m"),
             pybind11::arg("sc"), pybind11::arg("mn"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("isa"));
  module.def("linear_sym", &linear_sym, "Symmetric-block linear: y = x W^T (+ bias)", pybind11::arg("x"),
             pybind11::arg("lo"), pybind11::arg("planes"), pybind11::arg("sc"), pybind11::arg("d"),
             pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("bits"), pybind11::arg("zero"),
             pybind11::arg("span"), pybind11::arg("isa"));
  module.def("cpu_isa", &cpu_isa, "2: AVX-512 VNNI, 1: AVX2, 0: neither");
}
