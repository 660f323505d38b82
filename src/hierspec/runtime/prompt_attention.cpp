// A prompt's causal attention on an empty cache (decoder._prompt_attention), float32, in place of PyTorch's CPU flash
// kernel for head sizes that are a multiple of the vector width.
//
// PyTorch's flash kernel computed SmolLM2's 64-wide heads at 17-27 GFLOP/s a thread for prompts of 78-300 tokens and
// ~39 GFLOP/s at 800 (2-core Zen 4): a third of a 769-token prompt's reading, ~8 % of `hd`'s time on 65 dev
// questions; this kernel takes 0.45-0.61x its time from 78 to 800 tokens (~70 GFLOP/s a thread at 800). Each task is
// a block of kRowBlock query rows of one query head: the rows' scores against every key up to the block's last row
// (keys transposed once per call, so 16 keys are scored side by side with one multiply-add per query element), an
// exact softmax over each row's own keys (j <= i), then the weighted values. Each row's result depends only on its own
// query, keys and values (its loops run over its own key range in a fixed order; weights past its own keys are zero),
// so a prompt's rows do not depend on its length or on the block a row falls in.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::exp_vector;
using hierspec_int4::fmadd;
using hierspec_int4::kLanes;
using hierspec_int4::lane_sum;
using hierspec_int4::load;
using hierspec_int4::vf;

constexpr int64_t kRowBlock = 24;  // query rows a task holds the scores of
constexpr int kRowTile = 6;        // rows scored / weighted together (their keys' vectors loaded once)
#ifdef __AVX512F__
constexpr int kParts = 4;  // vectors of keys (or of a value row) a tile's rows share: 24 accumulators of 32 registers
#else
constexpr int kParts = 2;  // 12 accumulators of AVX2's 16 registers
#endif

struct Prompt {
  const float* q;  // [heads, rows, dim] by strides
  int64_t q_head, q_row;
  const float* kt;  // keys transposed, [kv_heads, dim, padded]
  const float* v;   // [kv_heads, rows, dim] by strides
  int64_t v_head, v_row;
  int64_t rows, padded, dim, heads, group;
  float scale;
  float* out;  // [rows, heads * dim]
};

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// scores[t][j .. j + P kLanes) = scale * q_(r0 + t) . k_j: P vectors of keys, each query element broadcast once for
// them (P a constant, so that the T x P accumulators stay in registers)
template <int T, int P>
inline void score_span(const Prompt& p, const float* kt, const float* const (&q)[T], int64_t j, float* scores,
                       int64_t stride) {
  vf acc[T][P] = {};
  for (int64_t d = 0; d < p.dim; ++d) {
    vf k[P];
    for (int c = 0; c < P; ++c) k[c] = load(kt + d * p.padded + j + c * kLanes);
    for (int t = 0; t < T; ++t) {
      const vf x = vf{} + q[t][d];
      for (int c = 0; c < P; ++c) acc[t][c] = fmadd(x, k[c], acc[t][c]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < P; ++c) store(scores + t * stride + j + c * kLanes, acc[t][c] * p.scale);
}

// the scores of rows r0 .. r0 + T against keys 0 .. keys (a multiple of kLanes: the transposed keys are padded)
template <int T>
void score_tile(const Prompt& p, int64_t head, int64_t r0, int64_t keys, float* scores, int64_t stride) {
  const float* kt = p.kt + (head / p.group) * p.dim * p.padded;
  const float* q[T];
  for (int t = 0; t < T; ++t) q[t] = p.q + head * p.q_head + (r0 + t) * p.q_row;
  int64_t j = 0;
  for (; j + kParts * kLanes <= keys; j += kParts * kLanes) score_span<T, kParts>(p, kt, q, j, scores, stride);
  for (; j < keys; j += kLanes) score_span<T, 1>(p, kt, q, j, scores, stride);
}

// row r's scores over keys 0..r turned into exp(s - max), the rest of the padded range zero; returns their sum
float softmax_row(float* s, int64_t r, int64_t keys) {
  const int64_t count = r + 1;
  vf high = vf{} - INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const vf x = load(s + j);
    high = x > high ? x : high;
  }
  float peak = -INFINITY;
  for (int i = 0; i < kLanes; ++i) peak = std::max(peak, high[i]);
  for (; j < count; ++j) peak = std::max(peak, s[j]);
  vf sum{};
  j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const vf e = exp_vector(load(s + j) - peak);
    store(s + j, e);
    sum += e;
  }
  float total = lane_sum(sum);
  for (; j < count; ++j) {
    s[j] = std::exp(s[j] - peak);
    total += s[j];
  }
  std::fill(s + count, s + keys, 0.f);
  return total;
}

