// Exact tree attention on float32 or float16 caches, and an int4 layer around it, each one call from Python (see
// exact_attention.py for what "exact" means and int4_kernel.py for the build).
//
// exact_attention.py's numba kernel costs ~17 us for a one-row SmolLM2 layer, but its Python call (query copy, cache
// write, array views, numba's argument checks) another ~50 us, 30 times a forward (~1.5 ms of a ~13 ms step on an
// Intel Xeon), and it runs on one thread. Here the rows' keys and values are written into the cache buffer, every
// (row, key/value head) task attends its row's slots, and the tasks are shared out by PyTorch's own thread pool.
// A task's arithmetic reads nothing of other rows and its every loop runs over its row's own key sequence (length
// and order the same alone, in a chain or anywhere in a tree), so a row's result is bit-identical whatever the other
// rows and whichever thread runs it. The results are not the numba kernel's bits (other reduction orders): the int4
// decoder uses this kernel on every forward where the extension loads, so its methods and its plain decoding agree.
// A float16 cache (the int4 path's default) halves what each attended entry costs to read: with 8 sequences of ~500
// entries a step reads more cache than weights. Entries are rounded once, when written, and every reader widens
// the same stored values.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_layers.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::kLanes;
using hierspec_int4::load;
using hierspec_int4::exp_vector;
using hierspec_int4::vi;
using hierspec_int4::vf;
using hierspec_int4::narrow_half;
using hierspec_int4::store_half;
using hierspec_int4::widen;

// below this many (row, key, head) triples a call runs on one thread: waking the pool costs more than it saves (in
// a forward the pool is awake between the products: one SmolLM2 row over 300 keys, 30 layers, 0.56 -> 0.46 ms at
// 1024 instead of 4096)
constexpr int64_t kParallelWork = 1024;

