// hierspec's quantized products on integer dot products — AVX512-VNNI (AMD Zen 4, Intel from Cascade Lake on), or
// AVX2's byte products elsewhere (AMD Zen 3, Intel from Haswell on): the codes stay integers, and each row is rounded
// to two 8-bit codes an input, ~15 bits per 32 inputs (closer to float32 than bfloat16's 8-bit significands).
//
// Decoding a code to a bfloat16 weight (int4_bf16.cpp) costs more than multiplying it: on a Zen 4 one row's product
// is bound by the decoding. Here 4-bit codes are only masked out of their bytes and 8-bit ones taken as they are;
// VPDPBUSD multiplies 64 of them by 4 of a row's codes at once, accumulating in int32 exactly, and the scales (the
// weights' and the row's) are applied once per 32 inputs in float32.
//
// Layout (PackedVnni in int4_kernel.py), a step being 32 inputs of a block of 16 outputs, a quad 4 inputs:
//   4-bit: codes uint8 [1, N / 16, K / 32, 4, 16, 4]: byte (c, n, i) of a step holds the code of output 16 b + n at
//     input 32 s + 4 c + i in its low nibble and at input 32 s + 16 + 4 c + i in its high one; w = code scale + bias
//     with scale [1, N / 16, K / 32, 16] and bias [N / 16, K / 32, 16] (the tile layout's, int4_tiles.h).
//   8-bit: codes int8 [1, N / 16, K / 32, 8, 16, 4]: byte (c, n, i) the signed code of output 16 b + n at input
//     32 s + 4 c + i; w = code scale with scale [1, N / 16, K / 16, 16]. VPDPBUSD runs them as unsigned bytes
//     code + 128, each 16 inputs' sum of 128 x the row's codes taken back in int32; AVX2 as |code| times the row's
//     code with the code's sign.
//   6-bit (codes within -32..31: Q6_K's, Q5_0's): codes uint8 [1, N / 16, K / 32, 6, 16, 4], code + 32 split into
//     the 4-bit layout's nibbles (chunks 0..3) and two chunks of high bits (SixQuads below); scaled as 8-bit codes.
// A row's step (rounded_rows): x ~ e q with e = max |x| / 127 / 128 and q = 128 high + low; then for each output
//   4-bit: y += e (scale sum(code q) + bias sum(q));  8-bit: y += e (scale_lo dot_lo + scale_hi dot_hi),
// each integer sum as 128 times the high codes' dot plus the low codes' one.
// int4_vnni8_mm rounds each row to one 8-bit code an input instead (llama.cpp's activation precision, per 32 inputs:
// x ~ d high, e = d): half the dot products a row, so trees and batches of rows cost less, at the rows' precision.
//
// Batch invariance: a row's codes and every (row, output) sum depend on that row alone, in one fixed order, whatever
// the number of rows, how they are grouped into passes or how the blocks are split between threads
// (tests/test_int4_kernel.py).
//
// Two translation units: this file defines int4_vnni_mm, vnni_ready and vnni_width; int4_vnni8.cpp (this file with
// HIERSPEC_VNNI_ONE_CODE) defines int4_vnni8_mm, so that a first build compiles the two row forms' template instances
// at once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int4_layers.h"
#include "int4_scratch.h"
#include "int4_team.h"
#include "int4_tiles.h"

// Two builds of the same arithmetic: AVX512-VNNI's VPDPBUSD (16 outputs' int32 sums of 4 byte products at once), or
// on AVX2 CPUs (AMD Zen 3, Intel Haswell on) VPMADDUBSW and VPMADDWD doing the same integer sums in two halves of 8
// outputs — every sum exact either way, the scales applied in the same float32 operations per output, so both builds
// give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HIERSPEC_VNNI 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HIERSPEC_VNNI 256
#endif

namespace {

using hierspec_tiles::check_scales;
using hierspec_tiles::checked_codes;
using hierspec_tiles::CodeLayout;
using hierspec_tiles::kBlock;
using hierspec_tiles::kStep;
using hierspec_tiles::TileShape;

// inputs per K-quant super-block, and steps per super-block
constexpr int64_t kSuper = 256;
constexpr int64_t kStepsPerSuper = kSuper / kStep;

// Checks factored scales (see Factored) for codes of `shape`: scale uint8 (4-bit codes) or int8 (8-bit) [1, N / 16,
// groups, 16], bias uint8 [N / 16, K / 32, 16] or empty, units float32 [2 or 1, N / 16, K / 256, 16].
void check_factors(const TileShape& shape, const at::Tensor& scale, const at::Tensor& bias, const at::Tensor& units) {
  const int64_t blocks = shape.blocks, groups = shape.groups;
  TORCH_CHECK(shape.steps % kStepsPerSuper == 0, "factored scales: K must be a multiple of 256");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == (shape.eight ? at::kChar : at::kByte) &&
                  scale.sizes() == at::IntArrayRef({1, blocks, groups, kBlock}),
              "factored scale: contiguous uint8 [1, N / 16, K / 32, 16] (4-bit codes) or int8 [1, N / 16, K / 16, 16] "
              "(8-bit)");
  TORCH_CHECK(shape.eight ? bias.numel() == 0
                          : (bias.is_contiguous() && bias.scalar_type() == at::kByte &&
                             bias.sizes() == at::IntArrayRef({blocks, groups, kBlock})),
              "factored bias: contiguous uint8 [N / 16, K / 32, 16] (4-bit codes) or empty (8-bit codes)");
  TORCH_CHECK(units.is_contiguous() && units.scalar_type() == at::kFloat &&
                  units.sizes() == at::IntArrayRef({shape.eight ? 1 : 2, blocks, shape.steps / kStepsPerSuper, kBlock}),
              "units: contiguous float32 [2, N / 16, K / 256, 16] (4-bit codes) or [1, N / 16, K / 256, 16] (8-bit)");
}

#ifdef HIERSPEC_VNNI
constexpr int kQuads = 8;         // a step's quads of 4 inputs
// An accumulator a row beside a step's 8 quads, its scales and a row's sums: AVX-512's 32 registers hold 16 rows'
// accumulators. 12 until the forty-ninth session, when 16 measured faster on an Intel Xeon (Qwen2.5-Coder-1.5B's
// products alternating with a 12-row build in one process, the same bits: 13 rows 0.91x the time, 16 rows 0.87x,
// 20 rows 0.95x, 32 rows 0.93x, 1-12 rows unchanged; SmolLM2's 16 rows 0.95x): a 13th row had cost a second pass
// over every block (~9 ms of the 1.5B's 74).
constexpr int kRowsPerPass = HIERSPEC_VNNI == 512 ? 16 : 8;
constexpr int64_t kGrain = 4;        // blocks of outputs a thread takes at least
constexpr int64_t kRoundGrain = 256;  // row steps a thread rounds at least (a step ~20 ns on a Zen 3)

// A row's step of 32 inputs as two 8-bit codes an input: x ~ e (128 high + low)
struct RowStep {
  float scale;          // e = d / 128
  float sum;            // the sum of 128 high + low over the 32 inputs
  int32_t low, high;    // -128 x that sum over inputs 0..15 and over 16..31
};

