// The int4 decoder's layer halves around attention, each one call from Python (see int4_kernel.py).
//
// A layer of the int4 path is ~40 small tensor operations besides its four weight products; called from Python each
// costs its interpreter and dispatch overhead (a SmolLM2 one-token step: ~5 ms of ~11 outside the products, on an
// Intel Xeon with AMX). Here the same ATen operations run in the same order from C++ — the products through the
// same kernels, the rotation and residual sums as the Python decoder writes them — so the results are the Python
// decoder's bit for bit (tests/test_int4_kernel.py); the RMS norm is rms_norm below on both paths.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                      const torch::Tensor& bias);
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale);
torch::Tensor int4_amx_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& bias);

namespace {

using hierspec_int4::kLanes;
using hierspec_int4::lane_sum;
using hierspec_int4::load;
using hierspec_int4::vf;

// One stack of a projection, its kernel told by its codes: the AMX products {4-D codes, scales, bias}, the compiled
// 8-bit product {int8 codes, scales}, the compiled 4-bit one {uint8 codes [P, N, K / 2], scales, bias}, or PyTorch's
// kernel {packed [N, K / 2], table} per pass.
torch::Tensor stack_product(const torch::Tensor& rows, const std::vector<torch::Tensor>& stack) {
  if (stack[0].dim() == 4) return int4_amx_mm(rows.contiguous(), stack[0], stack[1], stack[2]);
  if (stack[0].scalar_type() == torch::kInt8) return int8_mm(rows.contiguous(), stack[0], stack[1]);
  if (stack[0].dim() == 3) return int4_mm(rows.contiguous(), stack[0], stack[1], stack[2]);
  const auto inputs = rows.to(torch::kBFloat16).contiguous();
  auto product = at::_weight_int4pack_mm_for_cpu(inputs, stack[0], 32, stack[1]).to(torch::kFloat32);
  for (size_t i = 2; i < stack.size(); i += 2)
    product += at::_weight_int4pack_mm_for_cpu(inputs, stack[i], 32, stack[i + 1]);
  return product;
}

// A projection: its stacks side by side, plus the float32 bias where it has one (an undefined tensor otherwise).
torch::Tensor project(const torch::Tensor& rows, const std::vector<std::vector<torch::Tensor>>& stacks,
                      const c10::optional<torch::Tensor>& bias) {
  auto product = stacks.size() == 1 ? stack_product(rows, stacks[0]) : [&] {
    std::vector<torch::Tensor> parts;
    for (const auto& stack : stacks) parts.push_back(stack_product(rows, stack));
    return torch::cat(parts, -1);
  }();
  if (bias.has_value()) product = product + *bias;
  return product;
}

}  // namespace

// weight * hidden / sqrt(mean(hidden^2) + eps) per row of a contiguous float32 [rows, width]: the sum of squares in
// vector lanes, in an order fixed by the width alone (a row's result does not depend on the rows beside it).
torch::Tensor rms_norm(const torch::Tensor& hidden, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32, "hidden: float32 [rows, width]");
  const auto rows = hidden.contiguous();
  const int64_t count = rows.size(0), width = rows.size(1);
  auto out = torch::empty_like(rows);
  const float* x = rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    const float* xr = x + r * width;
    vf part{};
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) part = load(xr + i) * load(xr + i) + part;
    float total = lane_sum(part);
    for (; i < width; ++i) total = xr[i] * xr[i] + total;
    const float scale = 1.f / std::sqrt(total / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t j = 0; j < width; ++j) o[r * width + j] = w[j] * (xr[j] * scale);
  }
  return out;
}

// Rotated queries and keys and the values [1, heads, rows, dim] of hidden [rows, hidden] (the decoder's
// _attention_inputs after its input norm).
std::vector<torch::Tensor> attention_inputs(const torch::Tensor& hidden, const torch::Tensor& norm_weight, double eps,
                                            const std::vector<std::vector<torch::Tensor>>& qkv,
                                            const c10::optional<torch::Tensor>& bias, const torch::Tensor& cos,
                                            const torch::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                                            int64_t dim) {
  const int64_t rows = hidden.size(0);
  const auto product = project(rms_norm(hidden, norm_weight, eps), qkv, bias);
  const auto states = product.view({1, rows, heads + 2 * kv_heads, dim}).transpose(1, 2);
  const auto rotating = states.narrow(1, 0, heads + kv_heads);
  const auto rotated = (rotating * cos) + (rotating.roll(dim / 2, -1) * signed_sin);
  return {rotated.narrow(1, 0, heads), rotated.narrow(1, heads, kv_heads),
          states.narrow(1, heads + kv_heads, kv_heads)};
}

// The attention's output projection and residual, then the MLP block and its residual (the decoder's _mlp).
torch::Tensor mlp_block(const torch::Tensor& hidden, const torch::Tensor& attended, const torch::Tensor& norm_weight,
                        double eps, const std::vector<std::vector<torch::Tensor>>& out,
                        const std::vector<std::vector<torch::Tensor>>& gate_up,
                        const std::vector<std::vector<torch::Tensor>>& down, int64_t intermediate) {
  const c10::optional<torch::Tensor> none;
  const auto residual = hidden + project(attended, out, none);
  const auto both = project(rms_norm(residual, norm_weight, eps), gate_up, none);
  const auto act = at::silu(both.narrow(1, 0, intermediate)) * both.narrow(1, intermediate, intermediate);
  return residual + project(act, down, none);
}