// The lanes of v summed pairwise in halves (lane i with i + lanes / 2, and so on): a fixed order
inline float halving_sum(vf v) {
#ifdef __AVX512F__
  typedef float v8 __attribute__((vector_size(32)));
  const v8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf h8 = v;
#endif
  typedef float v4 __attribute__((vector_size(16)));
  typedef float v2 __attribute__((vector_size(8)));
  const v4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const v2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

// count rounded up to whole vectors
inline int64_t padded(int64_t count) { return (count + kLanes - 1) / kLanes * kLanes; }

// kLanes vectors -> one vector whose lane j sums vector j's lanes, always in one fixed tree (lane i with lane i + half,
// then again on the halves): the same additions for a vector whichever position it has and whatever the others hold.
inline vf lane_sums(const vf* p) {
#ifdef __AVX512F__
  vf c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf d[4], e[2];
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// Everything a call's tasks read, as raw pointers and strides (element units): float32 queries and outputs, cache
// entries of T (float, or uint16_t for float16: each widened to float32 exactly as it is read)
template <typename T>
struct Operands {
  const float* query;  // row r, query head j: query + r * query_row + j * query_head
  int64_t query_row, query_head;
  const T* keys;  // block b, slot s: keys + (b * slots + s) * dim
  const T* values;
  int64_t slots;
  const int64_t* indptr;
  const int64_t* indices;
  const int64_t* blocks;
  int64_t kv_heads, groups, dim, width;
  float scale;
  float* out;  // [rows, heads * dim]
};

// Scratch of one thread: the scores, then weights, of one row's keys per query head (rows of width + kLanes: the
// last key block writes whole vectors), their sums, and the task's key, value, query and output addresses
template <typename T>
struct Scratch {
  std::vector<float> scores, totals;
  std::vector<const T*> keys, values;
  std::vector<const float*> queries;
  std::vector<float*> outs;
  explicit Scratch(const Operands<T>& o)
      : scores(o.groups * (o.width + kLanes)), totals(o.groups), queries(o.groups), outs(o.groups) {}
};

// Query heads of one key/value head taken together over each key (value) they read, so that it is loaded (and
// widened) once for all of them: as many as the vector registers hold beside their accumulators
constexpr int kGroupBlock = kLanes == 16 ? 4 : 2;

// G query heads' lane partials of kLanes keys (key t: keys[min(j0 + t, count - 1)]) and their sums into `scores`
// (head g's at scores + g * stride): each key's vectors multiplied lane-wise with each query's over the whole vectors
// in dim order, then lane_sums. C is the count of whole vectors of dim when it is known at compile time (0: read it
// from `chunks`). A head's operations are the same whichever heads are beside it.
template <int G, int C, typename T>
inline void score_block(const float* const* q, const T* const* keys, int64_t j0, int64_t count, int64_t chunks,
                        float* scores, int64_t stride) {
  const int64_t n = C > 0 ? C : chunks;
  vf part[G][kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    const T* key = keys[std::min(j0 + t, count - 1)];
    vf sum[G] = {};
    for (int64_t c = 0; c < n; ++c) {
      const vf k = load(key + c * kLanes);
      for (int g = 0; g < G; ++g) sum[g] = load(q[g] + c * kLanes) * k + sum[g];
    }
    for (int g = 0; g < G; ++g) part[g][t] = sum[g];
  }
  for (int g = 0; g < G; ++g) {
    const vf sums = lane_sums(part[g]);
    std::memcpy(scores + g * stride + j0, &sums, sizeof sums);
  }
}

// score_block over every key block for G query heads
template <int G, typename T>
void score_heads(const float* const* q, const T* const* keys, int64_t count, int64_t chunks, float* scores,
                 int64_t stride) {
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    if (chunks == 64 / kLanes) score_block<G, 64 / kLanes>(q, keys, j0, count, chunks, scores, stride);
    else if (chunks == 128 / kLanes) score_block<G, 128 / kLanes>(q, keys, j0, count, chunks, scores, stride);
    else score_block<G, 0>(q, keys, j0, count, chunks, scores, stride);
  }
}

// scores[g][j] = q_g · key j for the keys at `keys[j]`, kLanes keys at a time (a last partial block repeats its last
// key and its extra sums are never read), then the tail of dim in order: every key takes the same operations
// wherever it falls.
template <typename T>
void score_keys(const Operands<T>& o, const float* const* q, const T* const* keys, int64_t count, Scratch<T>& s) {
  const int64_t dim = o.dim, chunks = dim / kLanes, whole = chunks * kLanes, stride = o.width + kLanes;
  for (int64_t g0 = 0; g0 < o.groups; g0 += kGroupBlock) {
    float* scores = s.scores.data() + g0 * stride;
    switch (std::min<int64_t>(kGroupBlock, o.groups - g0)) {
      case 1: score_heads<1>(q + g0, keys, count, chunks, scores, stride); break;
      case 2: score_heads<2>(q + g0, keys, count, chunks, scores, stride); break;
#if defined(__AVX512F__)
      case 3: score_heads<3>(q + g0, keys, count, chunks, scores, stride); break;
      case 4: score_heads<4>(q + g0, keys, count, chunks, scores, stride); break;
#endif
    }
  }
  for (int64_t g = 0; g < o.groups; ++g) {
    float* scores = s.scores.data() + g * stride;
    for (int64_t j = 0; whole < dim && j < padded(count); ++j) {
      const T* key = keys[std::min(j, count - 1)];
      float total = scores[j];
      // std::fma: one rounding each, whichever the entry type (gcc contracted only the float32 form)
      for (int64_t i = whole; i < dim; ++i) total = std::fma(q[g][i], widen(key[i]), total);
      scores[j] = total;
    }
  }
}

// The softmax weights of one query head's scores, unnormalised, and their sum: line[j] = exp(scale * line[j] - top)
// with top the largest scaled score. The line is whole vectors long, its entries past `count` copies of the last
// key's (so they leave the maximum as it is) and set to 0 before the sum, which runs lane-wise over whole vectors.
float softmax_weights(float* line, float scale, int64_t count) {
  const int64_t length = padded(count);
  vf top = load(line) * scale;
  for (int64_t j = 0; j < length; j += kLanes) {
    const vf v = load(line + j) * scale;
    std::memcpy(line + j, &v, sizeof v);
    top = v > top ? v : top;
  }
  float best = top[0];
  for (int i = 1; i < kLanes; ++i) best = std::max(best, top[i]);
  vi lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  vf total{};
  for (int64_t j = 0; j < length; j += kLanes) {
    const vf e = lane + static_cast<int32_t>(j) < static_cast<int32_t>(count) ? exp_vector(load(line + j) - best) : vf{};
    std::memcpy(line + j, &e, sizeof e);
    total = total + e;
  }
  return halving_sum(total);
}

// out_g = sum_j w[g][j] * value j, for GB query heads and CB vectors of dim from `offset`: each element a chain of
// multiply-adds over the keys in order, the chains of GB x CB accumulators side by side.
template <int GB, int CB, typename T>
void weigh_panel(const float* weights, int64_t stride, const T* const* values, int64_t count, int64_t offset,
                 float* const* out) {
  vf acc[GB][CB];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CB; ++c) acc[g][c] = vf{};
  for (int64_t j = 0; j < count; ++j) {
    vf v[CB];
    for (int c = 0; c < CB; ++c) v[c] = load(values[j] + offset + c * kLanes);
    for (int g = 0; g < GB; ++g) {
      const float w = weights[g * stride + j];
      for (int c = 0; c < CB; ++c) acc[g][c] = w * v[c] + acc[g][c];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CB; ++c) std::memcpy(out[g] + offset + c * kLanes, &acc[g][c], sizeof(vf));
}

// The weighted values of every query head into out[g] (unnormalised): panels of up to kGroupBlock query heads by
// four vectors, then what remains of dim's vectors; the tail of dim element by element (the same chain, scalar).
template <int GB, typename T>
void weigh_heads(const float* w, int64_t stride, const T* const* values, int64_t count, int64_t whole,
                 float* const* out) {
  int64_t offset = 0;
  for (; offset + 4 * kLanes <= whole; offset += 4 * kLanes) weigh_panel<GB, 4>(w, stride, values, count, offset, out);
  for (; offset < whole; offset += kLanes) weigh_panel<GB, 1>(w, stride, values, count, offset, out);
}

template <typename T>
void weigh_values(const Operands<T>& o, const float* weights, const T* const* values, int64_t count,
                  float* const* out) {
  const int64_t dim = o.dim, whole = dim - dim % kLanes, stride = o.width + kLanes;
  for (int64_t g = 0; g < o.groups; g += kGroupBlock) {
    const float* w = weights + g * stride;
    switch (std::min<int64_t>(kGroupBlock, o.groups - g)) {
      case 1: weigh_heads<1>(w, stride, values, count, whole, out + g); break;
      case 2: weigh_heads<2>(w, stride, values, count, whole, out + g); break;
#if defined(__AVX512F__)
      case 3: weigh_heads<3>(w, stride, values, count, whole, out + g); break;
      case 4: weigh_heads<4>(w, stride, values, count, whole, out + g); break;
#endif
    }
  }
  for (int64_t g = 0; g < o.groups; ++g)
    for (int64_t i = whole; i < dim; ++i) {
      float total = 0.f;
      for (int64_t j = 0; j < count; ++j) total = std::fma(weights[g * stride + j], widen(values[j][i]), total);
      out[g][i] = total;
    }
}

// Row `row`, key/value head `head`: softmax(scale * q · k) · v over the row's slots, for its `groups` query heads
template <typename T>
void attend_task(const Operands<T>& o, int64_t row, int64_t head, Scratch<T>& s) {
  const int64_t start = o.indptr[row], count = o.indptr[row + 1] - start, dim = o.dim, stride = o.width + kLanes;
  const int64_t* slots = o.indices + start;
  const int64_t block = (o.blocks[row] + head) * o.slots;
  s.keys.resize(count);
  s.values.resize(count);
  for (int64_t j = 0; j < count; ++j) {
    s.keys[j] = o.keys + (block + slots[j]) * dim;
    s.values[j] = o.values + (block + slots[j]) * dim;
  }
  for (int64_t g = 0; g < o.groups; ++g) {
    s.queries[g] = o.query + row * o.query_row + (head * o.groups + g) * o.query_head;
    s.outs[g] = o.out + row * (o.kv_heads * o.groups * dim) + (head * o.groups + g) * dim;
  }
  score_keys(o, s.queries.data(), s.keys.data(), count, s);
  for (int64_t g = 0; g < o.groups; ++g) s.totals[g] = softmax_weights(s.scores.data() + g * stride, o.scale, count);
  weigh_values(o, s.scores.data(), s.values.data(), count, s.outs.data());
  for (int64_t g = 0; g < o.groups; ++g)
    for (int64_t d = 0; d < dim; ++d) s.outs[g][d] = s.outs[g][d] / s.totals[g];
}

void check_int64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name, ": a contiguous int64 vector");
}