// A product's rows as codes [K / 32, rows, 2, 32] (a step's 32 high codes, then its 32 low ones) and their steps'
// scales [K / 32, rows]: step-major, so that a pass finds its rows' codes of one step at fixed offsets from one
// address (row-major, the addresses of 8 rows were recomputed for every step in registers the products need)
// where a row's step stands among `rows` rows stored step-major
inline int64_t step_major(int64_t row, int64_t step, int64_t rows) { return step * rows + row; }

struct Rows {
  const int8_t* codes;
  const RowStep* steps;
  int64_t rows;
  int64_t at(int64_t row, int64_t step) const { return step_major(row, step, rows); }
};

// A block's 16 outputs in kParts parts of kWidth lanes: one AVX-512 register, or two AVX2 ones of 8 outputs each. A
// step's part is multiplied by every row before the next part (AVX2 has 16 registers: a part's 8 quads stay in them).
#if HIERSPEC_VNNI == 512
using FV = __m512;   // a part's float32 lanes
using IV = __m512i;  // its int32 lanes, or its quads' bytes (kWidth outputs x 4 inputs)
constexpr int kParts = 1, kWidth = 16;
inline FV splat(float v) { return _mm512_set1_ps(v); }
inline FV zero_part() { return _mm512_setzero_ps(); }
inline FV mul(FV a, FV b) { return _mm512_mul_ps(a, b); }
inline FV fmadd(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FV as_float(IV v) { return _mm512_cvtepi32_ps(v); }
inline IV splat_int(int32_t v) { return _mm512_set1_epi32(v); }
inline IV high_plus_low(IV high, IV low) { return _mm512_add_epi32(_mm512_slli_epi32(high, 7), low); }
inline void store_part(float* p, FV v) { _mm512_storeu_ps(p, v); }
inline IV load_bytes(const uint8_t* src) { return _mm512_loadu_si512(src); }
inline IV low_nibbles(IV bytes) { return _mm512_and_si512(bytes, _mm512_set1_epi8(15)); }
inline IV high_nibbles(IV bytes) { return low_nibbles(_mm512_srli_epi16(bytes, 4)); }
inline IV either(IV a, IV b) { return _mm512_or_si512(a, b); }
inline IV bits_45(IV v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x30)); }
template <int N> inline IV shifted_left(IV v) { return _mm512_slli_epi16(v, N); }
template <int N> inline IV shifted_right(IV v) { return _mm512_srli_epi16(v, N); }
#else
using FV = __m256;
using IV = __m256i;
constexpr int kParts = 2, kWidth = 8;
inline FV splat(float v) { return _mm256_set1_ps(v); }
inline FV zero_part() { return _mm256_setzero_ps(); }
inline FV mul(FV a, FV b) { return _mm256_mul_ps(a, b); }
inline FV fmadd(FV a, FV b, FV c) { return _mm256_fmadd_ps(a, b, c); }
inline FV as_float(IV v) { return _mm256_cvtepi32_ps(v); }
inline IV splat_int(int32_t v) { return _mm256_set1_epi32(v); }
inline IV high_plus_low(IV high, IV low) { return _mm256_add_epi32(_mm256_slli_epi32(high, 7), low); }
inline void store_part(float* p, FV v) { _mm256_storeu_ps(p, v); }
inline IV load_bytes(const uint8_t* src) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)); }
inline IV low_nibbles(IV bytes) { return _mm256_and_si256(bytes, _mm256_set1_epi8(15)); }
inline IV high_nibbles(IV bytes) { return low_nibbles(_mm256_srli_epi16(bytes, 4)); }
inline IV either(IV a, IV b) { return _mm256_or_si256(a, b); }
inline IV bits_45(IV v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x30)); }
template <int N> inline IV shifted_left(IV v) { return _mm256_slli_epi16(v, N); }
template <int N> inline IV shifted_right(IV v) { return _mm256_srli_epi16(v, N); }
#endif
constexpr int64_t kQuadPartBytes = 4 * kWidth;  // a quad's bytes of one part

// A step of 32 inputs as its 32 high codes, then its 32 low ones (see rounded_rows), each within +-127, and its
// RowStep: the same float32 operations per input in both builds, so the same codes
#if HIERSPEC_VNNI == 512
// 16 inputs' codes within +-127: round(x times 1 / d)
inline __m512i clamped_codes(__m512 scaled) {
  const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
  return _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(scaled)));
}

// 16 inputs' high and low codes
inline void split(__m512 x, __m512 d, __m512 inverse, __m512i& high, __m512i& low) {
  high = clamped_codes(_mm512_mul_ps(x, inverse));
  const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(high), d, x);  // x - high d, rounded once
  low = clamped_codes(_mm512_mul_ps(rest, _mm512_mul_ps(inverse, _mm512_set1_ps(128.f))));
}

// a step's d = max |x| / 127 over its two halves
inline float step_scale(__m512 a, __m512 b) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.f;
}

inline RowStep round_step(const float* x, int8_t* out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float d = step_scale(a, b);
  const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m512i high_a, low_a, high_b, low_b;
  split(a, _mm512_set1_ps(d), inverse, high_a, low_a);
  split(b, _mm512_set1_ps(d), inverse, high_b, low_b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(high_a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(high_b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32), _mm512_cvtepi32_epi8(low_a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 48), _mm512_cvtepi32_epi8(low_b));
  const int32_t first = 128 * _mm512_reduce_add_epi32(high_a) + _mm512_reduce_add_epi32(low_a);
  const int32_t second = 128 * _mm512_reduce_add_epi32(high_b) + _mm512_reduce_add_epi32(low_b);
  return {d / 128.f, static_cast<float>(first + second), -128 * first, -128 * second};
}
#else
// 8 inputs' codes within +-127: round(x times 1 / d)
inline __m256i clamped_codes(__m256 scaled) {
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  return _mm256_max_epi32(bottom, _mm256_min_epi32(top, _mm256_cvtps_epi32(scaled)));
}

// 8 inputs' high and low codes, as the AVX-512 build's split computes them lane by lane
inline void split(__m256 x, __m256 d, __m256 inverse, __m256i& high, __m256i& low) {
  high = clamped_codes(_mm256_mul_ps(x, inverse));
  const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(high), d, x);
  low = clamped_codes(_mm256_mul_ps(rest, _mm256_mul_ps(inverse, _mm256_set1_ps(128.f))));
}

// A step's 32 inputs as four vectors, and its d = max |x| / 127 (a maximum is exact in any order: the AVX-512
// build's value)
struct StepInputs {
  __m256 v[4];
  float d;
};

