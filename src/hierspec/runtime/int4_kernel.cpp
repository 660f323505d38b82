// hierspec's int4 product for the few rows of a verification forward (see int4_kernel.py for why and how it is built).
//
// A weight [N, K] is P passes of 4-bit codes in groups of 32 inputs; pass p's element is code * scale[p] and the
// passes' offsets are folded into one bias per group, so that
//     out[m, n] = sum_g sum_p scale[p, n, g] * (sum_j code[p, n, 32g + j] * x[m, 32g + j])
//               + sum_g bias[n, g] * xsum[m, g]
// with xsum[m, g] the sum of row m's 32 inputs of group g. Group g's 16 code bytes hold element j in the low nibble
// and element j + 16 in the high nibble (GGUF's Q4_0/Q4_1 order), so both halves decode with one AND or shift.
//
// Batch invariance: every (m, n) result is one fixed sequence of vector operations (gcc vector extensions, one per
// source expression; 16 lanes with AVX-512, else 8), whatever the number of rows, how rows and outputs are tiled, or
// how the outputs are split between threads. A row's products are therefore bit-identical alone, in a chain or
// anywhere in a tree. Needs AVX2 at least: elsewhere the build fails and the int4 path keeps PyTorch's kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::kLanes;
using hierspec_int4::lane_sum;
using hierspec_int4::load;
using hierspec_int4::vf;
using hierspec_int4::vi;

constexpr int64_t kGroup = 32;
constexpr int kChunks = 16 / kLanes;  // vectors per half group
constexpr int64_t kGrain = 64;        // outputs per parallel task at least

// bytes widened to int32 lanes first (vpmovzxbd: gcc scalarises the generic conversion in some contexts): masks,
// shifts and the float conversion then run on 32-bit lanes, native on AVX2 and AVX-512 alike
inline vi widen(const uint8_t* bytes) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
#else
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
#endif
}

inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }

struct Weight {
  const uint8_t* codes;  // [P, N, K / 2]
  const float* scale;    // [P, N, K / 32]
  const float* bias;     // [N, K / 32]
  int64_t passes, n, k;
};

inline float dot_groups(const float* a, const float* b, int64_t groups) {
  vf part{};
  int64_t g = 0;
  for (; g + kLanes <= groups; g += kLanes) part = load(a + g) * load(b + g) + part;
  float tail = 0.f;
  for (; g < groups; ++g) tail = a[g] * b[g] + tail;
  return lane_sum(part) + tail;
}

// MT rows x NB outputs: each group's codes decoded once and used by every row of the tile
template <int MT, int NB>
void tile(const Weight& w, const float* x, const float* xsum, float* out, int64_t n0) {
  const int64_t groups = w.k / kGroup, plane = w.n * (w.k / 2), scales = w.n * groups;
  vf acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t p = 0; p < w.passes; ++p) {
      vf lo[NB][kChunks], hi[NB][kChunks];
      float s[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* bytes = w.codes + p * plane + (n0 + j) * (w.k / 2) + g * 16;
        for (int c = 0; c < kChunks; ++c) {
          const vi b = widen(bytes + c * kLanes);
          lo[j][c] = to_float(b & 15);
          hi[j][c] = to_float(b >> 4);
        }
        s[j] = w.scale[p * scales + (n0 + j) * groups + g];
      }
      for (int m = 0; m < MT; ++m) {
        const float* xg = x + m * w.k + g * kGroup;
        vf xl[kChunks], xh[kChunks];
        for (int c = 0; c < kChunks; ++c) {
          xl[c] = load(xg + c * kLanes);
          xh[c] = load(xg + 16 + c * kLanes);
        }
        for (int j = 0; j < NB; ++j) {
          vf t = lo[j][0] * xl[0];
          t = hi[j][0] * xh[0] + t;
          for (int c = 1; c < kChunks; ++c) {
            t = lo[j][c] * xl[c] + t;
            t = hi[j][c] * xh[c] + t;
          }
          acc[m][j] = s[j] * t + acc[m][j];
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j)
      out[m * w.n + n0 + j] = lane_sum(acc[m][j]) + dot_groups(w.bias + (n0 + j) * groups, xsum + m * groups, groups);
}

// 8-bit weights (Q8_0, Q6_K): signed codes with one scale per 16 inputs, out[m, n] = sum_g scale[n, g] *
// sum_j code[n, 16g + j] * x[m, 16g + j]; the same tiling and the same invariance as the 4-bit product.
constexpr int64_t kGroup8 = 16;

inline vi widen_signed(const int8_t* bytes) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
#endif
}

struct Weight8 {
  const int8_t* codes;  // [N, K]
  const float* scale;   // [N, K / 16]
  int64_t n, k;
};

