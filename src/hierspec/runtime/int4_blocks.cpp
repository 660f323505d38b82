// The int4 decoder's layer halves around attention, each one call from Python (see int4_kernel.py).
//
// A layer of the int4 path is ~40 small tensor operations besides its four weight products; called from Python each
// costs its interpreter and dispatch overhead (a SmolLM2 one-token step: ~5 ms of ~11 outside the products, on an
// Intel Xeon with AMX). Here they run from C++ in the Python decoder's order — the products through the same
// kernels, the residual sums as ATen operations, the rotation as one loop rounding as PyTorch's element-wise
// operations do, the RMS norm (rms_norm) and the MLP activation (silu_product) compiled on both paths — so the
// results are the Python decoder's bit for bit (tests/test_quantized.py). The rotation and activation loops replaced
// ~10 ATen calls a layer (BENCHMARKS.md, "Eighteenth session").
//
// The prompt glue (prompt_norm, prompt_qkv, prompt_add_norm, prompt_activation): the same loops between the products
// of the int4 path's expanded prompt decoder, whose products (oneDNN's, bfloat16 on CPUs that compute it) stay in
// Python: each replaces a run of PyTorch operations of a layer (~25 calls a layer in all, each a dispatch and a pass
// over the rows) by one call (BENCHMARKS.md, "Fifty-third session").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_team.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::exp_vector;
using hierspec_int4::kLanes;
using hierspec_int4::lane_sum;
using hierspec_int4::load;
using hierspec_int4::vf;

// One stack of a projection, its kernel told by its codes: the integer (VNNI) products {6-D codes, scales, bias,
// units} (rows as two 8-bit codes an input; with a fifth, empty tensor: as one), the AVX512-BF16 products {5-D
// codes, scales, bias}, the AMX products {4-D codes, scales, bias}, the compiled 8-bit product {int8 codes, scales},
// the compiled 4-bit one {uint8 codes [P, N, K / 2], scales, bias}, or PyTorch's kernel {packed [N, K / 2], table}
// per pass; or a dense weight prepacked by oneDNN {weight} or {weight, rows a call}, a bfloat16 or float32
// weight packed for the dots kernel {weight} or a prompt's members' own weights {w_1, ...} (a model loaded from float
// weights).
at::Tensor stack_product(const at::Tensor& rows, const std::vector<at::Tensor>& stack,
                         hierspec_scratch::Role role = hierspec_scratch::kNone) {
  if (stack[0].is_mkldnn()) return dense_mm(rows, stack[0], stack.size() > 1 ? stack[1].item<int64_t>() : 0);
  if (stack[0].scalar_type() == at::kBFloat16 || stack[0].scalar_type() == at::kFloat) {
    // the dots kernel's packed weight (bfloat16 4-D, float32 3-D), or its prompts' members' own weights (2-D)
    if (stack[0].dim() == 4) return dense_bf16_mm(rows.contiguous(), stack[0]);
    if (stack[0].dim() == 3) return dense_f32_mm(rows.contiguous(), stack[0]);
    return dense_members_mm(rows, stack);
  }
  if (stack[0].dim() == 6)
    return stack.size() == 5 ? int4_vnni8_mm(rows.contiguous(), stack[0], stack[1], stack[2], stack[3], role)
                             : int4_vnni_mm(rows.contiguous(), stack[0], stack[1], stack[2], stack[3], role);
  if (stack[0].dim() == 5) return int4_bf16_mm(rows.contiguous(), stack[0], stack[1], stack[2]);
  if (stack[0].dim() == 4) return int4_amx_mm(rows.contiguous(), stack[0], stack[1], stack[2]);
  if (stack[0].scalar_type() == at::kChar) return int8_mm(rows.contiguous(), stack[0], stack[1]);
  if (stack[0].dim() == 3) return int4_mm(rows.contiguous(), stack[0], stack[1], stack[2]);
  const auto inputs = rows.to(at::kBFloat16).contiguous();
  auto product = at::_weight_int4pack_mm_for_cpu(inputs, stack[0], 32, stack[1]).to(at::kFloat);
  for (size_t i = 2; i < stack.size(); i += 2)
    product += at::_weight_int4pack_mm_for_cpu(inputs, stack[i], 32, stack[i + 1]);
  return product;
}

