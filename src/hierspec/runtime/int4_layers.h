// The products, the int4 decoder's layer calls (int4_blocks.cpp, int4_attention.cpp), the draft head's guess
// (head_guess.cpp), the verifier's top-k (row_topk.cpp) and the cache's path move (cache_keep.cpp), declared for the
// bindings in bindings.cpp, for int4_blocks.cpp, which picks a weight's product, for int4_attention.cpp, which runs
// the halves around its attention, for head_guess.cpp, which runs the head's products, and for int4_vnni.cpp, whose
// one-code unit (int4_vnni8.cpp) calls vnni_ready defined in the other.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "int4_scratch.h"

// The products (int4_kernel.cpp, int4_amx.cpp, int4_bf16.cpp, int4_vnni.cpp), float32 rows times a packed weight
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale);
bool amx_ready();
at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias);
bool bf16_ready();
at::Tensor int4_bf16_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias);
bool vnni_ready();
int64_t vnni_width();
at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                        const at::Tensor& units);
at::Tensor int4_vnni8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                         const at::Tensor& units);
// the same, the output in `role`'s tensor of a layer stack's arena (int4_scratch.h)
at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                        const at::Tensor& units, hierspec_scratch::Role role);
at::Tensor int4_vnni8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                         const at::Tensor& units, hierspec_scratch::Role role);
// int4_vnni.cpp: the blocks of an integer product's stack {codes, scales, ...} that a team's helper computes, queued
// to be fetched into the caches ahead (int4_team.h; nothing outside a team)
void warm_helper_share(const std::vector<at::Tensor>& stack);
// dense_onednn.cpp: float32 rows times a weight prepacked by oneDNN (bfloat16 or float32), in float32, at most
// rows_per_call rows a call where it is positive
at::Tensor dense_mm(const at::Tensor& rows, const at::Tensor& packed, int64_t rows_per_call);
// dense_bf16.cpp: float32 rows times a bfloat16 weight packed [N / 16, K / 2, 16, 2] by AVX512-BF16 dot products
// (each row's result independent of the rows beside it), and a prompt's rows times the members' own weights
bool dense_bf16_ready();
at::Tensor dense_bf16_mm(const at::Tensor& rows, const at::Tensor& weight);
at::Tensor dense_members_mm(const at::Tensor& rows, const std::vector<at::Tensor>& members);
// dense_f32.cpp: float32 rows times a float32 weight packed [N / 16, K, 16] by fused multiply-adds (the same)
at::Tensor dense_f32_mm(const at::Tensor& rows, const at::Tensor& weight);

// int4_blocks.cpp
// rows times a projection's stacks side by side (each stack's kernel told by its codes), plus its bias where given
at::Tensor project_stacks(const at::Tensor& rows, const std::vector<std::vector<at::Tensor>>& stacks,
                          const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps,
                    hierspec_scratch::Role role = hierspec_scratch::kNone);
std::vector<at::Tensor> attention_inputs(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                         const std::vector<std::vector<at::Tensor>>& qkv,
                                         const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                                         const at::Tensor& signed_sin, int64_t heads, int64_t kv_heads, int64_t dim);
at::Tensor silu_product(const at::Tensor& gate, const at::Tensor& up,
                        hierspec_scratch::Role role = hierspec_scratch::kNone);
// the expanded prompt decoder's glue between its products
at::Tensor prompt_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps, at::ScalarType dtype);
std::vector<at::Tensor> prompt_qkv(const at::Tensor& product, const c10::optional<at::Tensor>& bias,
                                   const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads,
                                   int64_t kv_heads, int64_t dim);
at::Tensor prompt_add_norm(at::Tensor hidden, const at::Tensor& product, const c10::optional<at::Tensor>& weight,
                           double eps, at::ScalarType dtype);
at::Tensor prompt_activation(const at::Tensor& gate_up, int64_t intermediate, at::ScalarType dtype);
at::Tensor mlp_block(const at::Tensor& hidden, const at::Tensor& attended, const at::Tensor& norm_weight, double eps,
                     const std::vector<std::vector<at::Tensor>>& out,
                     const std::vector<std::vector<at::Tensor>>& gate_up,
                     const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate);

