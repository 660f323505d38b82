// hierspec's quantized products on AVX512-BF16 dot products (CPUs with AVX512_BF16 but no AMX tiles: AMD Zen 4):
// the weights decoded to bfloat16 once for all rows, so that a tree's rows add only their dot products.
//
// The weights are int4_tiles.h's (the AMX products' decoding: the same bfloat16 weight for every code) in a layout
// of their own, a block's pairs of outputs one after another so that each thread reads one sequential stream:
//   codes [1, N / 16, 8, K / 32, B]: pair j's bytes of step s (B = 32 for 4-bit codes, 64 for 8-bit ones, as
//   int4_tiles.h orders them within a step); scale and bias as the tile layout's ([1, N / 16, groups, 16], [N / 16,
//   K / 32, 16] or empty).
// A pass over one pair's steps decodes each step's 2 x 32 weights once and multiplies them with up to 8 rows
// (rounded to bfloat16, round to nearest even): VDPBF16PS adds two products per float32 lane, each (row, output)
// accumulates 16 lanes over the steps and sums them at the end. More rows take several passes over the pair's
// decoded weights. A row costs a dot product per 32 weights: on a Zen 4 (~1.3 cycles each) a 16-row product takes
// ~5x a one-row one's time, where decoding (~9.5 cycles per pair and step) dominates one row.
//
// Batch invariance: each (row, output) result is one fixed sequence of dot products and one fixed lane sum, whatever
// the number of rows, how they are grouped into passes or how the blocks are split between threads
// (tests/test_int4_kernel.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_tiles.h"

namespace {

using hierspec_tiles::kBlock;
using hierspec_tiles::kStep;
using hierspec_tiles::checked_tiles;
using hierspec_tiles::CodeLayout;
using hierspec_tiles::TileShape;

#ifdef HIERSPEC_BF16_TILES
using hierspec_tiles::bits;
using hierspec_tiles::rounded_rows;
using hierspec_tiles::Tiles;
using hierspec_tiles::widened;
using hierspec_tiles::with_form;

constexpr int kPairs = kBlock / 2;
constexpr int kRowsPerPass = 8;  // 2 accumulators a row: 16 of the 32 vector registers

// A product's weights (codes in this file's layout), its rows as bfloat16 [rows, K] and its output [rows, N]
template <typename S>
struct Dots {
  Tiles<S> w;
  const uint16_t* x;
  float* out;
  int64_t rows, k;
};

// outputs 2 j and 2 j + 1 of a block for rows r0 .. r0 + MT, step s's weights from weights_of(s, even, odd)
template <int MT, class S, class WeightsOf>
void pair_rows(const Dots<S>& d, int64_t block, int j, int64_t r0, WeightsOf weights_of) {
  const uint16_t* x = d.x + r0 * d.k;
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < d.w.steps; ++s) {
    __m512i even, odd;
    weights_of(s, even, odd);
    for (int m = 0; m < MT; ++m) {
      const __m512bh inputs = bits<__m512bh>(_mm512_loadu_si512(x + m * d.k + s * kStep));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], bits<__m512bh>(even), inputs);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], bits<__m512bh>(odd), inputs);
    }
  }
  float* out = d.out + r0 * d.w.n + block * kBlock + 2 * j;
  for (int m = 0; m < MT; ++m) {
    out[m * d.w.n] = _mm512_reduce_add_ps(acc[m][0]);
    out[m * d.w.n + 1] = _mm512_reduce_add_ps(acc[m][1]);
  }
}

template <class S, class WeightsOf>
void pair_row_tile(const Dots<S>& d, int64_t block, int j, int64_t r0, WeightsOf weights_of) {
  switch (std::min<int64_t>(kRowsPerPass, d.rows - r0)) {
    case 8: pair_rows<8>(d, block, j, r0, weights_of); break;
    case 7: pair_rows<7>(d, block, j, r0, weights_of); break;
    case 6: pair_rows<6>(d, block, j, r0, weights_of); break;
    case 5: pair_rows<5>(d, block, j, r0, weights_of); break;
    case 4: pair_rows<4>(d, block, j, r0, weights_of); break;
    case 3: pair_rows<3>(d, block, j, r0, weights_of); break;
    case 2: pair_rows<2>(d, block, j, r0, weights_of); break;
    default: pair_rows<1>(d, block, j, r0, weights_of); break;
  }
}