// A projection: its stacks side by side, plus the float32 bias where it has one (an undefined tensor otherwise); a
// single stack's product in `role`'s tensor (int4_scratch.h; several stacks' parts are joined into a new one).
at::Tensor project(const at::Tensor& rows, const std::vector<std::vector<at::Tensor>>& stacks,
                   const c10::optional<at::Tensor>& bias, hierspec_scratch::Role role = hierspec_scratch::kNone) {
  auto product = stacks.size() == 1 ? stack_product(rows, stacks[0], role) : [&] {
    std::vector<at::Tensor> parts;
    for (const auto& stack : stacks) parts.push_back(stack_product(rows, stack));
    return at::cat(parts, -1);
  }();
  if (bias.has_value()) product = product.add(*bias);
  return product;
}

// The rotated queries and keys and the values, each contiguous [1, heads, rows, dim], of the q/k/v product
// [rows, (heads + 2 kv_heads) dim]: x cos + roll(x, dim / 2) signed_sin per element, the two products and their sum
// each rounded (as PyTorch's element-wise operations compute it, and the Python decoder with them).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// out[d] = in[d] cos[d] + in[d + shift] sin[d] for d in [from, to): whole vectors, then one element at a time (each
// element's two products and sum rounded alike either way)
inline void rotate_half(const float* __restrict in, const float* __restrict cos, const float* __restrict sin,
                        int64_t from, int64_t to, int64_t shift, float* __restrict out) {
  int64_t d = from;
  for (; d + kLanes <= to; d += kLanes) {
    const vf a = load(in + d) * load(cos + d), b = load(in + d + shift) * load(sin + d);
    const vf sum = a + b;
    std::memcpy(out + d, &sum, sizeof sum);
  }
  for (; d < to; ++d) {
    const float a = in[d] * cos[d], b = in[d + shift] * sin[d];
    out[d] = a + b;
  }
}

std::vector<at::Tensor> rotate_heads(const at::Tensor& product, const at::Tensor& cos, const at::Tensor& signed_sin,
                                     int64_t heads, int64_t kv_heads, int64_t dim) {
  using namespace hierspec_scratch;
  const int64_t rows = product.size(0), width = (heads + 2 * kv_heads) * dim, half = dim / 2;
  TORCH_CHECK(product.is_contiguous() && product.size(1) == width && dim % 2 == 0, "q/k/v product: [rows, width]");
  const auto c = cos.reshape({rows, dim}).contiguous(), s = signed_sin.reshape({rows, dim}).contiguous();
  auto query = tensor(kQuery, {1, heads, rows, dim}, product.options());
  auto key = tensor(kKey, {1, kv_heads, rows, dim}, product.options());
  auto value = tensor(kValue, {1, kv_heads, rows, dim}, product.options());
  const float* x = product.data_ptr<float>();
  const float* cos_rows = c.data_ptr<float>();
  const float* sin_rows = s.data_ptr<float>();
  float* const outs[3] = {query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>()};
  const int64_t firsts[3] = {0, heads, heads + kv_heads};  // the product's first head of each
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = cos_rows + r * dim;
    const float* sr = sin_rows + r * dim;
    for (int64_t h = 0; h < heads + 2 * kv_heads; ++h) {
      const float* in = x + r * width + h * dim;
      const int which = h < heads ? 0 : h < heads + kv_heads ? 1 : 2;
      float* out = outs[which] + ((h - firsts[which]) * rows + r) * dim;
      if (which == 2) {
        std::memcpy(out, in, dim * sizeof(float));
        continue;
      }
      rotate_half(in, cr, sr, 0, half, half, out);    // x[d] cos[d] + x[d + half] sin[d]
      rotate_half(in, cr, sr, half, dim, -half, out);  // x[d] cos[d] + x[d - half] sin[d]
    }
  }
  return {query, key, value};
}
#pragma GCC pop_options