// int4_attention.cpp
at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                           const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                           const at::Tensor& blocks, double scale);
at::Tensor exact_layer(const at::Tensor& hidden, const at::Tensor& norm1, double eps,
                       const std::vector<std::vector<at::Tensor>>& qkv, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                       int64_t dim, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                       const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                       const at::Tensor& blocks, double scale, const at::Tensor& norm2,
                       const std::vector<std::vector<at::Tensor>>& out,
                       const std::vector<std::vector<at::Tensor>>& gate_up,
                       const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate);

// One int4 layer's weights, as exact_layer takes them
struct ExactLayerWeights {
  at::Tensor norm1;
  std::vector<std::vector<at::Tensor>> qkv;
  c10::optional<at::Tensor> bias;
  at::Tensor norm2;
  std::vector<std::vector<at::Tensor>> out, gate_up, down;
  int64_t intermediate;
};

// Every layer of an int4 decoder with exact attention, its weights held here once: a forward's layers are one call
// from Python instead of one each (a call converts ~20 arguments, nested lists of tensors among them)
class ExactLayerStack {
 public:
  // rows up to which a forward runs as a team
  static constexpr int64_t kTeamRows = 64;
  // team: a forward of at most kTeamRows rows runs with a helper thread (int4_team.h)
  ExactLayerStack(double eps, double scale, int64_t heads, int64_t kv_heads, int64_t dim, bool team);
  // the next layer's weights, as exact_layer takes them
  void add(const at::Tensor& norm1, const std::vector<std::vector<at::Tensor>>& qkv,
           const c10::optional<at::Tensor>& bias, const at::Tensor& norm2,
           const std::vector<std::vector<at::Tensor>>& out, const std::vector<std::vector<at::Tensor>>& gate_up,
           const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate);
  // exact_layer through every layer in order, layer i over keys[i] and values[i] (alike in shape: the plan is
  // checked once)
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                     const at::Tensor& write_blocks, const at::Tensor& write_slots, const at::Tensor& indptr,
                     const at::Tensor& indices, const at::Tensor& blocks) const;
  // one tree's whole verification forward: inputs, plan, every layer, final norm and head (int4_attention.cpp)
  std::vector<at::Tensor> step(const at::Tensor& embedding, const at::Tensor& tokens, const at::Tensor& parents,
                               const at::Tensor& depths, int64_t past, int64_t rows, const at::Tensor& cos_table,
                               const at::Tensor& sin_table, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const at::Tensor& final_norm,
                               const std::vector<std::vector<at::Tensor>>& head,
                               const c10::optional<at::Tensor>& head_bias) const;
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // whether a forward of `rows` rows runs with a helper thread: asked for, few rows, every product an integer one
  bool runs_as_team(int64_t rows) const;

 private:
  double eps_, scale_;
  int64_t heads_, kv_heads_, dim_;
  bool team_;
  std::vector<ExactLayerWeights> layers_;
  // the layers' tensors a forward reuses (int4_scratch.h): one forward at a time holds them
  mutable std::mutex arena_mutex_;
  mutable hierspec_scratch::Arena arena_;
};

// head_guess.cpp
std::tuple<at::Tensor, at::Tensor> head_guess(const at::Tensor& hidden, const at::Tensor& embedded,
                                              const std::vector<std::vector<at::Tensor>>& up,
                                              const c10::optional<at::Tensor>& up_bias, int64_t width,
                                              const std::vector<std::vector<at::Tensor>>& down,
                                              const c10::optional<at::Tensor>& down_bias, const at::Tensor& gain,
                                              double eps, const std::vector<std::vector<at::Tensor>>& shortlist,
                                              int64_t size, int64_t k);

// row_topk.cpp
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& logits, int64_t k);

// cache_keep.cpp
void keep_entries(const std::vector<at::Tensor>& buffers, int64_t start, const at::Tensor& offsets);
// prompt_attention.cpp: a prompt's causal attention on an empty cache, float32 (head sizes prompt_attention_fits)
bool prompt_attention_fits(int64_t dim);
at::Tensor prompt_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale);