inline StepInputs step_inputs(const float* x) {
  StepInputs in;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    in.v[i] = _mm256_loadu_ps(x + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, in.v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  in.d = _mm_cvtss_f32(m) / 127.f;
  return in;
}

// the sum of a vector's 8 int32 lanes
inline int32_t int_lane_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// 32 codes within +-127, as four vectors of int32 in input order, stored as 32 bytes in that order (the packs work
// within 128-bit lanes: their dwords come out as a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 c4-7 d4-7 and are put back in order)
inline void store_codes(int8_t* out, const __m256i (&codes)[4]) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                           _mm256_packs_epi32(codes[2], codes[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline RowStep round_step(const float* x, int8_t* out) {
  const StepInputs in = step_inputs(x);
  const __m256 d = _mm256_set1_ps(in.d), inverse = _mm256_set1_ps(in.d > 0.f ? 1.f / in.d : 0.f);
  __m256i high[4], low[4];
  for (int i = 0; i < 4; ++i) split(in.v[i], d, inverse, high[i], low[i]);
  store_codes(out, high);
  store_codes(out + 32, low);
  const int32_t first = 128 * int_lane_sum(_mm256_add_epi32(high[0], high[1])) +
                        int_lane_sum(_mm256_add_epi32(low[0], low[1]));
  const int32_t second = 128 * int_lane_sum(_mm256_add_epi32(high[2], high[3])) +
                         int_lane_sum(_mm256_add_epi32(low[2], low[3]));
  return {in.d / 128.f, static_cast<float>(first + second), -128 * first, -128 * second};
}
#endif

// The step as one 8-bit code an input — round_step's high codes, computed alone — and its RowStep for them:
// x ~ d high (round_step's scale d / 128 times 128 is d exactly)
#if HIERSPEC_VNNI == 512
inline RowStep round_step_one(const float* x, int8_t* out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float d = step_scale(a, b);
  const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i high_a = clamped_codes(_mm512_mul_ps(a, inverse)), high_b = clamped_codes(_mm512_mul_ps(b, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(high_a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(high_b));
  const int32_t first = _mm512_reduce_add_epi32(high_a), second = _mm512_reduce_add_epi32(high_b);
  return {d, static_cast<float>(first + second), -128 * first, -128 * second};
}
#else
inline RowStep round_step_one(const float* x, int8_t* out) {
  const StepInputs in = step_inputs(x);
  const __m256 inverse = _mm256_set1_ps(in.d > 0.f ? 1.f / in.d : 0.f);
  __m256i high[4];
  for (int i = 0; i < 4; ++i) high[i] = clamped_codes(_mm256_mul_ps(in.v[i], inverse));
  store_codes(out, high);
  const int32_t first = int_lane_sum(_mm256_add_epi32(high[0], high[1]));
  const int32_t second = int_lane_sum(_mm256_add_epi32(high[2], high[3]));
  return {in.d, static_cast<float>(first + second), -128 * first, -128 * second};
}
#endif

// x [rows, k] (k a multiple of 32) as two 8-bit codes an input, per step of 32 inputs: d = max |x| / 127,
// high = round(x / d), low = round((x - high d) 128 / d) (each rounded as the MXCSR rounds: to nearest, ties to even;
// x / d as x times 1 / d; |low| <= 64), so that x ~ d / 128 (128 high + low), within d / 256; or (Two false) as
// the high codes alone, x ~ d high within d / 2. Each step on its own, so the threads share them out; stored
// step-major (Rows).
template <bool Two>
void rounded_rows(const float* x, int64_t rows, int64_t k, std::vector<int8_t>& codes, std::vector<RowStep>& steps) {
  constexpr int64_t kCodes = Two ? 2 : 1;
  const int64_t per_row = k / kStep;
  codes.resize(static_cast<size_t>(kCodes * rows * k));
  steps.resize(static_cast<size_t>(rows * per_row));
  int8_t* code = codes.data();
  RowStep* step = steps.data();
  hierspec_team::parallel_for(0, rows * per_row, kRoundGrain, [&](int64_t begin, int64_t end) {
    int64_t row = begin / per_row, s = begin % per_row;  // input step i is row i / per_row's step i % per_row
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = step_major(row, s, rows);
      step[j] = Two ? round_step(x + kStep * i, code + 2 * kStep * j)
                    : round_step_one(x + kStep * i, code + kStep * j);
      if (++s == per_row) s = 0, ++row;
    }
  });
}

// kWidth scales (or biases, or their integer steps) as float32
#if HIERSPEC_VNNI == 512
inline FV widened(const float* values) { return _mm512_loadu_ps(values); }
inline FV widened(const uint16_t* values) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}
inline FV widened(const uint8_t* values) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values))));
}
inline FV widened(const int8_t* values) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values))));
}
#else
inline __m128i eight_bytes(const void* values) { return _mm_loadl_epi64(static_cast<const __m128i*>(values)); }
inline FV widened(const float* values) { return _mm256_loadu_ps(values); }
inline FV widened(const uint16_t* values) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
}
inline FV widened(const uint8_t* values) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes(values))); }
inline FV widened(const int8_t* values) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_bytes(values))); }
#endif

// Each step asks for the codes it will read kPrefetchBytes later and its scales' lines as many steps ahead, so memory
// is read while earlier steps are multiplied (the int4_amx.cpp idea; without it, products of a few rows took the
// time of their memory and their arithmetic one after the other). Prefetching past a tensor's end is harmless. Forced
// inline: gcc may otherwise find the helpers free of side effects and drop them.
//
// Weights read once (every row in one pass: a decoding step, a small tree) are fetched non-temporally on AMD CPUs
// (HIERSPEC_STREAM_NTA, int4_kernel.py's compile_flags), so that they evict less of what a decoding step keeps using
// from the outer caches (the KV cache, the activations, the drafter's and the interpreter's data between two
// forwards). Zen 3, SmolLM2, the decoding loop with the same cost curve on both sides (thirty-seventh session,
// BENCHMARKS.md): `ar`'s one-row forwards 6 % faster, `hd`'s 3 %. Weights that several passes of rows read again
// keep the default hint: fetched non-temporally, 8- and 16-row forwards took 15-25 % longer. On an Intel Xeon
// (Sapphire Rapids class, under KVM) the non-temporal hint stalled every step instead: one row's products of a
// Qwen2.5-0.5B layer took 1.6-3x as long as with the default hint (forty-fourth session), so other CPUs take that.
#ifdef HIERSPEC_STREAM_NTA
constexpr auto kOnceHint = _MM_HINT_NTA;
#else
constexpr auto kOnceHint = _MM_HINT_T0;
#endif
constexpr int64_t kPrefetchBytes = 2048;

