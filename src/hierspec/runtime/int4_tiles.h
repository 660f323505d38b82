// The bfloat16 tile layout's weights and their decoding (PackedAmx in int4_kernel.py), shared by the AMX products
// (int4_amx.cpp) and the AVX512-BF16 dot products (int4_bf16.cpp): both decode a code to the same bfloat16 weight
// by the same instructions. Its operand checks serve the AVX512-VNNI products (int4_vnni.cpp) too.
//
// Two forms, a step being 32 inputs of a block of 16 outputs:
//   4-bit (Q4_0, Q4_1, Q4_K: one pass of codes 0..15): w[n, k] = code[n, k] * scale[n, g] + bias[n, g], g = k / 32
//     codes uint8 [1, N / 16, G, 256]: byte i of pair j (bytes 32 j..) holds code[16 b + 2 j, 32 g + i] in its low
//     nibble and code[16 b + 2 j + 1, 32 g + i] in its high one; scale [1, N / 16, G, 16]; bias [N / 16, G, 16].
//     A pair of outputs is decoded through one table of their 16 possible weights each.
//   8-bit (Q8_0, Q6_K): signed codes, w[n, k] = code[n, k] * scale[n, k / 16]
//     codes int8 [1, N / 16, K / 32, 512]: output n's 32 codes of a step at bytes 32 n..; scale [1, N / 16, K / 16,
//     16].
// Scales and biases are float32, or float16 where every value is one (int4_kernel.py packs them so when that is
// exact): widened exactly, they decode to the same weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace hierspec_tiles {

constexpr int64_t kBlock = 16;                // outputs per block
constexpr int64_t kStep = 32;                 // inputs per step
constexpr int64_t kDecoded = kBlock * kStep;  // bfloat16 weights of a decoded step

// A product's operands in the tile layout, as its checks found them
struct TileShape {
  int64_t blocks, steps, groups;
  bool eight, half;   // 8-bit codes (or 6-bit ones, scaled as 8-bit codes are); float16 scales and biases
  bool six = false;  // 6-bit codes (the integer products' quads only: int4_vnni.cpp)
};

// How a product's codes are laid out (each file's header has the details): the AMX tiles [1, N / 16, K / 32, 256 or
// 512], the AVX512-BF16 pairs [1, N / 16, 8, K / 32, 32 or 64] or the VNNI quads [1, N / 16, K / 32, 4 or 8, 16, 4]
enum class CodeLayout { kTiles, kPairs, kQuads };

// Checks x (float32 [M, K]) and the codes in `layout`: the shape they give (`half` unset).
inline TileShape checked_codes(const at::Tensor& x, const at::Tensor& codes, CodeLayout layout) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool six = layout == CodeLayout::kQuads && codes.scalar_type() == at::kByte && codes.dim() == 6 &&
                   codes.size(3) == 6;
  const bool eight = codes.scalar_type() == at::kChar || six;
  const int64_t step_bytes = six ? 384 : eight ? 512 : 256;
  const bool common = (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte) && codes.is_contiguous() &&
                      codes.dim() >= 4 && codes.size(0) == 1;
  bool fits = false;
  const char* expected = "";
  switch (layout) {
    case CodeLayout::kTiles:
      fits = common && codes.dim() == 4 && codes.size(3) == step_bytes;
      expected = "codes: contiguous uint8 [1, N / 16, K / 32, 256] or int8 [1, N / 16, K / 32, 512]";
      break;
    case CodeLayout::kPairs:
      fits = common && codes.dim() == 5 && codes.size(2) == 8 && codes.size(4) == step_bytes / 8;
      expected = "codes: contiguous uint8 [1, N / 16, 8, K / 32, 32] or int8 [1, N / 16, 8, K / 32, 64]";
      break;
    case CodeLayout::kQuads:
      fits = common && codes.dim() == 6 && codes.size(3) == step_bytes / 64 && codes.size(4) == 16 &&
             codes.size(5) == 4;
      expected = "codes: contiguous uint8 [1, N / 16, K / 32, 4, 16, 4] (4-bit), int8 [1, N / 16, K / 32, 8, 16, 4] "
                 "(8-bit) or uint8 [1, N / 16, K / 32, 6, 16, 4] (6-bit)";
      break;
  }
  TORCH_CHECK(fits, expected);
  const int64_t blocks = codes.size(1), steps = codes.size(layout == CodeLayout::kPairs ? 3 : 2);
  const int64_t groups = eight ? 2 * steps : steps;
  TORCH_CHECK(x.size(1) == steps * kStep, "K must match the codes' steps of 32 inputs");
  return {blocks, steps, groups, eight, false, six};
}