// elements of an element-wise call from which its rows are shared between threads (fewer: waking them costs more)
constexpr int64_t kParallelElements = 8192;

// silu(gate) * up of one element per lane: silu(g) = g sigmoid(g) with
// e = exp(-|g|), sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below; each element by itself, so a row's result
// does not depend on the rows beside it.
inline vf silu_times(vf g, vf u) {
  const vf e = exp_vector(g < vf{} ? g : -g);
  const vf sigmoid = (g < vf{} ? e : vf{} + 1.f) / (e + 1.f);
  return g * sigmoid * u;
}

// sum + other, written into `sum` (a product's own output) and returned: each element's one float32 addition, the
// same bits as ATen's `other + sum` (addition commutes exactly) without its dispatch and a new tensor — two a layer
// (BENCHMARKS.md, "Thirty-third session"). Other layouts go through ATen.
at::Tensor add_into(at::Tensor sum, const at::Tensor& other) {
  if (!(sum.is_contiguous() && other.is_contiguous() && sum.sizes() == other.sizes() &&
        sum.scalar_type() == at::kFloat && other.scalar_type() == at::kFloat))
    return other.add(sum);
  float* s = sum.data_ptr<float>();
  const float* o = other.data_ptr<float>();
  const int64_t count = sum.numel();
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const vf v = load(o + i) + load(s + i);
    std::memcpy(s + i, &v, sizeof v);
  }
  for (; i < count; ++i) s[i] = o[i] + s[i];
  return sum;
}

// silu(g) * u of one row of `width` elements (silu_times per lane)
inline void silu_row(const float* g, const float* u, int64_t width, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const vf v = silu_times(load(g + i), load(u + i));
    std::memcpy(out + i, &v, sizeof v);
  }
  if (i < width) {  // the tail through one zero-padded vector: the same operations per element
    vf gt{}, ut{};
    std::memcpy(&gt, g + i, (width - i) * sizeof(float));
    std::memcpy(&ut, u + i, (width - i) * sizeof(float));
    const vf v = silu_times(gt, ut);
    std::memcpy(out + i, &v, (width - i) * sizeof(float));
  }
}

// bfloat16 values (their bits) widened to float32, exactly
inline void widen_bf16(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

// float32 values narrowed to bfloat16 bits, rounded to nearest even as PyTorch's conversion rounds (a NaN stays one)
inline void narrow_bf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

// Rows of a float32 or bfloat16 [rows, width] tensor (rows contiguous), read as float32 or written from it
struct RowsOf {
  float* f = nullptr;
  uint16_t* b = nullptr;
  int64_t stride = 0;

  explicit RowsOf(const at::Tensor& t) : stride(t.stride(0)) {
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "float32 or bfloat16 [rows, width] with contiguous rows");
    if (t.scalar_type() == at::kFloat) f = static_cast<float*>(t.data_ptr());
    else b = static_cast<uint16_t*>(t.data_ptr());
  }
  // row r's first n elements as float32 into out
  void read(int64_t r, int64_t n, float* out) const {
    if (f != nullptr) std::memcpy(out, f + r * stride, n * sizeof(float));
    else widen_bf16(b + r * stride, n, out);
  }
  // row r's first n elements from float32
  void write(int64_t r, const float* in, int64_t n) const {
    if (f != nullptr) std::memcpy(f + r * stride, in, n * sizeof(float));
    else narrow_bf16(in, n, b + r * stride);
  }
};

// rows of a prompt's element-wise work a thread takes at least (a row is a few hundred to a few thousand elements)
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(width, 1)); }