template <int MT, int NB>
void tile8(const Weight8& w, const float* x, float* out, int64_t n0) {
  const int64_t groups = w.k / kGroup8;
  vf acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    vf code[NB][kChunks];
    float s[NB];
    for (int j = 0; j < NB; ++j) {
      const int8_t* bytes = w.codes + (n0 + j) * w.k + g * kGroup8;
      for (int c = 0; c < kChunks; ++c) code[j][c] = to_float(widen_signed(bytes + c * kLanes));
      s[j] = w.scale[(n0 + j) * groups + g];
    }
    for (int m = 0; m < MT; ++m) {
      vf xs[kChunks];
      for (int c = 0; c < kChunks; ++c) xs[c] = load(x + m * w.k + g * kGroup8 + c * kLanes);
      for (int j = 0; j < NB; ++j) {
        vf t = code[j][0] * xs[0];
        for (int c = 1; c < kChunks; ++c) t = code[j][c] * xs[c] + t;
        acc[m][j] = s[j] * t + acc[m][j];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) out[m * w.n + n0 + j] = lane_sum(acc[m][j]);
}

// A product's operands from some row on: a 4-bit weight with its rows' group sums, or an 8-bit weight.
struct Rows4 {
  const Weight& w;
  const float* x;
  const float* xsum;
  float* out;
  Rows4 from(int64_t m) const { return {w, x + m * w.k, xsum + m * (w.k / kGroup), out + m * w.n}; }
  template <int MT, int NB>
  void tile_at(int64_t n0) const { tile<MT, NB>(w, x, xsum, out, n0); }
};

struct Rows8 {
  const Weight8& w;
  const float* x;
  float* out;
  Rows8 from(int64_t m) const { return {w, x + m * w.k, out + m * w.n}; }
  template <int MT, int NB>
  void tile_at(int64_t n0) const { tile8<MT, NB>(w, x, out, n0); }
};

template <int MT, class Rows>
void outputs(const Rows& rows, int64_t begin, int64_t end) {
  // MT x NB accumulators, the decoded codes and the inputs fit the vector registers (32 with AVX-512, else 16)
  constexpr int NB = kLanes == 16 ? (MT <= 2 ? 4 : 2) : (MT <= 2 ? 2 : 1);
  int64_t n = begin;
  for (; n + NB <= end; n += NB) rows.template tile_at<MT, NB>(n);
  for (; n < end; ++n) rows.template tile_at<MT, 1>(n);
}

// outputs begin..end of every row, the rows four at a time and the rest as one tile
template <class Rows>
void rows_of_outputs(const Rows& rows, int64_t count, int64_t begin, int64_t end) {
  int64_t m = 0;
  for (; m + 4 <= count; m += 4) outputs<4>(rows.from(m), begin, end);
  switch (count - m) {
    case 3: outputs<3>(rows.from(m), begin, end); break;
    case 2: outputs<2>(rows.from(m), begin, end); break;
    case 1: outputs<1>(rows.from(m), begin, end); break;
    default: break;
  }
}

}  // namespace

// x: float32 [M, K]; codes: uint8 [P, N, K / 2]; scale: float32 [P, N, K / 32]; bias: float32 [N, K / 32].
// Returns float32 [M, N].
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: contiguous uint8 [P, N, K / 2]");
  const int64_t rows = x.size(0), k = x.size(1), passes = codes.size(0), n = codes.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.size(2) * 2 == k, "K must be a multiple of 32 and match the codes");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  scale.sizes() == at::IntArrayRef({passes, n, groups}),
              "scale: contiguous float32 [P, N, K / 32]");
  TORCH_CHECK(bias.is_contiguous() && bias.scalar_type() == at::kFloat && bias.sizes() == at::IntArrayRef({n, groups}),
              "bias: contiguous float32 [N, K / 32]");
  auto xsum = at::empty({rows, groups}, x.options());
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = xsum.data_ptr<float>();
  for (int64_t i = 0; i < rows * groups; ++i) {
    vf part = load(xp + i * kGroup);
    for (int c = 1; c < kGroup / kLanes; ++c) part = part + load(xp + i * kGroup + c * kLanes);
    sp[i] = lane_sum(part);
  }
  const Weight w{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), bias.data_ptr<float>(), passes, n, k};
  float* op = out.data_ptr<float>();
  const Rows4 operands{w, xp, sp, op};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { rows_of_outputs(operands, rows, begin, end); });
  return out;
}

// x: float32 [M, K]; codes: int8 [N, K]; scale: float32 [N, K / 16]. Returns float32 [M, N].
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == x.size(1) && x.size(1) % kGroup8 == 0,
              "codes: contiguous int8 [N, K], K a multiple of 16");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(
      scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.sizes() == at::IntArrayRef({n, k / kGroup8}),
      "scale: contiguous float32 [N, K / 16]");
  auto out = at::empty({rows, n}, x.options());
  const Weight8 w{codes.data_ptr<int8_t>(), scale.data_ptr<float>(), n, k};
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Rows8 operands{w, xp, op};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { rows_of_outputs(operands, rows, begin, end); });
  return out;
}
