// Moving a verified path's entries to their final cache slots, every layer in one call.
//
// After each verification TreeCache.keep moves the accepted nodes' keys and values behind the committed ones. Done
// per layer with index_select and a slice copy that is 120 small PyTorch operations for SmolLM2 (~0.5 ms a step on
// an Intel Xeon, ~4 % of a speculative step); here it is a few row copies per buffer.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"

// buffers: contiguous CPU tensors [batch, heads, capacity, dim] of one dtype. Entry start + offsets[i] moves to slot
// start + i in every (batch, head) row; offsets: int64, strictly ascending, offsets[i] >= i, start + offsets[-1]
// inside the capacity. A source is always at or after its destination and after every earlier destination, so the
// copies run in order without overwriting an entry still to be read.
void keep_entries(const std::vector<at::Tensor>& buffers, int64_t start, const at::Tensor& offsets) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous(),
              "offsets: a contiguous int64 vector");
  const int64_t count = offsets.size(0);
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(off[i] >= i && (i == 0 || off[i] > off[i - 1]), "offsets must ascend strictly with offsets[i] >= i");
  for (const auto& buffer : buffers) {
    TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous() && buffer.dim() == 4,
                "buffers: contiguous CPU [batch, heads, capacity, dim]");
    const int64_t rows = buffer.size(0) * buffer.size(1), capacity = buffer.size(2);
    TORCH_CHECK(start >= 0 && (count == 0 || start + off[count - 1] < capacity), "an entry outside the buffer");
    const int64_t row_bytes = buffer.size(3) * static_cast<int64_t>(buffer.element_size());
    auto* base = static_cast<uint8_t*>(buffer.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* slots = base + (r * capacity + start) * row_bytes;
      for (int64_t i = 0; i < count; ++i)
        if (off[i] != i) std::memcpy(slots + i * row_bytes, slots + off[i] * row_bytes, row_bytes);
    }
  }
}
