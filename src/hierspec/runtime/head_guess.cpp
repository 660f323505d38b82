// The draft head's guess (hierspec/datastore/draft_head.py, HeadStore.guess) in one call: its three products on the
// int4 path's kernels, the element-wise steps between them, then each row's k best shortlist entries with their
// softmax probabilities.
//
// From Python the same guess was ~0.45 ms a decoding step on SmolLM2 (an Intel Xeon), of which the products' own work
// ~0.2: the rest was the calls' dispatch and NumPy's temporaries, each slowed by caches a forward had just emptied.
//
//   inner = silu(up [h ; e] + b1);  z = h + down inner + b2;  z = g z / sqrt(mean z^2 + eps);  logits = S z
//
// Each row is computed by itself (the products are row-invariant), so a batch of guesses gives each row what it
// would alone.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::exp_vector;
using hierspec_int4::kLanes;
using hierspec_int4::lane_sum;
using hierspec_int4::load;
using hierspec_int4::vf;

// sum of exp(row[i] - peak) over a row whose entries are all <= peak
float exp_sum(const float* row, int64_t count, float peak) {
  vf part{};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) part += exp_vector(load(row + i) - peak);
  float total = lane_sum(part);
  for (; i < count; ++i) total += std::exp(row[i] - peak);
  return total;
}

// the k largest entries' positions of a row, largest first, equal values in position order (k <= count)
void top_positions(const float* row, int64_t count, int64_t k, int64_t* positions) {
  std::vector<float> best(k, -INFINITY);
  for (int64_t i = 0; i < k; ++i) positions[i] = -1;
  for (int64_t i = 0; i < count; ++i) {
    if (!(row[i] > best[k - 1]) && positions[k - 1] >= 0) continue;
    int64_t p = k - 1;
    while (p > 0 && (positions[p - 1] < 0 || best[p - 1] < row[i])) {
      best[p] = best[p - 1];
      positions[p] = positions[p - 1];
      --p;
    }
    best[p] = row[i];
    positions[p] = i;
  }
}

}  // namespace

// hidden, embedded: float32 [rows, h]; up, down, shortlist: projections as the layer calls take them (outputs padded
// to the kernels' blocks: the first `width`, h and `size` are the head's); gain float32 [h]. Returns int64 [rows, k]
// shortlist positions, largest logit first, and float32 [rows, k] their softmax probabilities over the shortlist.
std::tuple<at::Tensor, at::Tensor> head_guess(const at::Tensor& hidden, const at::Tensor& embedded,
                                              const std::vector<std::vector<at::Tensor>>& up,
                                              const c10::optional<at::Tensor>& up_bias, int64_t width,
                                              const std::vector<std::vector<at::Tensor>>& down,
                                              const c10::optional<at::Tensor>& down_bias, const at::Tensor& gain,
                                              double eps, const std::vector<std::vector<at::Tensor>>& shortlist,
                                              int64_t size, int64_t k) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && embedded.sizes() == hidden.sizes() &&
                  embedded.scalar_type() == at::kFloat,
              "hidden, embedded: float32 [rows, h] alike");
  const int64_t rows = hidden.size(0), h = hidden.size(1);
  TORCH_CHECK(gain.dim() == 1 && gain.size(0) == h && gain.scalar_type() == at::kFloat && gain.is_contiguous(),
              "gain: contiguous float32 [h]");
  TORCH_CHECK(k >= 1 && k <= size, "k must be in 1..size");
  const auto state_in = hidden.contiguous();
  auto inner = project_stacks(at::cat({state_in, embedded.contiguous()}, 1), up, up_bias);
  TORCH_CHECK(inner.size(1) >= width, "up: fewer outputs than the head's width");
  inner = inner.narrow(1, 0, width).contiguous();
  inner = silu_product(inner, at::ones_like(inner));  // the layers' SiLU (int4_blocks.cpp), times 1 exactly
  auto state = project_stacks(inner, down, down_bias);
  TORCH_CHECK(state.size(1) >= h, "down: fewer outputs than the hidden size");
  state = state.narrow(1, 0, h).add(state_in).contiguous();
  const auto logits = project_stacks(rms_norm(state, gain, eps), shortlist, c10::nullopt).contiguous();
  TORCH_CHECK(logits.size(1) >= size, "shortlist: fewer outputs than its size");
  auto positions = at::empty({rows, k}, hidden.options().dtype(at::kLong));
  auto probabilities = at::empty({rows, k}, hidden.options());
  const int64_t stride = logits.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data_ptr<float>() + r * stride;
    int64_t* top = positions.data_ptr<int64_t>() + r * k;
    top_positions(row, size, k, top);
    const float peak = row[top[0]];
    const float total = exp_sum(row, size, peak);
    for (int64_t i = 0; i < k; ++i) probabilities.data_ptr<float>()[r * k + i] = std::exp(row[top[i]] - peak) / total;
  }
  return {positions, probabilities};
}
