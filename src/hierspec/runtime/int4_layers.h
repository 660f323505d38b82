// The int4 decoder's layer calls (int4_blocks.cpp, int4_attention.cpp), the verifier's top-k (row_topk.cpp) and the
// cache's path move (cache_keep.cpp), declared for the bindings in int4_kernel.cpp and for int4_attention.cpp, which
// runs the halves around its attention.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// int4_blocks.cpp
torch::Tensor rms_norm(const torch::Tensor& hidden, const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> attention_inputs(const torch::Tensor& hidden, const torch::Tensor& norm_weight, double eps,
                                            const std::vector<std::vector<torch::Tensor>>& qkv,
                                            const c10::optional<torch::Tensor>& bias, const torch::Tensor& cos,
                                            const torch::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                                            int64_t dim);
torch::Tensor silu_product(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor mlp_block(const torch::Tensor& hidden, const torch::Tensor& attended, const torch::Tensor& norm_weight,
                        double eps, const std::vector<std::vector<torch::Tensor>>& out,
                        const std::vector<std::vector<torch::Tensor>>& gate_up,
                        const std::vector<std::vector<torch::Tensor>>& down, int64_t intermediate);

// int4_attention.cpp
torch::Tensor exact_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                              const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& write_blocks,
                              const torch::Tensor& write_slots, const torch::Tensor& indptr,
                              const torch::Tensor& indices, const torch::Tensor& blocks, double scale);
torch::Tensor exact_layer(const torch::Tensor& hidden, const torch::Tensor& norm1, double eps,
                          const std::vector<std::vector<torch::Tensor>>& qkv, const c10::optional<torch::Tensor>& bias,
                          const torch::Tensor& cos, const torch::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                          int64_t dim, const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& write_blocks, const torch::Tensor& write_slots,
                          const torch::Tensor& indptr, const torch::Tensor& indices, const torch::Tensor& blocks,
                          double scale, const torch::Tensor& norm2,
                          const std::vector<std::vector<torch::Tensor>>& out,
                          const std::vector<std::vector<torch::Tensor>>& gate_up,
                          const std::vector<std::vector<torch::Tensor>>& down, int64_t intermediate);

// row_topk.cpp
torch::Tensor row_topk(const torch::Tensor& logits, int64_t k);

// cache_keep.cpp
void keep_entries(const std::vector<torch::Tensor>& buffers, int64_t start, const torch::Tensor& offsets);
