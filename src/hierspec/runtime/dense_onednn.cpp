// A projection stack of float weights prepacked by oneDNN (onednn.py's pack_weight), as the compiled layers multiply
// it: the product is PyTorch's private mkldnn::_linear_pointwise — the very op the Python side calls
// (onednn.packed_linear) — reached through the dispatcher, with the rows rounded to the weight's dtype first and the
// result widened to float32. This file is the compiled kernels' one use of a private PyTorch op;
// tests/test_dense_layers.py checks it against the Python call bit for bit and fails loudly when the op changes.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "int4_layers.h"

at::Tensor dense_mm(const at::Tensor& rows, const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn() && rows.dim() == 2 && rows.size(1) == packed.size(1),
              "dense_mm: [rows, in] times a weight prepacked by oneDNN, [out, in]");
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(rows.to(packed.scalar_type()).contiguous());
  stack.emplace_back(packed);
  stack.emplace_back();  // no bias: the projection adds its float32 bias to the widened product
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back();  // no algorithm
  op.callBoxed(&stack);
  return stack.at(0).toTensor().to(at::kFloat);
}