// Every slot and block a call reads or writes is inside the buffers (a wrong plan fails here, not in memory)
void check_plan(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& blocks,
                const at::Tensor& write_blocks, const at::Tensor& write_slots, int64_t rows, int64_t buffers,
                int64_t slots, int64_t kv_heads) {
  for (const auto& [t, name] : {std::pair{&indptr, "indptr"}, {&indices, "indices"}, {&blocks, "blocks"},
                                {&write_blocks, "write_blocks"}, {&write_slots, "write_slots"}})
    check_int64(*t, name);
  TORCH_CHECK(indptr.size(0) == rows + 1 && blocks.size(0) == rows && write_blocks.size(0) == rows &&
                  write_slots.size(0) == rows, "plan: one entry per row (indptr: one more)");
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  TORCH_CHECK(ptr[0] == 0 && ptr[rows] == indices.size(0), "indptr must span indices");
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ptr[r + 1] > ptr[r], "every row must attend at least one key");
    for (const auto* b : {blocks.data_ptr<int64_t>(), write_blocks.data_ptr<int64_t>()})
      TORCH_CHECK(b[r] >= 0 && b[r] + kv_heads <= buffers, "a block outside the cache buffer");
    const int64_t w = write_slots.data_ptr<int64_t>()[r];
    TORCH_CHECK(w >= 0 && w < slots, "a written slot outside the cache buffer");
  }
  const auto [low, high] = std::minmax_element(indices.data_ptr<int64_t>(),
                                               indices.data_ptr<int64_t>() + indices.size(0));
  TORCH_CHECK(indices.size(0) == 0 || (*low >= 0 && *high < slots), "an attended slot outside the cache buffer");
}

