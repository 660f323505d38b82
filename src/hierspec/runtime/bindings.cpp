// The Python module of hierspec's compiled kernels: every call declared in int4_layers.h. Only this file includes
// PyTorch's pybind11 headers (tens of seconds to parse on a slow core); the kernels include ATen's tensor header alone,
// so that a first build takes under two minutes on a 2-core Zen 3 instead of five.

#include <torch/csrc/utils/pybind.h>

#include "int4_layers.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "int4 product of a few float32 rows");
  m.def("int8_mm", &int8_mm, "int8 product of a few float32 rows");
  m.def("amx_ready", &amx_ready, "whether the AMX products can run in this build and process");
  m.def("int4_amx_mm", &int4_amx_mm, "4-bit or 8-bit product of float32 rows on AMX tiles");
  m.def("bf16_ready", &bf16_ready, "whether the AVX512-BF16 products can run in this build");
  m.def("int4_bf16_mm", &int4_bf16_mm, "4-bit or 8-bit product of float32 rows by AVX512-BF16 dot products");
  m.def("vnni_ready", &vnni_ready, "whether the integer (VNNI) products can run in this build");
  m.def("vnni_width", &vnni_width, "the integer products' vector width in bits: 512 (AVX512-VNNI), 256 (AVX2), 0");
  m.def("int4_vnni_mm",
        [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
           const at::Tensor& units) { return int4_vnni_mm(x, codes, scale, bias, units); },
        "4-bit or 8-bit product of float32 rows (two 8-bit codes an input) by integer dot products");
  m.def("int4_vnni8_mm",
        [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
           const at::Tensor& units) { return int4_vnni8_mm(x, codes, scale, bias, units); },
        "4-bit or 8-bit product of float32 rows (one 8-bit code an input) by integer dot products");
  m.def("dense_mm", &dense_mm, "float32 rows times a weight prepacked by oneDNN, in float32");
  m.def("dense_bf16_ready", &dense_bf16_ready, "whether the AVX512-BF16 dense products can run in this build");
  m.def("dense_bf16_mm", &dense_bf16_mm,
        "float32 rows times a bfloat16 weight packed in blocks of 16 outputs, by AVX512-BF16 dot products");
  m.def("dense_f32_mm", &dense_f32_mm, "float32 rows times a float32 weight packed in blocks of 16 outputs");
  m.def("dense_members_mm", &dense_members_mm,
        "float32 rows times members' bfloat16 weights, side by side, in float32");
  m.def("rms_norm", [](const at::Tensor& hidden, const at::Tensor& weight, double eps) {
    return rms_norm(hidden, weight, eps);
  }, "RMS norm of each float32 row");
  m.def("attention_inputs", &attention_inputs, "an int4 layer's rotated queries, keys and values");
  m.def("silu_product", [](const at::Tensor& gate, const at::Tensor& up) { return silu_product(gate, up); },
        "silu(gate) * up of float32 rows");
  m.def("mlp_block", &mlp_block, "an int4 layer's output projection, MLP block and residuals");
  m.def("prompt_norm", &prompt_norm, "a prompt layer's input norm, in the products' dtype");
  m.def("prompt_qkv", &prompt_qkv, "a prompt layer's rotated queries and keys and its values from the q/k/v product");
  m.def("prompt_add_norm", &prompt_add_norm, "a prompt layer's residual sum in place, then the next norm");
  m.def("prompt_activation", &prompt_activation, "silu(gate) * up of a prompt layer's gate/up product");
  m.def("exact_attention", &exact_attention, "exact tree attention over float32 cache buffers, rows written first");
  m.def("exact_layer", &exact_layer, "an int4 layer with exact tree attention over its cache buffers");
  pybind11::class_<ExactLayerStack>(m, "ExactLayerStack")
      .def(pybind11::init<double, double, int64_t, int64_t, int64_t, bool>())
      .def("add", &ExactLayerStack::add, "append the next layer's weights")
      .def("forward", &ExactLayerStack::forward, "every layer with exact attention, in one call")
      .def("step", &ExactLayerStack::step, "one tree's verification forward: inputs, every layer, norm and head")
      .def("runs_as_team", &ExactLayerStack::runs_as_team, "whether a forward of this many rows runs with a helper")
      .def("__len__", &ExactLayerStack::size);
  m.def("head_guess", &head_guess, "a draft head's k best shortlist entries and their probabilities, per row");
  m.def("row_topk", &row_topk, "each float32 row's NumPy argmax and k largest entries' indices, largest first");
  m.def("prompt_attention_fits", &prompt_attention_fits, "whether prompt_attention takes heads of this size");
  m.def("prompt_attention", &prompt_attention, "a prompt's causal attention on an empty cache, float32");
  m.def("keep_entries", &keep_entries, "move kept cache entries to their final slots in every buffer");
}