// weight * hidden / sqrt(mean(hidden^2) + eps) of one row of `width` floats: the sum of squares in vector lanes, in an
// order fixed by the width alone (a row's result does not depend on the rows beside it).
inline void norm_row(const float* xr, const float* w, float eps, int64_t width, float* out) {
  vf part{};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) part = load(xr + i) * load(xr + i) + part;
  float total = lane_sum(part);
  for (; i < width; ++i) total = xr[i] * xr[i] + total;
  const float scale = 1.f / std::sqrt(total / static_cast<float>(width) + eps);
  for (int64_t j = 0; j < width; ++j) out[j] = w[j] * (xr[j] * scale);
}

// norm_row of every row of a contiguous float32 [rows, width], in `dtype` (float32 or bfloat16, rounded once), the
// rows shared between threads from kParallelElements elements on (a prompt's rows; a tree's few stay on one thread)
at::Tensor norm_rows(const at::Tensor& rows, const at::Tensor& weight, double eps, at::ScalarType dtype,
                     hierspec_scratch::Role role = hierspec_scratch::kNone) {
  const int64_t count = rows.size(0), width = rows.size(1);
  auto out = hierspec_scratch::tensor(role, {count, width}, rows.options().dtype(dtype));
  const RowsOf to(out);
  const float* x = rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  hierspec_team::parallel_for(0, count, row_grain(width), [&](int64_t begin, int64_t end) {
    // float32 rows straight into the output (the decoding step's norms); bfloat16 ones through one row of float32
    std::vector<float> row(to.f != nullptr ? 0 : static_cast<size_t>(width));
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x + r * width, w, static_cast<float>(eps), width, to.f != nullptr ? to.f + r * width : row.data());
      if (to.f == nullptr) to.write(r, row.data(), width);
    }
  });
  return out;
}

}  // namespace

at::Tensor project_stacks(const at::Tensor& rows, const std::vector<std::vector<at::Tensor>>& stacks,
                          const c10::optional<at::Tensor>& bias) {
  return project(rows, stacks, bias);
}

// silu(gate) * up, float32 [rows, width] each (rows may be strided, as the halves of one gate/up product), in `role`'s
// tensor (int4_scratch.h)
at::Tensor silu_product(const at::Tensor& gate, const at::Tensor& up, hierspec_scratch::Role role) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat &&
                  up.scalar_type() == at::kFloat && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate, up: float32 [rows, width] with contiguous rows");
  const int64_t rows = gate.size(0), width = gate.size(1);
  auto act = hierspec_scratch::tensor(role, {rows, width}, gate.options());
  const float* gates = gate.data_ptr<float>();
  const float* ups = up.data_ptr<float>();
  float* outs = act.data_ptr<float>();
  // rows shared between the threads from kParallelElements elements on (a 16-row SmolLM2 forward: ~0.4 ms alone)
  hierspec_team::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_row(gates + r * gate.stride(0), ups + r * up.stride(0), width, outs + r * width);
  });
  return act;
}

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, hierspec_scratch::Role role) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden: float32 [rows, width]");
  return norm_rows(hidden.contiguous(), weight, eps, at::kFloat, role);
}

// Rotated queries and keys and the values [1, heads, rows, dim] of hidden [rows, hidden] (the decoder's
// _attention_inputs after its input norm).
std::vector<at::Tensor> attention_inputs(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                         const std::vector<std::vector<at::Tensor>>& qkv,
                                         const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                                         const at::Tensor& signed_sin, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t rows = hidden.size(0);
  using namespace hierspec_scratch;
  const auto product = project(rms_norm(hidden, norm_weight, eps, kNorm), qkv, bias, kQkv);
  TORCH_CHECK(product.size(0) == rows, "q/k/v product rows");
  return rotate_heads(product.contiguous(), cos, signed_sin, heads, kv_heads, dim);
}