// float16's largest finite value: a key or value beyond it would be stored as infinity
constexpr float kHalfMax = 65504.f;

// one row's dim floats into a cache entry of T (float16: rounded to nearest even); false if one is beyond float16
inline bool write_entry(float* to, const float* from, int64_t dim) {
  std::memcpy(to, from, dim * sizeof(float));
  return true;
}

inline bool write_entry(uint16_t* to, const float* from, int64_t dim) {
  bool fits = true;
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    const vf v = load(from + i);
    for (int lane = 0; lane < kLanes; ++lane) fits = fits && std::fabs(v[lane]) <= kHalfMax;
    store_half(to + i, v);
  }
  for (; i < dim; ++i) {
    fits = fits && std::fabs(from[i]) <= kHalfMax;
    to[i] = narrow_half(from[i]);
  }
  return fits;
}

// rows_in [1, kv_heads, rows, dim] into buffer block write_blocks[r] + h, slot write_slots[r]
template <typename T>
void write_rows(const at::Tensor& rows_in, T* buffer, const int64_t* write_blocks, const int64_t* write_slots,
                int64_t slots) {
  const auto states = rows_in.stride(3) == 1 ? rows_in : rows_in.contiguous();
  const int64_t heads = states.size(1), rows = states.size(2), dim = states.size(3);
  const float* source = states.data_ptr<float>();
  bool fits = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      fits = write_entry(buffer + ((write_blocks[r] + h) * slots + write_slots[r]) * dim,
                         source + h * states.stride(1) + r * states.stride(2), dim) && fits;
  TORCH_CHECK(fits, "a key or value beyond float16's range (|x| > 65504) for the float16 KV cache: load the model "
                    "with --kv-cache model");
}

