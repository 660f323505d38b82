// The products of the compiled layers over a bfloat16 model's own weights for a tree's or a batch's rows (the
// `dots` dense kernel, dense_kernel.py), by AVX512-BF16 dot products (VDPBF16PS), and the products that read its
// prompts.
//
// oneDNN's prepacked bfloat16 products cost ~15 us a call on a Zen 4 whatever the weight's size, and SmolLM2's small
// weights (576 x 576) stream at ~20 GB/s: its 121 products took 13.2 ms of a 16.6 ms one-token step, where its 269
// MB of weights need ~8.5 ms at 31.5 GB/s (BENCHMARKS.md, fifty-sixth session). Here the weights are packed in
// blocks of 16 outputs, [N / 16, K / 2, 16, 2]: a block's 16 outputs at inputs 2p and 2p + 1 are one vector, so each
// thread reads its contiguous range of blocks as sequential streams, 4 blocks at a time (4 independent chains of dot
// products even for one row), and no lane sum is needed.
//
// Each (row, output) result is one fixed sequence: the row rounded to bfloat16 (nearest even, as PyTorch's
// conversion), then one float32 lane accumulating two products per input pair, in input order — the same whatever
// the number of rows, how they are grouped into passes or how the blocks are split between threads, so a row's
// result does not depend on the rows beside it (tests/test_dense_layers.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_tiles.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HIERSPEC_DENSE_BF16 1

using hierspec_tiles::rounded_rows;

constexpr int64_t kBlock = 16;    // outputs of a block: one float32 vector
constexpr int kBlocksPerPass = 4;  // blocks multiplied together: 4 independent chains even for one row
constexpr int kRowsPerPass = 6;    // 24 accumulators of the 32 vector registers

struct Dots {
  const int32_t* w;  // [n / 16, k / 2, 16] pairs of bfloat16: block b's outputs at inputs 2p, 2p + 1
  const int32_t* x;  // [rows, k / 2] pairs of bfloat16
  float* out;        // [rows, n]
  int64_t rows, n, pairs;
};

// blocks b .. b + BT for rows r0 .. r0 + MT
template <int BT, int MT>
void blocks_rows(const Dots& d, int64_t b, int64_t r0) {
  __m512 acc[MT][BT];
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < BT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int32_t* w = d.w + b * d.pairs * kBlock;
  const int32_t* x = d.x + r0 * d.pairs;
  for (int64_t p = 0; p < d.pairs; ++p) {
    __m512bh weights[BT];
    for (int t = 0; t < BT; ++t) weights[t] = (__m512bh)_mm512_loadu_si512(w + (t * d.pairs + p) * kBlock);
    for (int m = 0; m < MT; ++m) {
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(x[m * d.pairs + p]);
      for (int t = 0; t < BT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], weights[t], inputs);
    }
  }
  float* out = d.out + r0 * d.n + b * kBlock;
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < BT; ++t) _mm512_storeu_ps(out + m * d.n + t * kBlock, acc[m][t]);
}

template <int BT>
void blocks_all_rows(const Dots& d, int64_t b) {
  for (int64_t r0 = 0; r0 < d.rows; r0 += kRowsPerPass) {
    switch (std::min<int64_t>(kRowsPerPass, d.rows - r0)) {
      case 6: blocks_rows<BT, 6>(d, b, r0); break;
      case 5: blocks_rows<BT, 5>(d, b, r0); break;
      case 4: blocks_rows<BT, 4>(d, b, r0); break;
      case 3: blocks_rows<BT, 3>(d, b, r0); break;
      case 2: blocks_rows<BT, 2>(d, b, r0); break;
      default: blocks_rows<BT, 1>(d, b, r0); break;
    }
  }
}

void blocks_range(const Dots& d, int64_t begin, int64_t end) {
  int64_t b = begin;
  for (; b + kBlocksPerPass <= end; b += kBlocksPerPass) blocks_all_rows<kBlocksPerPass>(d, b);
  switch (end - b) {
    case 3: blocks_all_rows<3>(d, b); break;
    case 2: blocks_all_rows<2>(d, b); break;
    case 1: blocks_all_rows<1>(d, b); break;
    default: break;
  }
}

#endif

}  // namespace

bool dense_bf16_ready() {
#ifdef HIERSPEC_DENSE_BF16
  return true;
#else
  return false;
#endif
}

// rows: float32 [M, K]; weight: bfloat16 [N / 16, K / 2, 16, 2] (dense_bf16.py's packing; N a multiple of 16, K of
// 32). Returns float32 [M, N].
at::Tensor dense_bf16_mm(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(dense_bf16_ready(), "the AVX512-BF16 dense products are not available in this build");
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == 2 &&
                  rows.size(1) == 2 * weight.size(1) && rows.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && rows.size(1) % 32 == 0,
              "dense_bf16_mm: float32 [rows, K] times a bfloat16 weight packed [N / 16, K / 2, 16, 2]");
  const int64_t m = rows.size(0), blocks = weight.size(0), n = blocks * 16;
  auto out = at::empty({m, n}, rows.options());
  if (m == 0 || n == 0) return out;
#ifdef HIERSPEC_DENSE_BF16
  thread_local std::vector<uint16_t> inputs;
  const auto x = rows.contiguous();
  rounded_rows(x.data_ptr<float>(), x.numel(), inputs);
  const Dots d{reinterpret_cast<const int32_t*>(weight.data_ptr<at::BFloat16>()),
               reinterpret_cast<const int32_t*>(inputs.data()), out.data_ptr<float>(), m, n, weight.size(1)};
  // each thread's blocks one contiguous range: its weights sequential streams
  at::parallel_for(0, blocks, kBlocksPerPass, [&](int64_t begin, int64_t end) { blocks_range(d, begin, end); });
#endif
  return out;
}

// A prompt's rows (float32 [M, K]) times the members' own bfloat16 weights ([N_i, K], as the model holds them), the
// products side by side in float32: the `dots` kernel's prompt products, oneDNN's through ATen's public linear (a
// prompt's many rows are compute-bound, where the dot products above would take ~7x as long).
at::Tensor dense_members_mm(const at::Tensor& rows, const std::vector<at::Tensor>& members) {
  TORCH_CHECK(!members.empty() && rows.dim() == 2, "dense_members_mm: [rows, K] times members [N_i, K]");
  const auto inputs = rows.to(members[0].scalar_type());
  if (members.size() == 1) return at::linear(inputs, members[0]).to(at::kFloat);
  std::vector<at::Tensor> parts;
  for (const auto& member : members) parts.push_back(at::linear(inputs, member));
  return at::cat(parts, -1).to(at::kFloat);
}
