// The int4 decoder's layer calls (int4_blocks.cpp, int4_attention.cpp), the verifier's top-k (row_topk.cpp) and the
// cache's path move (cache_keep.cpp), declared for the bindings in int4_kernel.cpp and for int4_attention.cpp, which
// runs the halves around its attention.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
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

// One int4 layer's weights, as exact_layer takes them
struct ExactLayerWeights {
  torch::Tensor norm1;
  std::vector<std::vector<torch::Tensor>> qkv;
  c10::optional<torch::Tensor> bias;
  torch::Tensor norm2;
  std::vector<std::vector<torch::Tensor>> out, gate_up, down;
  int64_t intermediate;
};

// Every layer of an int4 decoder with exact attention, its weights held here once: a forward's layers are one call
// from Python instead of one each (a call converts ~20 arguments, nested lists of tensors among them)
class ExactLayerStack {
 public:
  ExactLayerStack(double eps, double scale, int64_t heads, int64_t kv_heads, int64_t dim);
  // the next layer's weights, as exact_layer takes them
  void add(const torch::Tensor& norm1, const std::vector<std::vector<torch::Tensor>>& qkv,
           const c10::optional<torch::Tensor>& bias, const torch::Tensor& norm2,
           const std::vector<std::vector<torch::Tensor>>& out, const std::vector<std::vector<torch::Tensor>>& gate_up,
           const std::vector<std::vector<torch::Tensor>>& down, int64_t intermediate);
  // exact_layer through every layer in order, layer i over keys[i] and values[i] (alike in shape: the plan is
  // checked once)
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const torch::Tensor& write_blocks, const torch::Tensor& write_slots,
                        const torch::Tensor& indptr, const torch::Tensor& indices, const torch::Tensor& blocks) const;
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  double eps_, scale_;
  int64_t heads_, kv_heads_, dim_;
  std::vector<ExactLayerWeights> layers_;
};

// row_topk.cpp
std::tuple<torch::Tensor, torch::Tensor> row_topk(const torch::Tensor& logits, int64_t k);

// cache_keep.cpp
void keep_entries(const std::vector<torch::Tensor>& buffers, int64_t start, const torch::Tensor& offsets);
