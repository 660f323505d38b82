// A projection stack of float weights prepacked by oneDNN (onednn.py's pack_weight), as the compiled layers multiply
// it: the product is PyTorch's private mkldnn::_linear_pointwise — the very op the Python side calls
// (onednn.packed_linear) — reached through the dispatcher, with the rows rounded to the weight's dtype first and the
// result widened to float32. This file is the compiled kernels' one use of a private PyTorch op;
// tests/test_dense_layers.py checks it against the Python call bit for bit and fails loudly when the op changes.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>

#include <string>
#include <vector>

#include "int4_layers.h"

namespace {

// one call of the op: rows already in the weight's dtype, the product in it
at::Tensor linear_pointwise(const at::Tensor& inputs, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(inputs.contiguous());
  stack.emplace_back(packed);
  stack.emplace_back();  // no bias: the projection adds its float32 bias to the widened product
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back();  // no algorithm
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

// rows_per_call > 0: more rows than that go in as few calls of near-equal size (onednn.DenseStack's split)
at::Tensor dense_mm(const at::Tensor& rows, const at::Tensor& packed, int64_t rows_per_call) {
  TORCH_CHECK(packed.is_mkldnn() && rows.dim() == 2 && rows.size(1) == packed.size(1),
              "dense_mm: [rows, in] times a weight prepacked by oneDNN, [out, in]");
  const auto inputs = rows.to(packed.scalar_type());
  const int64_t calls = rows_per_call > 0 ? (rows.size(0) + rows_per_call - 1) / rows_per_call : 1;
  if (calls <= 1) return linear_pointwise(inputs, packed).to(at::kFloat);
  std::vector<at::Tensor> parts;
  for (const auto& part : inputs.tensor_split(calls)) parts.push_back(linear_pointwise(part, packed));
  return at::cat(parts).to(at::kFloat);
}