__attribute__((always_inline)) inline void prefetch_lines(const void* start, int64_t bytes, bool once) {
  const char* ahead = static_cast<const char*>(start);
  for (int64_t line = 0; line < bytes; line += 64) {
    if (once) _mm_prefetch(ahead + line, kOnceHint);
    else _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// A product's codes: [1, blocks, steps, ...] of kStepBytes a step
struct Codes {
  const uint8_t* codes;
  int64_t steps, n;
};

// Scales and biases stored per group and output, S float (float32) or uint16_t (float16): the tile layout's
template <typename S>
struct Stored {
  const S* scale;
  const S* bias;  // nullptr for 8-bit codes
  int64_t groups;

  FV scale_at(int64_t block, int64_t group, int part) const {
    return widened(scale + (block * groups + group) * kBlock + part * kWidth);
  }
  FV bias_at(int64_t block, int64_t group, int part) const {
    return widened(bias + (block * groups + group) * kBlock + part * kWidth);
  }
  // the lines of `count` groups from `group` on, `ahead` groups later
  __attribute__((always_inline)) void prefetch(int64_t block, int64_t group, int64_t count, int64_t ahead,
                                               bool once) const {
    const int64_t at = (block * groups + group + ahead) * kBlock, bytes = count * kBlock * sizeof(S);
    prefetch_lines(scale + at, bytes, once);
    if (bias != nullptr) prefetch_lines(bias + at, bytes, once);
  }
};

// Scales and biases as K-quant files hold them: an integer step per group and output (Step uint8_t for Q4_K's
// 6-bit scales, int8_t for Q6_K's signed ones) times a float32 unit per output and super-block of 256 inputs; the
// biases (4-bit codes) a uint8 step times a unit the same way. Each product is exact in float32 (an 11-bit float16
// unit times a step of at most 8 bits): the weights are the file's.
template <typename Step>
struct Factored {
  const Step* scale;
  const uint8_t* bias;  // nullptr for 8-bit codes
  const float* units;   // [2 or 1, blocks, supers, 16]: the scales' units, then the biases'
  int64_t groups, blocks, supers, groups_per_super;

  FV unit(int64_t which, int64_t block, int64_t group, int part) const {
    return widened(units + ((which * blocks + block) * supers + group / groups_per_super) * kBlock + part * kWidth);
  }
  FV scale_at(int64_t block, int64_t group, int part) const {
    return mul(widened(scale + (block * groups + group) * kBlock + part * kWidth), unit(0, block, group, part));
  }
  FV bias_at(int64_t block, int64_t group, int part) const {
    return mul(widened(bias + (block * groups + group) * kBlock + part * kWidth), unit(1, block, group, part));
  }
  // the steps' lines of `count` groups from `group` on, `ahead` groups later (the units, 1/16 of the codes' bytes or
  // less, are left to the hardware's prefetcher)
  __attribute__((always_inline)) void prefetch(int64_t block, int64_t group, int64_t count, int64_t ahead,
                                               bool once) const {
    const int64_t at = (block * groups + group + ahead) * kBlock, bytes = count * kBlock;
    prefetch_lines(scale + at, bytes, once);
    if (bias != nullptr) prefetch_lines(bias + at, bytes, once);
  }
};

// a row's 4 codes of quad c
inline int32_t quad_of(const int8_t* codes, int c) {
  int32_t four;
  std::memcpy(&four, codes + 4 * c, sizeof four);
  return four;
}

#if HIERSPEC_VNNI == 512
// acc + each output's sum of its 4 bytes (unsigned) times the row's 4 codes
inline IV dot_quad(IV acc, IV weights, int32_t codes) {
  return _mm512_dpbusd_epi32(acc, weights, _mm512_set1_epi32(codes));
}
// the 4-bit form's sums over a step's 8 quads (every product below 2^11: VPDPBUSD is exact)
inline IV dot_step4(const IV quads[kQuads], const int8_t* codes) {
  IV even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains: a dot waits ~4 cycles for the last
  for (int c = 0; c < kQuads; c += 2) {
    even = dot_quad(even, quads[c], quad_of(codes, c));
    odd = dot_quad(odd, quads[c + 1], quad_of(codes, c + 1));
  }
  return _mm512_add_epi32(even, odd);
}
#else
// pairs of int16 sums widened to each output's int32 sum of 4
inline IV widened_pairs(IV pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
// the 4-bit form's sums over a step's 8 quads: VPMADDUBSW's int16 pair sums of codes 0..15 times row codes within
// +-127 stay below 2 * 15 * 127, so the 8 quads' (at most 30,480) are summed in int16 before one widening
inline IV dot_step4(const IV quads[kQuads], const int8_t* codes) {
  IV sum = _mm256_setzero_si256();
  for (int c = 0; c < kQuads; ++c)
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(quads[c], splat_int(quad_of(codes, c))));
  return widened_pairs(sum);
}
#endif

// The 4-bit form: step s of a block is scale group s.
template <class Source>
struct FourBit {
  static constexpr int64_t kStepBytes = 256;
  struct Quads {
    IV quad[kQuads];
  };
  struct Scales {
    FV scale, bias;
  };

  static Scales scales_of(const Source& source, int64_t block, int64_t s, int part) {
    return {source.scale_at(block, s, part), source.bias_at(block, s, part)};
  }
  __attribute__((always_inline)) static void prefetch(const Source& source, int64_t block, int64_t s, bool once) {
    source.prefetch(block, s, 1, kPrefetchBytes / kStepBytes, once);
  }

  // a part of a step's quads: quads c and c + 4 from chunk c's low and high nibbles
  static void decode(const uint8_t* src, int part, Quads& q) {
    for (int c = 0; c < 4; ++c) {
      const IV bytes = load_bytes(src + 64 * c + part * kQuadPartBytes);
      q.quad[c] = low_nibbles(bytes);
      q.quad[c + 4] = high_nibbles(bytes);
    }
  }

  // a row's integer sums of the step's part, then (finish) their scaled float32 added to its accumulator
  using Sums = IV;
  // AVX2: every row's sums of a step, then their scaling — the same operations in another order. A row's sums,
  // conversion and scaling form one long chain of dependent instructions; interleaved row by row, a Zen 3 held about
  // two rows' chains in flight (its products were bound by that, not by its multipliers); the rows' sums first give
  // it independent work side by side. Measured on a Zen 3 (thirty-fifth session), the same bits: a product whose
  // weights are in cache 15-20 % faster at 8 and 16 rows (one thread); SmolLM2's 30 layers' products, streamed on two
  // threads and interleaved in one process with the row-by-row order, 6-12 % at 16 rows, 0-11 % at 4 and 8, one row
  // unchanged within the noise. AVX-512 keeps the row-by-row order it was measured in (12 rows' sums would not fit
  // its registers beside the accumulators). Since the thirty-eighth session, rows as one code go through this pass
  // for one row only (block_rows_quads takes 2 or more); rows as two codes, at any count.
  static constexpr bool kSumsFirst = HIERSPEC_VNNI == 256;
  template <bool Two>
  static Sums sums(const Quads& q, const int8_t* codes, const RowStep&) {
    IV sums = dot_step4(q.quad, codes);
    if constexpr (Two) sums = high_plus_low(sums, dot_step4(q.quad, codes + kStep));
    return sums;
  }
  static FV finish(const Sums& sums, const RowStep& step, const Scales& w, FV acc) {
    const FV part = fmadd(w.bias, splat(step.sum), mul(as_float(sums), w.scale));
    return fmadd(part, splat(step.scale), acc);
  }
};

#if HIERSPEC_VNNI == 512
// The 8-bit form's codes as unsigned bytes code + 128 (VPDPBUSD's operand), the offset taken back by the row's sums
struct EightQuads {
  IV quad[kQuads];
};
inline void decode_quads(const uint8_t* src, int, EightQuads& q) {
  const IV offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < kQuads; ++c) q.quad[c] = _mm512_xor_si512(load_bytes(src + 64 * c), offset);
}
// each group's dot (quads 0..3, then 4..7) of the row's codes, added to `sums`: the 8-bit form's quads, or the 6-bit
// form's (SixQuads, below), both VPDPBUSD's unsigned operand
template <class Quads>
inline void group_dots(const Quads& q, const int8_t* codes, IV (&sums)[2]) {
  for (int c = 0; c < kQuads; ++c) sums[c / 4] = dot_quad(sums[c / 4], q.quad[c], quad_of(codes, c));
}
// the offsets' take-back the low codes' sums start from: -128 x the sum of 128 high + low over each group
inline void offset_sums(const EightQuads&, const RowStep& step, IV (&sums)[2]) {
  sums[0] = splat_int(step.low);
  sums[1] = splat_int(step.high);
}
#else
// The 8-bit form's signed codes as their magnitudes and the codes themselves (for their signs): VPMADDUBSW takes
// |code| (at most 128) times the row's code signed like the weight, each pair's sum within 2 * 128 * 127 < 2^15
struct EightQuads {
  IV magnitude[kQuads], sign[kQuads];
};
inline void decode_quads(const uint8_t* src, int part, EightQuads& q) {
  for (int c = 0; c < kQuads; ++c) {
    q.sign[c] = load_bytes(src + 64 * c + part * kQuadPartBytes);
    q.magnitude[c] = _mm256_abs_epi8(q.sign[c]);
  }
}
inline void group_dots(const EightQuads& q, const int8_t* codes, IV (&sums)[2]) {
  for (int c = 0; c < kQuads; ++c) {
    const IV row = _mm256_sign_epi8(splat_int(quad_of(codes, c)), q.sign[c]);
    sums[c / 4] = _mm256_add_epi32(sums[c / 4], widened_pairs(_mm256_maddubs_epi16(q.magnitude[c], row)));
  }
}
inline void offset_sums(const EightQuads&, const RowStep&, IV (&sums)[2]) { sums[0] = sums[1] = splat_int(0); }

#endif

// The 6-bit form: codes within -32..31 (a Q6_K weight's, or a Q5_0 one's -16..15) stored as u = code + 32 in 6 bits
// and scaled as the 8-bit form's (step s covers scale groups 2 s and 2 s + 1). A step's 6 chunks of 64 bytes: chunks 0..3 hold u's low 4 bits
// as the 4-bit form holds its codes (quad c in the low nibble of chunk c, quad c + 4 in the high one), chunk 4 + p
// the high 2 bits of quads p, p + 2, p + 4, p + 6 at bits 0, 2, 4, 6: 384 bytes a step against the 8-bit form's 512.
// u is unsigned as it is: VPDPBUSD's byte operand (AVX-512), or VPMADDUBSW's, times a row's code, each pair's sum
// within 2 * 63 * 127 so that two quads' fit int16 (AVX2, where the 8-bit form needs a sign product and a widening
// per quad). The offset is taken back as the AVX-512 build's 8-bit form takes back its 128: each group's sum starts
// from -32 x the row's sum over it, so that every integer sum equals the 8-bit form's and each (row, output) takes
// EightBit::finish's float32 operations: the same bits as the same codes in the 8-bit form, in either build.
struct SixQuads {
  IV quad[kQuads];
};

// the high 2 bits of quad q from its chunk's byte, in place (bits 4..5): 16-bit shifts move bits across bytes only
// below bit 4 of a byte, which the mask clears
inline IV high_bits(IV chunk, int q) {
  switch (q / 2) {
    case 0: return bits_45(shifted_left<4>(chunk));
    case 1: return bits_45(shifted_left<2>(chunk));
    case 2: return bits_45(chunk);
    default: return bits_45(shifted_right<2>(chunk));
  }
}

// quad c of a part of a step
inline IV six_quad(const uint8_t* step, int c, int part) {
  const IV bytes = load_bytes(step + 64 * (c % 4) + part * kQuadPartBytes);
  const IV high = load_bytes(step + 64 * (4 + c % 2) + part * kQuadPartBytes);
  return either(c < 4 ? low_nibbles(bytes) : high_nibbles(bytes), high_bits(high, c));
}

inline void decode_quads(const uint8_t* src, int part, SixQuads& q) {
  for (int c = 0; c < kQuads; ++c) q.quad[c] = six_quad(src, c, part);
}

#if HIERSPEC_VNNI == 256
// each group's dot (quads 0..3, then 4..7) of the row's codes, added to `sums` (AVX-512: the 8-bit form's
// group_dots): two quads' pair sums in int16, then widened
inline void group_dots(const SixQuads& q, const int8_t* codes, IV (&sums)[2]) {
  for (int c = 0; c < kQuads; c += 2) {
    const IV pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q.quad[c], splat_int(quad_of(codes, c))),
                                      _mm256_maddubs_epi16(q.quad[c + 1], splat_int(quad_of(codes, c + 1))));
    sums[c / 4] = _mm256_add_epi32(sums[c / 4], widened_pairs(pairs));
  }
}
#endif

