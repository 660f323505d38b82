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

#include <algorithm>
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

// A stretch of a row: its k best entries (values descending, equal values in index order, NaN as -inf) and its
// first NaN (-1 if none)
struct Best {
  std::vector<float> values;
  std::vector<int64_t> indices;
  int64_t first_nan = -1;
};

// entries [begin, end) of a row (at least k of them) into `best`
void top_of_range(const float* row, int64_t begin, int64_t end, int64_t k, Best& best) {
  best.values.assign(k, -INFINITY);
  best.indices.assign(k, 0);
  best.first_nan = -1;
  float* values = best.values.data();
  int64_t* indices = best.indices.data();
  auto note_nan = [&](int64_t i) { if (best.first_nan < 0 && row[i] != row[i]) best.first_nan = i; };
  int64_t j = begin;
  for (; j < begin + k; ++j) {
    note_nan(j);
    insert(row[j] == row[j] ? row[j] : -INFINITY, j, values, indices, j - begin + 1);
  }
  for (; j + kLanes <= end; j += kLanes) {
    uint32_t nan = 0;
    for (uint32_t bits = above(row + j, values[k - 1], &nan); bits != 0; bits &= bits - 1) {
      const int64_t i = j + __builtin_ctz(bits);
      if (row[i] > values[k - 1]) insert(row[i], i, values, indices, k);
    }
    if (nan != 0 && best.first_nan < 0) best.first_nan = j + __builtin_ctz(nan);
  }
  for (; j < end; ++j) {
    note_nan(j);
    if (row[j] > values[k - 1]) insert(row[j], j, values, indices, k);
  }
}

// The later stretch's best into `into` (the earlier stretch's): what one pass over the whole row would keep, since
// the later stretch's entries all come after the earlier's (an equal value stays behind the earlier index)
void merge_later(Best& into, const Best& later, int64_t k) {
  for (int64_t i = 0; i < k; ++i)
    if (later.values[i] > into.values[k - 1]) insert(later.values[i], later.indices[i], into.values.data(),
                                                       into.indices.data(), k);
  if (into.first_nan < 0) into.first_nan = later.first_nan;
}

// A row's stretches a thread each: one per thread where every stretch holds at least kStretch entries (and k)
constexpr int64_t kStretch = 8192;

int64_t stretches_of(int64_t n, int64_t k) {
  const int64_t threads = at::get_num_threads();
  return std::max<int64_t>(1, std::min(threads, n / std::max(kStretch, k)));
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
  // each row in stretches read by the threads side by side, stretch-major: the logits were written by the head's
  // product one stretch of outputs a thread, and are read where they are cached instead of all by one thread (one
  // row's argmax took ~0.15 ms of a step on a Zen 3)
  const int64_t parts = stretches_of(n, k);
  std::vector<Best> best(parts * rows);
  at::parallel_for(0, parts * rows, parts > 1 ? 1 : 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t part = t / rows, r = t % rows;
      top_of_range(x + r * n, n * part / parts, n * (part + 1) / parts, k, best[t]);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Best& row = best[r];
    for (int64_t part = 1; part < parts; ++part) merge_later(row, best[part * rows + r], k);
    for (int64_t i = 0; i < k; ++i) o[r * k + i] = row.indices[i];
    a[r] = row.first_nan >= 0 ? row.first_nan : row.indices[0];
  }
  return {argmax, out};
}
