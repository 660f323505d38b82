// Tensors a layer stack's forward reuses from one layer, and one forward, to the next instead of allocating them.
//
// A layer of the compiled stack made ten tensors of the same few shapes — the norms, the products, the rotated
// queries, keys and values, the attention's output, the activation — each one an allocation through ATen (3.3 us a
// layer's set, warm, ~4 % of a one-token SmolLM2 forward; BENCHMARKS.md, "Seventy-first session"). A stack forward
// opens an Arena on its thread (Using); inside it each call site asks for its Role's tensor, which keeps its memory
// while the shape and dtype stay. Each role's tensor is read before the same role is written again within a layer
// (ExactLayerStack::forward's order), the next layer's input is the down product's tensor, and the forward returns a
// copy of it. Outside an arena — every other caller — the same calls allocate a new tensor as before.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace hierspec_scratch {

// what a tensor is for in a layer (kNone: not kept; a projection of several stacks, whose parts are then joined)
enum Role : int { kNone = -1, kNorm, kQkv, kQuery, kKey, kValue, kAttended, kOut, kGateUp, kActivation, kDown, kRoles };

struct Arena {
  at::Tensor tensors[kRoles];
};

// the arena of the stack forward running on this thread, or nullptr
inline thread_local Arena* current = nullptr;

// a tensor of `sizes` for `role`: the arena's, reused, inside one; a new one otherwise
inline at::Tensor tensor(Role role, at::IntArrayRef sizes, const at::TensorOptions& options) {
  Arena* arena = current;
  if (arena == nullptr || role == kNone) return at::empty(sizes, options);
  at::Tensor& kept = arena->tensors[role];
  if (!kept.defined() || kept.sizes() != sizes || kept.dtype() != options.dtype()) kept = at::empty(sizes, options);
  return kept;
}

// `arena` current on this thread for the scope (restored however the scope is left)
class Using {
 public:
  explicit Using(Arena& arena) : before_(current) { current = &arena; }
  ~Using() { current = before_; }
  Using(const Using&) = delete;
  Using& operator=(const Using&) = delete;

 private:
  Arena* before_;
};

}  // namespace hierspec_scratch