// The rows' keys and values written, then every (row, kv head) task attended, over cache buffers of T
template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, T* keys, T* values,
                 int64_t buffer_slots, const at::Tensor& write_blocks, const at::Tensor& write_slots,
                 const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& blocks, int64_t kv_heads,
                 double scale, at::Tensor& out) {
  write_rows(key, keys, write_blocks.data_ptr<int64_t>(), write_slots.data_ptr<int64_t>(), buffer_slots);
  write_rows(value, values, write_blocks.data_ptr<int64_t>(), write_slots.data_ptr<int64_t>(), buffer_slots);
  const int64_t rows = q.size(2), heads = q.size(1), dim = q.size(3);
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  int64_t width = 0;
  for (int64_t r = 0; r < rows; ++r) width = std::max(width, ptr[r + 1] - ptr[r]);
  const Operands<T> o{q.data_ptr<float>(), q.stride(2), q.stride(1), keys, values, buffer_slots, ptr,
                      indices.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), kv_heads, heads / kv_heads, dim,
                      width, static_cast<float>(scale), out.data_ptr<float>()};
  const int64_t tasks = rows * kv_heads;
  const int64_t grain = indices.size(0) * heads < kParallelWork ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(o);
    for (int64_t task = begin; task < end; ++task) attend_task(o, task / kv_heads, task % kv_heads, scratch);
  });
}

}  // namespace

namespace {

// The argument checks of exact_attention but the plan's (check_plan, which reads every index)
void check_operands(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& keys,
                    const at::Tensor& values) {
  for (const auto* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "exact_attention reads float32 queries, keys and values");
  TORCH_CHECK((keys.scalar_type() == at::kHalf || keys.scalar_type() == at::kFloat) &&
                  values.scalar_type() == keys.scalar_type(),
              "exact_attention's cache buffers: float32 or float16, both alike");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1,
              "query, key, value: [1, heads, rows, dim]");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous(),
              "keys, values: contiguous [blocks, slots, dim]");
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3), kv_heads = key.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && key.size(2) == rows && key.size(3) == dim && value.sizes() == key.sizes() &&
                  keys.size(2) == dim, "query, key and value shapes do not agree with the buffers");
}

// exact_attention once its arguments and plan are checked
at::Tensor attend_checked(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                          const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                          const at::Tensor& blocks, double scale) {
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3), kv_heads = key.size(1);
  const auto q = query.stride(3) == 1 ? query : query.contiguous();
  auto out = at::empty({rows, heads * dim}, query.options());
  if (keys.scalar_type() == at::kHalf)
    attend_rows(q, key, value, reinterpret_cast<uint16_t*>(keys.data_ptr<at::Half>()),
                reinterpret_cast<uint16_t*>(values.data_ptr<at::Half>()), keys.size(1), write_blocks, write_slots,
                indptr, indices, blocks, kv_heads, scale, out);
  else
    attend_rows(q, key, value, keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(1), write_blocks,
                write_slots, indptr, indices, blocks, kv_heads, scale, out);
  return out;
}

}  // namespace

// query [1, heads, rows, dim] (rows and heads at any strides, dim contiguous); key, value [1, kv_heads, rows, dim],
// written first into keys/values [blocks, slots, dim] (contiguous float32 or float16 buffers: one sequence's cache
// layer viewed as [kv_heads, capacity, dim], or a pool's [sequences * kv_heads, capacity, dim]) at block
// write_blocks[r] + h and slot write_slots[r] (rounded to float16 there); then row r's query head j = h * groups + g
// attends block blocks[r] + h at the slots indices[indptr[r] : indptr[r + 1]] (ascending) -> float32
// [rows, heads * dim].
at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                           const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                           const at::Tensor& blocks, double scale) {
  check_operands(query, key, value, keys, values);
  check_plan(indptr, indices, blocks, write_blocks, write_slots, query.size(2), keys.size(0), keys.size(1),
             key.size(1));
  return attend_checked(query, key, value, keys, values, write_blocks, write_slots, indptr, indices, blocks, scale);
}