// Checks the scales and biases stored whole (float32 or float16) of codes of `shape`, and sets `shape.half`.
inline void check_scales(TileShape& shape, const at::Tensor& scale, const at::Tensor& bias) {
  const int64_t blocks = shape.blocks, groups = shape.groups;
  const bool eight = shape.eight, half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(scale.is_contiguous() && (half || scale.scalar_type() == at::kFloat) &&
                  scale.sizes() == at::IntArrayRef({1, blocks, groups, kBlock}),
              "scale: contiguous float32 or float16 [1, N / 16, K / 32, 16] (4-bit codes) or [1, N / 16, K / 16, 16] "
              "(8-bit)");
  TORCH_CHECK(eight ? bias.numel() == 0
                    : (bias.is_contiguous() && bias.scalar_type() == scale.scalar_type() &&
                       bias.sizes() == at::IntArrayRef({blocks, groups, kBlock})),
              "bias: contiguous [N / 16, K / 32, 16] of the scale's dtype (4-bit codes) or empty (8-bit codes)");
  shape.half = half;
}

// Checks x (float32 [M, K]), the codes in `layout` and the scales and biases of either form.
inline TileShape checked_tiles(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                               const at::Tensor& bias, CodeLayout layout) {
  TileShape shape = checked_codes(x, codes, layout);
  check_scales(shape, scale, bias);
  return shape;
}

}  // namespace hierspec_tiles

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HIERSPEC_BF16_TILES 1

namespace hierspec_tiles {

// A product's weights in the tile layout, scales and biases of element type S (float, or uint16_t holding float16)
template <typename S>
struct Tiles {
  const uint8_t* codes;
  const S* scale;
  const S* bias;  // nullptr for the 8-bit form
  int64_t steps, groups, blocks, n;
};

// `count` scales (or biases; a multiple of 16) as float32 in memory, where the decode's broadcasts read them:
// float32 ones where they are, float16 ones widened (exactly) into `room`
inline const float* widened(const float* values, int64_t, float*) { return values; }

inline const float* widened(const uint16_t* values, int64_t count, float* room) {
  for (int64_t i = 0; i < count; i += 16)
    _mm512_storeu_ps(room + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i))));
  return room;
}

// a vector's bits as another vector type of the same size (bfloat16 words as integers and back)
template <class To, class From>
inline To bits(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// The 4-bit form: step g of a block is scale group g.
template <typename S>
struct FourBit {
  using Scale = S;
  static constexpr int64_t kCodeBytes = 256;
  static constexpr int64_t kScales = 16;  // a step's scales (and biases)
  static constexpr int64_t kScaleBytes = kScales * sizeof(S);
  const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  static const S* scale_of(const Tiles<S>& t, int64_t block, int64_t step) {
    return t.scale + (block * t.groups + step) * kBlock;
  }
  static const S* bias_of(const Tiles<S>& t, int64_t block, int64_t step) {
    return t.bias + (block * t.groups + step) * kBlock;
  }
  static const uint8_t* codes_of(const Tiles<S>& t, int64_t block, int64_t step) {
    return t.codes + (block * t.steps + step) * kCodeBytes;
  }

  static constexpr int64_t kPairBytes = 32;

  // outputs 2 j and 2 j + 1 of a step (their 32 code bytes `src`, the step's 16 scales and biases as float32): 32
  // bfloat16 weights each, in input order
  void pair(const uint8_t* src, const float* scale, const float* bias, int j, __m512i& even, __m512i& odd) const {
    const __m512 even_values = _mm512_fmadd_ps(code_values, _mm512_set1_ps(scale[2 * j]), _mm512_set1_ps(bias[2 * j]));
    const __m512 odd_values =
        _mm512_fmadd_ps(code_values, _mm512_set1_ps(scale[2 * j + 1]), _mm512_set1_ps(bias[2 * j + 1]));
    const __m512i table = bits<__m512i>(_mm512_cvtne2ps_pbh(odd_values, even_values));  // entries 0..15 even, 16..31 odd
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi16(16));
    even = _mm512_permutexvar_epi16(low, table);
    odd = _mm512_permutexvar_epi16(high, table);
  }

  // a step's 16 outputs into dst [16 outputs x 32 bfloat16]
  void decode(const Tiles<S>& t, int64_t block, int64_t step, uint16_t* dst) const {
    alignas(64) float rooms[2][kScales];
    const float* scale = widened(scale_of(t, block, step), kScales, rooms[0]);
    const float* bias = widened(bias_of(t, block, step), kScales, rooms[1]);
    const uint8_t* src = codes_of(t, block, step);
    for (int j = 0; j < 8; ++j) {
      __m512i even, odd;
      pair(src + kPairBytes * j, scale, bias, j, even, odd);
      _mm512_store_si512(dst + 64 * j, even);
      _mm512_store_si512(dst + 64 * j + 32, odd);
    }
  }
};