// out rows r0 .. r0 + T of `head`, outputs d0 .. d0 + P kLanes: the rows' weights times the values, divided by each
// row's sum (P a constant: the T x P accumulators stay in registers)
template <int T, int P>
inline void weigh_span(const Prompt& p, const float* v, int64_t head, int64_t r0, int64_t d0, int64_t keys,
                       const float* weights, int64_t stride, const float* sums) {
  vf acc[T][P] = {};
  for (int64_t j = 0; j < keys; ++j) {
    const float* row = v + j * p.v_row + d0;
    vf value[P];
    for (int c = 0; c < P; ++c) value[c] = load(row + c * kLanes);
    for (int t = 0; t < T; ++t) {
      const vf w = vf{} + weights[t * stride + j];
      for (int c = 0; c < P; ++c) acc[t][c] = fmadd(w, value[c], acc[t][c]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float* o = p.out + (r0 + t) * p.heads * p.dim + head * p.dim + d0;
    for (int c = 0; c < P; ++c) store(o + c * kLanes, acc[t][c] / sums[t]);
  }
}

template <int T>
void weigh_tile(const Prompt& p, int64_t head, int64_t r0, int64_t keys, const float* weights, int64_t stride,
                const float* sums) {
  const float* v = p.v + (head / p.group) * p.v_head;
  int64_t d0 = 0;
  for (; d0 + kParts * kLanes <= p.dim; d0 += kParts * kLanes)
    weigh_span<T, kParts>(p, v, head, r0, d0, keys, weights, stride, sums);
  for (; d0 < p.dim; d0 += kLanes) weigh_span<T, 1>(p, v, head, r0, d0, keys, weights, stride, sums);
}

// rows [r0, r1) of one query head
void attend_block(const Prompt& p, int64_t head, int64_t r0, int64_t r1, std::vector<float>& scores) {
  const int64_t stride = (r1 + kLanes - 1) / kLanes * kLanes;  // every row of the block scores keys < r1
  scores.resize(kRowBlock * stride);
  float sums[kRowBlock];
  for (int64_t r = r0; r < r1; r += kRowTile) {
    float* s = scores.data() + (r - r0) * stride;
    switch (std::min<int64_t>(kRowTile, r1 - r)) {
      case 6: score_tile<6>(p, head, r, stride, s, stride); break;
      case 5: score_tile<5>(p, head, r, stride, s, stride); break;
      case 4: score_tile<4>(p, head, r, stride, s, stride); break;
      case 3: score_tile<3>(p, head, r, stride, s, stride); break;
      case 2: score_tile<2>(p, head, r, stride, s, stride); break;
      default: score_tile<1>(p, head, r, stride, s, stride); break;
    }
  }
  for (int64_t r = r0; r < r1; ++r) sums[r - r0] = softmax_row(scores.data() + (r - r0) * stride, r, stride);
  for (int64_t r = r0; r < r1; r += kRowTile) {
    const float* w = scores.data() + (r - r0) * stride;
    // a tile's rows weigh keys up to its last row (the weights beyond each row's own are zero)
    const int64_t keys = std::min<int64_t>(r + kRowTile, r1);
    switch (keys - r) {
      case 6: weigh_tile<6>(p, head, r, keys, w, stride, sums + (r - r0)); break;
      case 5: weigh_tile<5>(p, head, r, keys, w, stride, sums + (r - r0)); break;
      case 4: weigh_tile<4>(p, head, r, keys, w, stride, sums + (r - r0)); break;
      case 3: weigh_tile<3>(p, head, r, keys, w, stride, sums + (r - r0)); break;
      case 2: weigh_tile<2>(p, head, r, keys, w, stride, sums + (r - r0)); break;
      default: weigh_tile<1>(p, head, r, keys, w, stride, sums + (r - r0)); break;
    }
  }
}

}  // namespace

bool prompt_attention_fits(int64_t dim) { return dim > 0 && dim % kLanes == 0; }

// query float32 [1, heads, rows, dim], keys and values float32 [1, kv_heads, rows, dim] (any strides with a unit
// innermost one); heads a multiple of kv_heads, dim a multiple of the vector width (prompt_attention_fits). Returns
// float32 [rows, heads * dim]: each row's softmax(scale q k^T) v over keys 0..row.
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && query.size(0) == 1 &&
                  keys.sizes() == values.sizes() && keys.size(0) == 1 && keys.size(2) == query.size(2) &&
                  keys.size(3) == query.size(3),
              "query [1, heads, rows, dim], keys and values [1, kv_heads, rows, dim]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "float32 queries, keys and values");
  TORCH_CHECK(query.stride(3) == 1 && values.stride(3) == 1, "unit innermost strides");
  const int64_t heads = query.size(1), kv_heads = keys.size(1), rows = query.size(2), dim = query.size(3);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(prompt_attention_fits(dim), "head size must be a multiple of ", kLanes);
  auto out = at::empty({rows, heads * dim}, query.options());
  if (rows == 0) return out;
  const int64_t padded = (rows + kLanes - 1) / kLanes * kLanes;
  // keys transposed [kv_heads, dim, padded], each row's padding zero (written once: no fill of the whole buffer first)
  const auto kt = at::empty({kv_heads * dim, padded}, keys.options());
  const float* k = keys.data_ptr<float>();
  const int64_t k_head = keys.stride(1), k_row = keys.stride(2), k_dim = keys.stride(3);
  at::parallel_for(0, kv_heads * dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t gd = begin; gd < end; ++gd) {
      const float* from = k + (gd / dim) * k_head + (gd % dim) * k_dim;
      float* to = kt.data_ptr<float>() + gd * padded;
      for (int64_t j = 0; j < rows; ++j) to[j] = from[j * k_row];
      std::fill(to + rows, to + padded, 0.f);
    }
  });
  const Prompt p{query.data_ptr<float>(), query.stride(1), query.stride(2), kt.data_ptr<float>(),
                 values.data_ptr<float>(), values.stride(1), values.stride(2), rows, padded, dim, heads, heads / kv_heads,
                 static_cast<float>(scale), out.data_ptr<float>()};
  // tasks (block, head) ordered so that each half of the list holds as much causal work as the other: blocks from
  // both ends in turn (block b and blocks - 1 - b together attend a constant number of keys)
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  std::vector<int64_t> order;
  for (int64_t low = 0, high = blocks - 1; low <= high; ++low, --high) {
    order.push_back(low);
    if (high != low) order.push_back(high);
  }
  at::parallel_for(0, blocks * heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = order[task / heads], head = task % heads;
      attend_block(p, head, block * kRowBlock, std::min(rows, (block + 1) * kRowBlock), scores);
    }
  });
  return out;
}
