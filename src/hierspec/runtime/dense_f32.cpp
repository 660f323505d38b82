// The products of the compiled layers over a float32 model's own weights for a tree's or a batch's rows (the `dots`
// dense kernel, dense_kernel.py), by fused multiply-adds on the CPU's vectors (AVX-512, or AVX2 on a Zen 3).
//
// As dense_bf16.cpp for bfloat16 weights: the weights packed in blocks of 16 outputs, [N / 16, K, 16] (a block's 16
// outputs at input i side by side), each thread streaming its contiguous range of blocks several at a time, rows
// kept in registers a few at a time. Each (row, output) result is one float32 lane's sequence of fused multiply-adds
// in input order — the same whatever the number of rows, how they are grouped into passes or how the blocks are
// split between threads (tests/test_dense_layers.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::kLanes;
using hierspec_int4::load;
using hierspec_int4::vf;

constexpr int64_t kBlock = 16;               // outputs of a block
constexpr int kVectors = kBlock / kLanes;    // vectors of a block's outputs: 1 with AVX-512, 2 with AVX2
#ifdef __AVX512F__
constexpr int kBlocksPerPass = 4, kRowsPerPass = 6;  // 24 accumulators of the 32 vector registers
#else
constexpr int kBlocksPerPass = 2, kRowsPerPass = 2;  // 8 accumulators and 4 weights of the 16
#endif

struct Products {
  const float* w;  // [n / 16, k, 16]
  const float* x;  // [rows, k]
  float* out;      // [rows, n]
  int64_t rows, n, k;
};

// blocks b .. b + BT for rows r0 .. r0 + MT
template <int BT, int MT>
void blocks_rows(const Products& d, int64_t b, int64_t r0) {
  vf acc[MT][BT][kVectors] = {};
  const float* w = d.w + b * d.k * kBlock;
  const float* x = d.x + r0 * d.k;
  for (int64_t i = 0; i < d.k; ++i) {
    vf weights[BT][kVectors];
    for (int t = 0; t < BT; ++t)
      for (int v = 0; v < kVectors; ++v) weights[t][v] = load(w + (t * d.k + i) * kBlock + v * kLanes);
    for (int m = 0; m < MT; ++m) {
      const vf input = vf{} + x[m * d.k + i];
      for (int t = 0; t < BT; ++t)
        for (int v = 0; v < kVectors; ++v) acc[m][t][v] += weights[t][v] * input;
    }
  }
  float* out = d.out + r0 * d.n + b * kBlock;
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < BT; ++t)
      for (int v = 0; v < kVectors; ++v)
        std::memcpy(out + m * d.n + t * kBlock + v * kLanes, &acc[m][t][v], sizeof(vf));
}

template <int BT>
void blocks_all_rows(const Products& d, int64_t b) {
  for (int64_t r0 = 0; r0 < d.rows; r0 += kRowsPerPass) {
    const int64_t left = std::min<int64_t>(kRowsPerPass, d.rows - r0);
    if constexpr (kRowsPerPass == 6) {
      switch (left) {
        case 6: blocks_rows<BT, 6>(d, b, r0); continue;
        case 5: blocks_rows<BT, 5>(d, b, r0); continue;
        case 4: blocks_rows<BT, 4>(d, b, r0); continue;
        case 3: blocks_rows<BT, 3>(d, b, r0); continue;
        default: break;
      }
    }
    if (left >= 2) {
      blocks_rows<BT, 2>(d, b, r0);
    } else {
      blocks_rows<BT, 1>(d, b, r0);
    }
  }
}

void blocks_range(const Products& d, int64_t begin, int64_t end) {
  int64_t b = begin;
  for (; b + kBlocksPerPass <= end; b += kBlocksPerPass) blocks_all_rows<kBlocksPerPass>(d, b);
  for (; b < end; ++b) blocks_all_rows<1>(d, b);
}

}  // namespace

// rows: float32 [M, K]; weight: float32 [N / 16, K, 16] (dense_kernel.py's packing). Returns float32 [M, N].
at::Tensor dense_f32_mm(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 3 && weight.size(2) == kBlock && rows.size(1) == weight.size(1) &&
                  rows.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "dense_f32_mm: float32 [rows, K] times a float32 weight packed [N / 16, K, 16]");
  const int64_t m = rows.size(0), blocks = weight.size(0);
  auto out = at::empty({m, blocks * kBlock}, rows.options());
  if (m == 0 || blocks == 0) return out;
  const auto x = rows.contiguous();
  const Products d{weight.data_ptr<float>(), x.data_ptr<float>(), out.data_ptr<float>(), m, blocks * kBlock,
                   weight.size(1)};
  // each thread's blocks one contiguous range: its weights sequential streams
  at::parallel_for(0, blocks, kBlocksPerPass, [&](int64_t begin, int64_t end) { blocks_range(d, begin, end); });
  return out;
}