namespace {

// One int4 layer once its plan is checked: attention_inputs, the rows' keys and values written and attended
// exactly over the cache buffers, mlp_block (exact_layer and every layer of ExactLayerStack::forward)
at::Tensor planned_layer(const at::Tensor& hidden, const ExactLayerWeights& w, double eps, const at::Tensor& cos,
                         const at::Tensor& signed_sin, int64_t heads, int64_t kv_heads, int64_t dim,
                         const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                         const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                         const at::Tensor& blocks, double scale) {
  const auto inputs = attention_inputs(hidden, w.norm1, eps, w.qkv, w.bias, cos, signed_sin, heads, kv_heads, dim);
  check_operands(inputs[0], inputs[1], inputs[2], keys, values);
  const auto attended = attend_checked(inputs[0], inputs[1], inputs[2], keys, values, write_blocks, write_slots,
                                       indptr, indices, blocks, scale);
  return mlp_block(hidden, attended, w.norm2, eps, w.out, w.gate_up, w.down, w.intermediate);
}

}  // namespace

ExactLayerStack::ExactLayerStack(double eps, double scale, int64_t heads, int64_t kv_heads, int64_t dim)
    : eps_(eps), scale_(scale), heads_(heads), kv_heads_(kv_heads), dim_(dim) {}

void ExactLayerStack::add(const at::Tensor& norm1, const std::vector<std::vector<at::Tensor>>& qkv,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& norm2,
                          const std::vector<std::vector<at::Tensor>>& out,
                          const std::vector<std::vector<at::Tensor>>& gate_up,
                          const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate) {
  layers_.push_back(ExactLayerWeights{norm1, qkv, bias, norm2, out, gate_up, down, intermediate});
}

// The plan is checked once, against the first layer's buffers, which every layer's must equal in shape.
at::Tensor ExactLayerStack::forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& signed_sin,
                                    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                    const at::Tensor& write_blocks, const at::Tensor& write_slots,
                                    const at::Tensor& indptr, const at::Tensor& indices,
                                    const at::Tensor& blocks) const {
  TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "one key and value buffer per layer");
  TORCH_CHECK(!layers_.empty(), "a stack without layers");
  for (size_t i = 0; i < layers_.size(); ++i)
    TORCH_CHECK(keys[i].sizes() == keys[0].sizes() && values[i].sizes() == keys[0].sizes(),
                "every layer's key and value buffers alike in shape");
  check_plan(indptr, indices, blocks, write_blocks, write_slots, hidden.size(0), keys[0].size(0), keys[0].size(1),
             kv_heads_);
  for (size_t i = 0; i < layers_.size(); ++i)
    hidden = planned_layer(hidden, layers_[i], eps_, cos, signed_sin, heads_, kv_heads_, dim_, keys[i], values[i],
                           write_blocks, write_slots, indptr, indices, blocks, scale_);
  return hidden;
}

// One int4 layer with exact attention: its plan checked, then planned_layer.
at::Tensor exact_layer(const at::Tensor& hidden, const at::Tensor& norm1, double eps,
                       const std::vector<std::vector<at::Tensor>>& qkv, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                       int64_t dim, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& write_blocks,
                       const at::Tensor& write_slots, const at::Tensor& indptr, const at::Tensor& indices,
                       const at::Tensor& blocks, double scale, const at::Tensor& norm2,
                       const std::vector<std::vector<at::Tensor>>& out,
                       const std::vector<std::vector<at::Tensor>>& gate_up,
                       const std::vector<std::vector<at::Tensor>>& down, int64_t intermediate) {
  TORCH_CHECK(keys.dim() == 3, "keys, values: contiguous [blocks, slots, dim]");
  check_plan(indptr, indices, blocks, write_blocks, write_slots, hidden.size(0), keys.size(0), keys.size(1), kv_heads);
  return planned_layer(hidden, ExactLayerWeights{norm1, qkv, bias, norm2, out, gate_up, down, intermediate}, eps, cos,
                       signed_sin, heads, kv_heads, dim, keys, values, write_blocks, write_slots, indptr, indices,
                       blocks, scale);
}