// the offset's take-back each group's sum starts from: -32 x the row's sum over the group (RowStep holds -128 x it)
inline void offset_sums(const SixQuads&, const RowStep& step, IV (&sums)[2]) {
  sums[0] = splat_int(step.low / 4);
  sums[1] = splat_int(step.high / 4);
}

// The 8-bit form: step s of a block covers scale groups 2 s (quads 0..3) and 2 s + 1 (quads 4..7). With SixQuads and
// 384 bytes a step, the 6-bit form (SixBit): its own layout and decoding (the SixQuads overloads of decode_quads,
// group_dots and offset_sums), the 8-bit form's scales, sums and finish.
template <class Source, class Q = EightQuads, int64_t StepBytes = 512>
struct EightBit {
  static constexpr int64_t kStepBytes = StepBytes;
  using Quads = Q;
  struct Scales {
    FV low, high;
  };

  static Scales scales_of(const Source& source, int64_t block, int64_t s, int part) {
    return {source.scale_at(block, 2 * s, part), source.scale_at(block, 2 * s + 1, part)};
  }
  __attribute__((always_inline)) static void prefetch(const Source& source, int64_t block, int64_t s, bool once) {
    source.prefetch(block, 2 * s, 2, 2 * (kPrefetchBytes / kStepBytes), once);
  }

  static void decode(const uint8_t* src, int part, Quads& quads) { decode_quads(src, part, quads); }

  // a row's integer sums of each group of the step's part, then (finish) their scaled float32 added to its
  // accumulator
  struct Sums {
    IV group[2];
  };
  static constexpr bool kSumsFirst = false;  // two vectors a row: 8 rows' would not fit in AVX2's registers
  template <bool Two>
  static Sums sums(const Quads& quads, const int8_t* codes, const RowStep& step) {
    // each group's dot of the high codes, and of the low ones (the last dot starting from the offset's take-back)
    Sums high;
    if constexpr (Two) {
      IV low[2];
      high.group[0] = high.group[1] = splat_int(0);
      offset_sums(quads, step, low);
      group_dots(quads, codes, high.group);
      group_dots(quads, codes + kStep, low);
      high.group[0] = high_plus_low(high.group[0], low[0]);
      high.group[1] = high_plus_low(high.group[1], low[1]);
    } else {
      offset_sums(quads, step, high.group);
      group_dots(quads, codes, high.group);
    }
    return high;
  }
  static FV finish(const Sums& sums, const RowStep& step, const Scales& w, FV acc) {
    const FV first = as_float(sums.group[0]);
    const FV second = as_float(sums.group[1]);
    const FV part = fmadd(second, w.high, mul(first, w.low));
    return fmadd(part, splat(step.scale), acc);
  }
};

