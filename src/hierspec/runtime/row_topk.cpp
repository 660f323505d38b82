// The k largest logits of each row (the verifier's top-k for the drafters that learn from it), in one pass.
//
// PyTorch's topk over a [rows, 49152] float32 block took ~40 us a row (~0.4 ms of an hd step on SmolLM2); here each
// row keeps its k best in a small sorted list and a whole vector of logits is looked at only when one of them beats
// the list's last, which after the first few thousand entries is rare. The vectors are the CPU's widest (16 lanes
// with AVX-512, else 8).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::kLanes;

// value at `index` into the list (values descending; an equal value stays behind the lower index already there)
inline void insert(float value, int64_t index, float* values, int64_t* indices, int64_t k) {
  int64_t p = k - 1;
  while (p > 0 && values[p - 1] < value) {
    values[p] = values[p - 1];
    indices[p] = indices[p - 1];
    --p;
  }
  values[p] = value;
  indices[p] = index;
}

// bit i set where row[j + i] > threshold, for one vector of lanes; `nan` gets bit i set where row[j + i] is NaN
inline uint32_t above(const float* row, float threshold, uint32_t* nan) {
#ifdef __AVX512F__
  const __m512 v = _mm512_loadu_ps(row);
  *nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(threshold), _CMP_GT_OQ);
#else
  const __m256 v = _mm256_loadu_ps(row);
  *nan = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(threshold), _CMP_GT_OQ)));
#endif
}

// the row's k largest entries' indices into out (NaN as -inf) and its NumPy argmax into *argmax: the first NaN if
// there is one, else the first maximal entry (the list's first)
void top_of_row(const float* row, int64_t n, int64_t k, int64_t* out, int64_t* argmax) {
  std::vector<float> values(k, -INFINITY);
  std::vector<int64_t> indices(k, 0);
  int64_t first_nan = -1;
  auto note_nan = [&](int64_t i) { if (first_nan < 0 && row[i] != row[i]) first_nan = i; };
  int64_t j = 0;
  for (; j < k; ++j) {
    note_nan(j);
    insert(row[j] == row[j] ? row[j] : -INFINITY, j, values.data(), indices.data(), j + 1);
  }
  for (; j + kLanes <= n; j += kLanes) {
    uint32_t nan = 0;
    for (uint32_t bits = above(row + j, values[k - 1], &nan); bits != 0; bits &= bits - 1) {
      const int64_t i = j + __builtin_ctz(bits);
      if (row[i] > values[k - 1]) insert(row[i], i, values.data(), indices.data(), k);
    }
    if (nan != 0 && first_nan < 0) first_nan = j + __builtin_ctz(nan);
  }
  for (; j < n; ++j) {
    note_nan(j);
    if (row[j] > values[k - 1]) insert(row[j], j, values.data(), indices.data(), k);
  }
  for (int64_t i = 0; i < k; ++i) out[i] = indices[i];
  *argmax = first_nan >= 0 ? first_nan : indices[0];
}

}  // namespace

// logits: float32 [rows, n], contiguous. Returns int64 [rows] and [rows, k]: each row's argmax as NumPy's (the first
// NaN, else the first maximal entry: the verifier's greedy token, without a second pass over the row) and its k
// largest entries' indices, largest first, equal values in index order, NaN ranking as -inf.
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous float32 [rows, n]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "k must be in 1..n");
  auto out = at::empty({rows, k}, logits.options().dtype(at::kLong));
  auto argmax = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* a = argmax.data_ptr<int64_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) top_of_row(x + r * n, n, k, o + r * k, a + r);
  });
  return {argmax, out};
}