// The attention's output projection and residual, then the MLP block and its residual (the decoder's _mlp).
at::Tensor mlp_block(const at::Tensor& hidden, const at::Tensor& attended, const at::Tensor& norm_weight, double eps,
                     const std::vector<std::vector<at::Tensor>>& out,
                     const std::vector<std::vector<at::Tensor>>& gate_up,
                     const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate) {
  using namespace hierspec_scratch;
  const c10::optional<at::Tensor> none;
  const auto residual = add_into(project(attended, out, none, kOut), hidden);
  const auto both = project(rms_norm(residual, norm_weight, eps, kNorm), gate_up, none, kGateUp);
  const auto act = silu_product(both.narrow(1, 0, intermediate), both.narrow(1, intermediate, intermediate),
                                kActivation);
  return add_into(project(act, down, none, kDown), residual);
}

// The expanded prompt decoder's glue (see the top of this file): hidden float32 [rows, width], the products in their
// dtype (bfloat16, or float32), each widened exactly before float32 arithmetic and each result rounded once to the
// dtype the next product takes — the same bits as the ATen conversions between the same loops.

// The input norm of a layer, in `dtype`.
at::Tensor prompt_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::ScalarType dtype) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "hidden: contiguous float32 [rows, width]");
  return norm_rows(hidden, weight, eps, dtype);
}

// The rotated queries and keys and the values, each float32 [1, heads, rows, dim], of a q/k/v product [rows,
// (heads + 2 kv_heads) dim] plus its float32 bias where given (widened, the bias added, then rotate_heads).
std::vector<at::Tensor> prompt_qkv(const at::Tensor& product, const c10::optional<at::Tensor>& bias,
                                   const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads,
                                   int64_t kv_heads, int64_t dim) {
  const RowsOf from(product);
  const int64_t rows = product.size(0), width = product.size(1);
  auto wide = at::empty({rows, width}, product.options().dtype(at::kFloat));
  float* w = wide.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = w + r * width;
      from.read(r, width, row);
      if (b != nullptr)
        for (int64_t i = 0; i < width; ++i) row[i] = row[i] + b[i];
    }
  });
  return rotate_heads(wide, cos, signed_sin, heads, kv_heads, dim);
}

// hidden += product (in place: the residual), then, with `weight`, the next norm of the sum in `dtype` (else hidden).
at::Tensor prompt_add_norm(at::Tensor hidden, const at::Tensor& product, const c10::optional<at::Tensor>& weight,
                           double eps, at::ScalarType dtype) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  product.sizes() == hidden.sizes(),
              "hidden: contiguous float32 [rows, width]; product: the same shape");
  const RowsOf from(product);
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  at::Tensor out = weight.has_value() ? at::empty({rows, width}, hidden.options().dtype(dtype)) : hidden;
  const RowsOf to(out);
  float* x = hidden.data_ptr<float>();
  const float* w = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(width)), normed(w != nullptr ? static_cast<size_t>(width) : 0);
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * width;
      from.read(r, width, row.data());
      for (int64_t i = 0; i < width; ++i) xr[i] = row[i] + xr[i];  // as ATen's `hidden + product`
      if (w != nullptr) {
        norm_row(xr, w, static_cast<float>(eps), width, normed.data());
        to.write(r, normed.data(), width);
      }
    }
  });
  return out;
}

// silu(gate) * up of a gate/up product [rows, 2 intermediate] (silu_product's arithmetic), in `dtype`.
at::Tensor prompt_activation(const at::Tensor& gate_up, int64_t intermediate, at::ScalarType dtype) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * intermediate, "gate/up product: [rows, 2 intermediate]");
  const RowsOf from(gate_up);
  const int64_t rows = gate_up.size(0);
  auto out = at::empty({rows, intermediate}, gate_up.options().dtype(dtype));
  const RowsOf to(out);
  at::parallel_for(0, rows, row_grain(2 * intermediate), [&](int64_t begin, int64_t end) {
    std::vector<float> both(static_cast<size_t>(2 * intermediate)), act(static_cast<size_t>(intermediate));
    for (int64_t r = begin; r < end; ++r) {
      from.read(r, 2 * intermediate, both.data());
      silu_row(both.data(), both.data() + intermediate, intermediate, act.data());
      to.write(r, act.data(), intermediate);
    }
  });
  return out;
}