template <class Source>
using SixBit = EightBit<Source, SixQuads, 384>;

// A pass's accumulators (MT rows' outputs of a block, part by part) set to zero, each in a register: as a plain loop
// gcc made it a memset of the array on the stack, then loaded the registers from it (a library call per pass of
// rows: ~4 % of a 300-token prompt's reading)
template <int MT>
inline void zero_rows(FV (&acc)[MT][kParts]) {
  for (int m = 0; m < MT; ++m)
    for (int part = 0; part < kParts; ++part) {
      acc[m][part] = zero_part();
      asm("" : "+v"(acc[m][part]));
    }
}

// ... and stored as rows r0 .. r0 + MT of out [rows, N]
template <int MT>
inline void store_rows(const FV (&acc)[MT][kParts], const Codes& w, int64_t block, int64_t r0, float* out) {
  for (int m = 0; m < MT; ++m)
    for (int part = 0; part < kParts; ++part)
      store_part(out + (r0 + m) * w.n + block * kBlock + part * kWidth, acc[m][part]);
}

// step s of a block's codes, with the lines kPrefetchBytes ahead of it and its scales' asked for (prefetch_lines)
template <class Form, class Source>
__attribute__((always_inline)) inline const uint8_t* fetched_step(const Codes& w, const Source& source, int64_t block,
                                                                 int64_t s, bool once) {
  const uint8_t* step = w.codes + (block * w.steps + s) * Form::kStepBytes;
  prefetch_lines(step + kPrefetchBytes, Form::kStepBytes, once);
  Form::prefetch(source, block, s, once);
  return step;
}

// outputs of one block for rows r0 .. r0 + MT into out [rows, N]; `once`: the only pass over the block's weights
template <int MT, bool Two, class Form, class Source>
void block_rows(const Codes& w, const Source& source, const Rows& x, int64_t block, int64_t r0, bool once,
                float* out) {
  constexpr int64_t kCodes = Two ? 2 : 1;
  FV acc[MT][kParts];
  zero_rows(acc);
  for (int64_t s = 0; s < w.steps; ++s) {
    const uint8_t* step = fetched_step<Form>(w, source, block, s, once);
    for (int part = 0; part < kParts; ++part) {
      typename Form::Quads quads;
      Form::decode(step, part, quads);
      const auto scales = Form::scales_of(source, block, s, part);
      const int64_t first = x.at(r0, s);
      const int8_t* row_codes = x.codes + kCodes * kStep * first;
      const RowStep* row_steps = x.steps + first;
      if constexpr (Form::kSumsFirst) {
        typename Form::Sums sums[MT];
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m)
          sums[m] = Form::template sums<Two>(quads, row_codes + kCodes * kStep * m, row_steps[m]);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) acc[m][part] = Form::finish(sums[m], row_steps[m], scales, acc[m][part]);
      } else {
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          const auto sums = Form::template sums<Two>(quads, row_codes + kCodes * kStep * m, row_steps[m]);
          acc[m][part] = Form::finish(sums, row_steps[m], scales, acc[m][part]);
        }
      }
    }
  }
  store_rows(acc, w, block, r0, out);
}

#if HIERSPEC_VNNI == 256
// AVX2, 4-bit codes, rows as one code, 2 rows or more: a tile of MT rows whose int16 sums of both parts stay in
// registers (2 MT + the quad's two parts + a row's broadcast of AVX2's 16) while the step's quads go by one at a
// time, each row's quad broadcast once for both parts. block_rows keeps a part's 8 quads in registers instead and
// broadcasts every row's quad once a part; with 8 rows its sums and accumulators did not fit in the registers either.
// The integer sums are exact in any order and each (row, output) takes FourBit::finish's float32 operations: the same
// bits. Zen 3, SmolLM2's 30 layers' products on two threads, weights streamed, alternating with block_rows in one
// process (thirty-eighth session): 3-4 rows ~10 % faster, 5-8 rows 3-13 %, 12-64 rows 10-17 %; Q4_K-shaped products
// (Qwen2.5-Coder-1.5B's, factored scales) 10-22 % at 5-64 rows.
template <int MT, class Source>
void block_rows_quads(const Codes& w, const Source& source, const Rows& x, int64_t block, int64_t r0, bool once,
                      float* out) {
  using Form = FourBit<Source>;
  FV acc[MT][kParts];
  zero_rows(acc);
  for (int64_t s = 0; s < w.steps; ++s) {
    const uint8_t* step = fetched_step<Form>(w, source, block, s, once);
    const int64_t first = x.at(r0, s);
    const int8_t* row_codes = x.codes + kStep * first;
    const RowStep* row_steps = x.steps + first;
    IV sums[MT][kParts];
#pragma GCC unroll 8
    for (int c = 0; c < kQuads; ++c) {
      IV quad[kParts];  // quads c and c + 4 are chunk c's low and high nibbles (FourBit::decode)
      for (int part = 0; part < kParts; ++part) {
        const IV bytes = load_bytes(step + 64 * (c % 4) + part * kQuadPartBytes);
        quad[part] = c < 4 ? low_nibbles(bytes) : high_nibbles(bytes);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const IV row = splat_int(quad_of(row_codes + kStep * m, c));
        for (int part = 0; part < kParts; ++part) {
          const IV product = _mm256_maddubs_epi16(quad[part], row);
          sums[m][part] = c == 0 ? product : _mm256_add_epi16(sums[m][part], product);
        }
      }
      // gcc otherwise computes every product of the step first and spills them all to the stack
      for (int m = 0; m < MT; ++m)
        for (int part = 0; part < kParts; ++part) asm("" : "+x"(sums[m][part]));
    }
    for (int part = 0; part < kParts; ++part) {
      const auto scales = Form::scales_of(source, block, s, part);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
        acc[m][part] = Form::finish(widened_pairs(sums[m][part]), row_steps[m], scales, acc[m][part]);
    }
  }
  store_rows(acc, w, block, r0, out);
}