// a step's decoded weights of a pair of outputs
struct alignas(64) Decoded {
  __m512i even, odd;
};

// outputs 2 j and 2 j + 1 of a block for every row: up to 8 rows decode each step as they multiply it; more rows
// decode the pair's steps once into `decoded` (2 x 32 bfloat16 a step) for all their passes (16 rows: ~17 % less
// time than decoding twice)
template <class Form>
void pair_all_rows(const Form& form, const Dots<typename Form::Scale>& d, int64_t block, int j, const float* scales,
                   const float* biases, Decoded* decoded) {
  const uint8_t* codes = d.w.codes + (block * kPairs + j) * d.w.steps * Form::kPairBytes;
  auto decode = [&](int64_t s, __m512i& even, __m512i& odd) {
    form.pair(codes + s * Form::kPairBytes, scales + s * Form::kScales,
              biases == nullptr ? nullptr : biases + s * Form::kScales, j, even, odd);
  };
  if (d.rows <= kRowsPerPass) {
    pair_row_tile(d, block, j, 0, decode);
    return;
  }
  for (int64_t s = 0; s < d.w.steps; ++s) decode(s, decoded[s].even, decoded[s].odd);
  auto stored = [&](int64_t s, __m512i& even, __m512i& odd) {
    even = decoded[s].even;
    odd = decoded[s].odd;
  };
  for (int64_t r0 = 0; r0 < d.rows; r0 += kRowsPerPass) pair_row_tile(d, block, j, r0, stored);
}

template <class Form>
void blocks_of_outputs(const Dots<typename Form::Scale>& d, int64_t begin, int64_t end) {
  thread_local std::vector<float> scale_room, bias_room;  // a block's float16 scales and biases, widened
  thread_local std::vector<Decoded> decoded;
  decoded.resize(static_cast<size_t>(d.w.steps));
  const Form form;
  const int64_t count = d.w.steps * Form::kScales;  // a block's scales (and biases)
  scale_room.resize(static_cast<size_t>(count));
  bias_room.resize(static_cast<size_t>(count));
  for (int64_t block = begin; block < end; ++block) {
    const float* scales = widened(Form::scale_of(d.w, block, 0), count, scale_room.data());
    const float* biases =
        d.w.bias == nullptr ? nullptr : widened(Form::bias_of(d.w, block, 0), count, bias_room.data());
    for (int j = 0; j < kPairs; ++j) pair_all_rows(form, d, block, j, scales, biases, decoded.data());
  }
}

#endif  // HIERSPEC_BF16_TILES

}  // namespace

// Whether this build can run the AVX512-BF16 products (compiled for a CPU with AVX512_BF16 and AVX512_BW).
bool bf16_ready() {
#ifdef HIERSPEC_BF16_TILES
  return true;
#else
  return false;
#endif
}

// x: float32 [M, K]; codes: uint8 [1, N / 16, 8, K / 32, 32] (4-bit form) or int8 [1, N / 16, 8, K / 32, 64]
// (8-bit form); scale: float32 or float16 [1, N / 16, K / 32, 16] or [1, N / 16, K / 16, 16]; bias: the scale's
// dtype [N / 16, K / 32, 16] for the 4-bit form, empty for the 8-bit one. Returns float32 [M, N].
at::Tensor int4_bf16_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(bf16_ready(), "the AVX512-BF16 product is not available in this build");
  const TileShape shape = checked_tiles(x, codes, scale, bias, CodeLayout::kPairs);
  const int64_t rows = x.size(0), n = shape.blocks * kBlock;
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#ifdef HIERSPEC_BF16_TILES
  thread_local std::vector<uint16_t> inputs;
  rounded_rows(x.data_ptr<float>(), x.numel(), inputs);
  // every block of the product, shared out between the threads
  with_form(shape, codes, scale, bias, n, [&](auto form, const auto& weights) {
    const Dots<typename decltype(form)::Scale> d{weights, inputs.data(), out.data_ptr<float>(), rows, x.size(1)};
    at::parallel_for(0, weights.blocks, 4, [&](int64_t begin, int64_t end) {
      blocks_of_outputs<decltype(form)>(d, begin, end);
    });
  });
#endif
  return out;
}