// The 8-bit form: step s of a block covers scale groups 2 s and 2 s + 1; each code converted through float32.
template <typename S>
struct EightBit {
  using Scale = S;
  static constexpr int64_t kCodeBytes = 512;
  static constexpr int64_t kScales = 32;
  static constexpr int64_t kScaleBytes = kScales * sizeof(S);

  static const S* scale_of(const Tiles<S>& t, int64_t block, int64_t step) {
    return t.scale + (block * t.groups + 2 * step) * kBlock;
  }
  static const S* bias_of(const Tiles<S>&, int64_t, int64_t) { return nullptr; }
  static const uint8_t* codes_of(const Tiles<S>& t, int64_t block, int64_t step) {
    return t.codes + (block * t.steps + step) * kCodeBytes;
  }

  static constexpr int64_t kPairBytes = 64;

  // output n of a step (its 32 codes `src`, the step's 32 scales as float32): 32 bfloat16 weights in input order
  static __m512i output(const uint8_t* src, const float* scale, int n) {
    const __m128i* row = reinterpret_cast<const __m128i*>(src);
    const __m512 low =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), _mm512_set1_ps(scale[n]));
    const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))),
                                      _mm512_set1_ps(scale[kBlock + n]));
    return bits<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  }

  void pair(const uint8_t* src, const float* scale, const float*, int j, __m512i& even, __m512i& odd) const {
    even = output(src, scale, 2 * j);
    odd = output(src + 32, scale, 2 * j + 1);
  }

  void decode(const Tiles<S>& t, int64_t block, int64_t step, uint16_t* dst) const {
    alignas(64) float room[kScales];
    const float* scale = widened(scale_of(t, block, step), kScales, room);
    const uint8_t* src = codes_of(t, block, step);
    for (int n = 0; n < 16; ++n) _mm512_store_si512(dst + 32 * n, output(src + 32 * n, scale, n));
  }
};

// run(form, weights) with the product's form (4-bit or 8-bit codes) and its weights, scales and biases of the type
// they are stored in (float32, or float16 as uint16_t)
template <class Run>
void with_form(const TileShape& shape, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
               int64_t n, Run run) {
  auto weights = [&](auto scale_type) {
    using S = decltype(scale_type);
    return Tiles<S>{static_cast<const uint8_t*>(codes.data_ptr()), static_cast<const S*>(scale.data_ptr()),
                    shape.eight ? nullptr : static_cast<const S*>(bias.data_ptr()), shape.steps, shape.groups,
                    shape.blocks, n};
  };
  if (shape.eight && shape.half) run(EightBit<uint16_t>{}, weights(uint16_t{}));
  else if (shape.eight) run(EightBit<float>{}, weights(float{}));
  else if (shape.half) run(FourBit<uint16_t>{}, weights(uint16_t{}));
  else run(FourBit<float>{}, weights(float{}));
}

// float32 rows as bfloat16, rounded to nearest even (K a multiple of 32): the AVX512-BF16 products' rows
inline void rounded_rows(const float* x, int64_t count, std::vector<uint16_t>& rows) {
  rows.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    std::memcpy(rows.data() + i, &pair, sizeof pair);
  }
}

}  // namespace hierspec_tiles

#endif  // AVX512-BF16