// AVX2, 6-bit codes, 2 to 4 rows: a tile of MT rows whose groups' int32 sums of both parts are kept together while
// the step's quads go by two at a time (both parts decoded once for all the tile's rows), each row's two quads
// broadcast once for both parts; block_rows decodes a part per pass and broadcasts every row's quads once a part.
// The integer sums are exact in any order and each (row, output) takes EightBit::finish's float32 operations: the
// same bits.
template <int MT, bool Two, class Source>
void block_rows_six(const Codes& w, const Source& source, const Rows& x, int64_t block, int64_t r0, bool once,
                    float* out) {
  using Form = SixBit<Source>;
  constexpr int64_t kCodes = Two ? 2 : 1;
  FV acc[MT][kParts];
  zero_rows(acc);
  for (int64_t s = 0; s < w.steps; ++s) {
    const uint8_t* step = fetched_step<Form>(w, source, block, s, once);
    const int64_t first = x.at(r0, s);
    const int8_t* row_codes = x.codes + kCodes * kStep * first;
    const RowStep* row_steps = x.steps + first;
    // [row][part][group], and with Two the low codes' beside the high ones'
    IV sums[MT][kParts][2], lows[Two ? MT : 1][kParts][2];
    for (int m = 0; m < MT; ++m) {
      IV offsets[2];
      offset_sums(SixQuads{}, row_steps[m], offsets);
      for (int part = 0; part < kParts; ++part)
        for (int g = 0; g < 2; ++g) {
          if constexpr (Two) {
            sums[m][part][g] = splat_int(0);
            lows[m][part][g] = offsets[g];
          } else {
            sums[m][part][g] = offsets[g];
          }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < kQuads; c += 2) {
      IV quads[2][kParts];
      for (int part = 0; part < kParts; ++part) {
        quads[0][part] = six_quad(step, c, part);
        quads[1][part] = six_quad(step, c + 1, part);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        for (int code = 0; code < kCodes; ++code) {
          const int8_t* row = row_codes + kCodes * kStep * m + code * kStep;
          const IV a = splat_int(quad_of(row, c)), b = splat_int(quad_of(row, c + 1));
          for (int part = 0; part < kParts; ++part) {
            const IV pairs = _mm256_add_epi16(_mm256_maddubs_epi16(quads[0][part], a),
                                              _mm256_maddubs_epi16(quads[1][part], b));
            IV& sum = (Two && code == 1) ? lows[Two ? m : 0][part][c / 4] : sums[m][part][c / 4];
            sum = _mm256_add_epi32(sum, widened_pairs(pairs));
          }
        }
      }
    }
    for (int part = 0; part < kParts; ++part) {
      const auto scales = Form::scales_of(source, block, s, part);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        typename Form::Sums total;
        for (int g = 0; g < 2; ++g)
          total.group[g] = Two ? high_plus_low(sums[m][part][g], lows[Two ? m : 0][part][g]) : sums[m][part][g];
        acc[m][part] = Form::finish(total, row_steps[m], scales, acc[m][part]);
      }
    }
  }
  store_rows(acc, w, block, r0, out);
}

// Rows of a 6-bit product taken by block_rows_six: kSixTilesFrom to kSixTilesTo rows, as one tile; more go to
// block_rows. Zen 3, two threads, alternating in one process (forty-eighth session): the 1.5B's Q6_K output head
// alone (151,936 x 1,536) in tiles against block_rows, 2 rows 0.76-0.85x the time, 3 rows 0.86x, 4 rows 0.82x; from
// 5 rows on, tiles of 4 were no faster (0.95-1.13x: the sums of 4 rows spill from the 16 registers either way).
constexpr int64_t kSixTilesFrom = 2, kSixTilesTo = 4;

template <bool Two, class Source>
void block_rows_six_tile(const Codes& w, const Source& source, const Rows& x, int64_t rows, int64_t block,
                         float* out) {
  switch (rows) {
    case 4: return block_rows_six<4, Two>(w, source, x, block, 0, true, out);
    case 3: return block_rows_six<3, Two>(w, source, x, block, 0, true, out);
    default: return block_rows_six<2, Two>(w, source, x, block, 0, true, out);
  }
}

// Rows of a 4-bit product (one code a row) taken by block_rows_quads: from kQuadsFrom rows on (one row measured the
// same either way, and its path is the one tuned for decoding). Up to kOneQuadTile rows make one tile; more, tiles of
// 3 or 4 rows as even as can be (a 1-row tail would repeat the step's decoding for one row; tiles of 4 measured faster
// than of 6 from 7 rows on, of 6 faster at 5 and 6). Two rows were left to block_rows until the forty-seventh session
// measured them on a Zen 3 with weights in cache (one layer's products, alternating in one process: 17-22 % faster
// on one thread, 8-18 % on two) and in SmolLM2's whole two-token forward (7 % faster, 21 of 24 rounds; one and three
// tokens unchanged).
constexpr int64_t kQuadsFrom = 2, kOneQuadTile = 6, kQuadTile = 4;
static_assert(kQuadsFrom == 2 && kQuadTile == 4, "every tile then holds 2 to 6 rows (the instances below)");

template <class Source>
void block_rows_in_quads(const Codes& w, const Source& source, const Rows& x, int64_t rows, int64_t block,
                         float* out) {
  const int64_t tiles = rows <= kOneQuadTile ? 1 : (rows + kQuadTile - 1) / kQuadTile;
  const bool once = tiles == 1;  // the only pass over the block's weights: fetched non-temporally, as in block_rows
  for (int64_t tile = 0, r0 = 0; tile < tiles; ++tile) {
    const int64_t count = (rows - r0) / (tiles - tile);  // the rows left shared out evenly, the larger tiles last
    switch (count) {
      case 6: block_rows_quads<6>(w, source, x, block, r0, once, out); break;
      case 5: block_rows_quads<5>(w, source, x, block, r0, once, out); break;
      case 4: block_rows_quads<4>(w, source, x, block, r0, once, out); break;
      case 3: block_rows_quads<3>(w, source, x, block, r0, once, out); break;
      default: block_rows_quads<2>(w, source, x, block, r0, once, out); break;
    }
    r0 += count;
  }
}
#endif

template <bool Two, class Form, class Source>
void block_all_rows(const Codes& w, const Source& source, const Rows& x, int64_t rows, int64_t block, float* out) {
#if HIERSPEC_VNNI == 256
  if constexpr (!Two && std::is_same_v<Form, FourBit<Source>>) {
    if (rows >= kQuadsFrom) return block_rows_in_quads(w, source, x, rows, block, out);
  }
  if constexpr (std::is_same_v<Form, SixBit<Source>>) {
    if (rows >= kSixTilesFrom && rows <= kSixTilesTo)
      return block_rows_six_tile<Two>(w, source, x, rows, block, out);
  }
#endif
  const bool once = rows <= kRowsPerPass;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    switch (std::min<int64_t>(kRowsPerPass, rows - r0)) {
      case 16: block_rows<16, Two, Form>(w, source, x, block, r0, once, out); break;
      case 15: block_rows<15, Two, Form>(w, source, x, block, r0, once, out); break;
      case 14: block_rows<14, Two, Form>(w, source, x, block, r0, once, out); break;
      case 13: block_rows<13, Two, Form>(w, source, x, block, r0, once, out); break;
      case 12: block_rows<12, Two, Form>(w, source, x, block, r0, once, out); break;
      case 11: block_rows<11, Two, Form>(w, source, x, block, r0, once, out); break;
      case 10: block_rows<10, Two, Form>(w, source, x, block, r0, once, out); break;
      case 9: block_rows<9, Two, Form>(w, source, x, block, r0, once, out); break;
      case 8: block_rows<8, Two, Form>(w, source, x, block, r0, once, out); break;
      case 7: block_rows<7, Two, Form>(w, source, x, block, r0, once, out); break;
      case 6: block_rows<6, Two, Form>(w, source, x, block, r0, once, out); break;
      case 5: block_rows<5, Two, Form>(w, source, x, block, r0, once, out); break;
      case 4: block_rows<4, Two, Form>(w, source, x, block, r0, once, out); break;
      case 3: block_rows<3, Two, Form>(w, source, x, block, r0, once, out); break;
      case 2: block_rows<2, Two, Form>(w, source, x, block, r0, once, out); break;
      default: block_rows<1, Two, Form>(w, source, x, block, r0, once, out); break;
    }
  }
}

