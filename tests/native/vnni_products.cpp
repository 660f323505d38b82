// The integer (VNNI) products, the float32 dense products and a prompt's attention alone, for
// tests/test_vnni_avx2.py: int4_vnni.cpp, dense_f32.cpp and prompt_attention.cpp built for another instruction set
// (their AVX2 paths on a CPU with AVX-512) and compared with the extension hierspec builds for this CPU.
#include <torch/csrc/utils/pybind.h>

at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                        const at::Tensor& units);
at::Tensor int4_vnni8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                         const at::Tensor& units);
bool vnni_ready();
at::Tensor dense_f32_mm(const at::Tensor& rows, const at::Tensor& weight);
bool prompt_attention_fits(int64_t dim);
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_vnni_mm", &int4_vnni_mm, "the integer products");
  m.def("int4_vnni8_mm", &int4_vnni8_mm, "the integer products, rows as one 8-bit code an input");
  m.def("vnni_ready", &vnni_ready, "whether this build runs them");
  m.def("dense_f32_mm", &dense_f32_mm, "float32 rows times a float32 weight packed in blocks of 16 outputs");
  m.def("prompt_attention_fits", &prompt_attention_fits, "whether prompt_attention takes heads of this size");
  m.def("prompt_attention", &prompt_attention, "a prompt's causal attention on an empty cache, float32");
}