// every block of the product, shared out between the threads
template <bool Two, class Source>
void all_blocks(const Codes& w, const Source& source, bool eight, bool six, int64_t blocks, const Rows& x,
                int64_t rows, float* out) {
  hierspec_team::parallel_for(0, blocks, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (six) block_all_rows<Two, SixBit<Source>>(w, source, x, rows, block, out);
      else if (eight) block_all_rows<Two, EightBit<Source>>(w, source, x, rows, block, out);
      else block_all_rows<Two, FourBit<Source>>(w, source, x, rows, block, out);
    }
  });
}

#endif  // HIERSPEC_VNNI

// x: float32 [M, K]; codes: uint8 [1, N / 16, K / 32, 4, 16, 4] (4-bit form) or int8 [1, N / 16, K / 32, 8, 16, 4]
// (8-bit form). Scales stored per group (units empty): scale float32 or float16 [1, N / 16, K / 32, 16] or
// [1, N / 16, K / 16, 16], bias the scale's dtype [N / 16, K / 32, 16] for the 4-bit form, empty for the 8-bit one;
// or factored (check_factors). Rows as two 8-bit codes an input (Two) or one. Returns float32 [M, N], in the
// tensor the layer stack's arena keeps for `role` (int4_scratch.h) or a new one.
template <bool Two>
at::Tensor integer_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           const at::Tensor& bias, const at::Tensor& units, hierspec_scratch::Role role) {
  TORCH_CHECK(vnni_ready(), "the integer (VNNI) products need AVX512-VNNI or AVX2 with FMA and F16C");
  const bool factored = units.numel() > 0;
  TileShape shape = checked_codes(x, codes, CodeLayout::kQuads);
  if (factored) check_factors(shape, scale, bias, units);
  else check_scales(shape, scale, bias);
  const int64_t rows = x.size(0), n = shape.blocks * kBlock;
  auto out = hierspec_scratch::tensor(role, {rows, n}, x.options());
  if (rows == 0) return out;
#ifdef HIERSPEC_VNNI
  thread_local std::vector<int8_t> row_codes;
  thread_local std::vector<RowStep> row_steps;
  rounded_rows<Two>(x.data_ptr<float>(), rows, x.size(1), row_codes, row_steps);
  const Rows inputs{row_codes.data(), row_steps.data(), rows};
  const Codes weights{static_cast<const uint8_t*>(codes.data_ptr()), shape.steps, n};
  float* results = out.data_ptr<float>();
  const auto run = [&](const auto& source) {
    all_blocks<Two>(weights, source, shape.eight, shape.six, shape.blocks, inputs, rows, results);
  };
  const int64_t supers = shape.steps / kStepsPerSuper, per_super = shape.groups / std::max<int64_t>(supers, 1);
  if (factored && shape.eight)
    run(Factored<int8_t>{scale.data_ptr<int8_t>(), nullptr, units.data_ptr<float>(), shape.groups, shape.blocks,
                         supers, per_super});
  else if (factored)
    run(Factored<uint8_t>{scale.data_ptr<uint8_t>(), bias.data_ptr<uint8_t>(), units.data_ptr<float>(), shape.groups,
                          shape.blocks, supers, per_super});
  else if (shape.half)
    run(Stored<uint16_t>{static_cast<const uint16_t*>(scale.data_ptr()),
                         shape.eight ? nullptr : static_cast<const uint16_t*>(bias.data_ptr()), shape.groups});
  else
    run(Stored<float>{scale.data_ptr<float>(), shape.eight ? nullptr : bias.data_ptr<float>(), shape.groups});
#endif
  return out;
}

}  // namespace

#ifndef HIERSPEC_VNNI_ONE_CODE
// The integer products' vector width in bits: 512 (AVX512-VNNI), 256 (AVX2) or 0 (none in this build).
int64_t vnni_width() {
#ifdef HIERSPEC_VNNI
  return HIERSPEC_VNNI;
#else
  return 0;
#endif
}

// Whether this build can run the integer products (compiled for a CPU with AVX512_VNNI and AVX512_BW, or with AVX2,
// FMA and F16C).
bool vnni_ready() { return vnni_width() > 0; }

// Each tensor of the stack holds its blocks of 16 outputs along its first or second dimension (codes, scales
// [1, N / 16, ...], biases [N / 16, ...], units [1 or 2, N / 16, ...]): the part of every outer slice from the
// helper's first block on (all_blocks' split, as hierspec_team::parallel_for makes it).
void warm_helper_share(const std::vector<at::Tensor>& stack) {
#ifdef HIERSPEC_VNNI
  if (stack.empty() || stack[0].dim() != 6) return;
  const int64_t blocks = stack[0].size(1), first = hierspec_team::helper_begin(0, blocks, kGrain);
  if (first >= blocks) return;
  for (const auto& t : stack) {
    if (!t.defined() || t.numel() == 0 || t.dim() < 2 || !t.is_contiguous()) continue;
    const int along = t.size(0) == blocks ? 0 : t.size(1) == blocks ? 1 : -1;
    if (along < 0) continue;
    const int64_t outer = along == 0 ? 1 : t.size(0), slice = static_cast<int64_t>(t.nbytes()) / outer;
    const int64_t skipped = first * (slice / blocks);  // the calling thread's blocks of each slice
    const char* data = static_cast<const char*>(t.data_ptr());
    for (int64_t o = 0; o < outer; ++o) hierspec_team::warm(data + o * slice + skipped, slice - skipped);
  }
#else
  (void)stack;
#endif
}

// The product with rows as two 8-bit codes an input (integer_product's arguments).
at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                        const at::Tensor& units, hierspec_scratch::Role role) {
  return integer_product<true>(x, codes, scale, bias, units, role);
}

at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                        const at::Tensor& units) {
  return int4_vnni_mm(x, codes, scale, bias, units, hierspec_scratch::kNone);
}
#else
// The product with rows as one 8-bit code an input.
at::Tensor int4_vnni8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                         const at::Tensor& units, hierspec_scratch::Role role) {
  return integer_product<false>(x, codes, scale, bias, units, role);
}

at::Tensor int4_vnni8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                         const at::Tensor& units) {
  return int4_vnni8_mm(x, codes, scale, bias, units, hierspec_scratch::kNone);
}
#endif  // HIERSPEC_VNNI_ONE_CODE
