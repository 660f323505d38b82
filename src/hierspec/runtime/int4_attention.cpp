// Exact tree attention on float32 caches, and an int4 layer around it, each one call from Python (see
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

#include <ATen/Parallel.h>
#include <torch/extension.h>

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
using hierspec_int4::vf;

// below this many (row, key, head) triples a call runs on one thread: waking the pool costs more than it saves
constexpr int64_t kParallelWork = 4096;

// Cephes' expf: ln 2 split in two for the range reduction, the polynomial of e^r on |r| <= ln2 / 2
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpFloor = -87.f;  // below it exp leaves float32's normal range

using hierspec_int4::vi;

// exp(x) for x in [kExpFloor, 0], within ~1 ulp: n = floor(x log2 e + 1/2), r = x - n ln 2 in two parts, e^r by its
// polynomial, 2^n built in the exponent bits. Written once for vectors and once for single values with the same
// operations (floor as truncation less one where that rounded up: exact for these magnitudes).
inline vf exp_vector(vf x) {
  const vf floor_value = vf{} + kExpFloor;
  x = x < floor_value ? floor_value : x;
  const vf y = x * kLog2e + 0.5f;
  const vi truncated = __builtin_convertvector(y, vi);
  const vf t = __builtin_convertvector(truncated, vf);
  const vi whole = truncated - (y < t ? vi{} + 1 : vi{});
  const vf n = __builtin_convertvector(whole, vf);
  vf r = x - n * kLn2High;
  r = r - n * kLn2Low;
  const vf p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                1.6666665459e-1f) * r + 5.0000001201e-1f;
  const vi bits = (whole + 127) << 23;
  return ((r * r) * p + r + 1.f) * reinterpret_cast<const vf&>(bits);
}

inline float exp_single(float x) {
  x = x < kExpFloor ? kExpFloor : x;
  const float y = x * kLog2e + 0.5f;
  const int32_t truncated = static_cast<int32_t>(y);
  const int32_t whole = truncated - (y < static_cast<float>(truncated) ? 1 : 0);
  const float n = static_cast<float>(whole);
  float r = x - n * kLn2High;
  r = r - n * kLn2Low;
  const float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                   1.6666665459e-1f) * r + 5.0000001201e-1f;
  const int32_t bits = (whole + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return ((r * r) * p + r + 1.f) * power;
}

// line[j] = exp(line[j] - top) for every line[j] <= top: whole vectors, then the tail (which elements take which
// path depends on j and the count alone)
void exp_shifted(float* line, float top, int64_t count) {
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const vf e = exp_vector(load(line + j) - top);
    std::memcpy(line + j, &e, sizeof e);
  }
  for (; j < count; ++j) line[j] = exp_single(line[j] - top);
}

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

// a · b over dim elements: whole vectors into lanes, the lanes summed, then the tail
inline float dot(const float* a, const float* b, int64_t dim) {
  vf part{};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) part = load(a + i) * load(b + i) + part;
  float total = halving_sum(part);
  for (; i < dim; ++i) total = a[i] * b[i] + total;
  return total;
}

// Four keys' dot products with one query, each the very arithmetic of dot() (four independent chains in flight)
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t dim,
                 float* out) {
  vf p0{}, p1{}, p2{}, p3{};
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    const vf x = load(q + i);
    p0 = x * load(k0 + i) + p0;
    p1 = x * load(k1 + i) + p1;
    p2 = x * load(k2 + i) + p2;
    p3 = x * load(k3 + i) + p3;
  }
  float t0 = halving_sum(p0), t1 = halving_sum(p1), t2 = halving_sum(p2), t3 = halving_sum(p3);
  for (; i < dim; ++i) {
    t0 = q[i] * k0[i] + t0;
    t1 = q[i] * k1[i] + t1;
    t2 = q[i] * k2[i] + t2;
    t3 = q[i] * k3[i] + t3;
  }
  out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

// Everything a call's tasks read, as raw pointers and strides (float32, element units)
struct Operands {
  const float* query;  // row r, query head j: query + r * query_row + j * query_head
  int64_t query_row, query_head;
  const float* keys;  // block b, slot s: keys + (b * slots + s) * dim
  const float* values;
  int64_t slots;
  const int64_t* indptr;
  const int64_t* indices;
  const int64_t* blocks;
  int64_t kv_heads, groups, dim, width;
  float scale;
  float* out;  // [rows, heads * dim]
};

// Scratch of one thread: scores and weights of one row's keys per query head, the weighted sums
struct Scratch {
  std::vector<float> scores, weights, sums;
  explicit Scratch(const Operands& o)
      : scores(o.groups * o.width), weights(o.width), sums(o.groups * o.dim) {}
};

// Row `row`, key/value head `head`: softmax(scale * q · k) · v over the row's slots, for its `groups` query heads
void attend_task(const Operands& o, int64_t row, int64_t head, Scratch& s) {
  const int64_t start = o.indptr[row], count = o.indptr[row + 1] - start, dim = o.dim;
  const int64_t* slots = o.indices + start;
  const int64_t block = (o.blocks[row] + head) * o.slots;
  const float* keys = o.keys + block * dim;
  const float* values = o.values + block * dim;
  const int64_t whole = count - count % 4;
  for (int64_t g = 0; g < o.groups; ++g) {
    const float* q = o.query + row * o.query_row + (head * o.groups + g) * o.query_head;
    float* scores = s.scores.data() + g * o.width;
    for (int64_t j = 0; j < whole; j += 4)
      dot4(q, keys + slots[j] * dim, keys + slots[j + 1] * dim, keys + slots[j + 2] * dim,
           keys + slots[j + 3] * dim, dim, scores + j);
    for (int64_t j = whole; j < count; ++j) scores[j] = dot(q, keys + slots[j] * dim, dim);
    float top = scores[0] * o.scale;
    for (int64_t j = 0; j < count; ++j) {
      scores[j] *= o.scale;
      top = std::max(top, scores[j]);
    }
    exp_shifted(scores, top, count);
  }
  for (int64_t g = 0; g < o.groups; ++g) {
    const float* weights = s.scores.data() + g * o.width;
    float* sums = s.sums.data() + g * dim;
    std::fill(sums, sums + dim, 0.f);
    for (int64_t j = 0; j < whole; j += 4) {  // four weighted values per update of the sums
      const float *v0 = values + slots[j] * dim, *v1 = values + slots[j + 1] * dim;
      const float *v2 = values + slots[j + 2] * dim, *v3 = values + slots[j + 3] * dim;
      const float w0 = weights[j], w1 = weights[j + 1], w2 = weights[j + 2], w3 = weights[j + 3];
      for (int64_t d = 0; d < dim; ++d) sums[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
    }
    for (int64_t j = whole; j < count; ++j) {
      const float* v = values + slots[j] * dim;
      const float w = weights[j];
      for (int64_t d = 0; d < dim; ++d) sums[d] += w * v[d];
    }
    vf part{};
    int64_t j = 0;
    for (; j + kLanes <= count; j += kLanes) part = load(weights + j) + part;
    float total = halving_sum(part);
    for (; j < count; ++j) total += weights[j];
    float* out = o.out + row * (o.kv_heads * o.groups * dim) + (head * o.groups + g) * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = sums[d] / total;
  }
}

void check_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous(), name,
              ": a contiguous int64 vector");
}

// Every slot and block a call reads or writes is inside the buffers (a wrong plan fails here, not in memory)
void check_plan(const torch::Tensor& indptr, const torch::Tensor& indices, const torch::Tensor& blocks,
                const torch::Tensor& write_blocks, const torch::Tensor& write_slots, int64_t rows, int64_t buffers,
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

// rows_in [1, kv_heads, rows, dim] into buffer block write_blocks[r] + h, slot write_slots[r]
void write_rows(const torch::Tensor& rows_in, float* buffer, const int64_t* write_blocks, const int64_t* write_slots,
                int64_t slots) {
  const auto states = rows_in.stride(3) == 1 ? rows_in : rows_in.contiguous();
  const int64_t heads = states.size(1), rows = states.size(2), dim = states.size(3);
  const float* source = states.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(buffer + ((write_blocks[r] + h) * slots + write_slots[r]) * dim,
                  source + h * states.stride(1) + r * states.stride(2), dim * sizeof(float));
}

}  // namespace

// query [1, heads, rows, dim] (rows and heads at any strides, dim contiguous); key, value [1, kv_heads, rows, dim],
// written first into keys/values [blocks, slots, dim] (contiguous float32 buffers: one sequence's cache layer viewed
// as [kv_heads, capacity, dim], or a pool's [sequences * kv_heads, capacity, dim]) at block write_blocks[r] + h and
// slot write_slots[r]; then row r's query head j = h * groups + g attends block blocks[r] + h at the slots
// indices[indptr[r] : indptr[r + 1]] (ascending) -> float32 [rows, heads * dim].
torch::Tensor exact_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                              const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& write_blocks,
                              const torch::Tensor& write_slots, const torch::Tensor& indptr,
                              const torch::Tensor& indices, const torch::Tensor& blocks, double scale) {
  for (const auto* t : {&query, &key, &value, &keys, &values})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "exact_attention reads float32 tensors");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1,
              "query, key, value: [1, heads, rows, dim]");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous(),
              "keys, values: contiguous [blocks, slots, dim]");
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3), kv_heads = key.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && key.size(2) == rows && key.size(3) == dim && value.sizes() == key.sizes() &&
                  keys.size(2) == dim, "query, key and value shapes do not agree with the buffers");
  check_plan(indptr, indices, blocks, write_blocks, write_slots, rows, keys.size(0), keys.size(1), kv_heads);
  const auto q = query.stride(3) == 1 ? query : query.contiguous();
  write_rows(key, keys.data_ptr<float>(), write_blocks.data_ptr<int64_t>(), write_slots.data_ptr<int64_t>(),
             keys.size(1));
  write_rows(value, values.data_ptr<float>(), write_blocks.data_ptr<int64_t>(), write_slots.data_ptr<int64_t>(),
             keys.size(1));
  auto out = torch::empty({rows, heads * dim}, query.options());
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  int64_t width = 0;
  for (int64_t r = 0; r < rows; ++r) width = std::max(width, ptr[r + 1] - ptr[r]);
  const Operands o{q.data_ptr<float>(), q.stride(2), q.stride(1), keys.data_ptr<float>(), values.data_ptr<float>(),
                   keys.size(1), ptr, indices.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), kv_heads,
                   heads / kv_heads, dim, width, static_cast<float>(scale), out.data_ptr<float>()};
  const int64_t tasks = rows * kv_heads;
  const int64_t grain = indices.size(0) * heads < kParallelWork ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(o);
    for (int64_t task = begin; task < end; ++task) attend_task(o, task / kv_heads, task % kv_heads, scratch);
  });
  return out;
}

// One int4 layer with exact attention: attention_inputs, exact_attention over the cache buffers, mlp_block.
torch::Tensor exact_layer(const torch::Tensor& hidden, const torch::Tensor& norm1, double eps,
                          const std::vector<std::vector<torch::Tensor>>& qkv, const c10::optional<torch::Tensor>& bias,
                          const torch::Tensor& cos, const torch::Tensor& signed_sin, int64_t heads, int64_t kv_heads,
                          int64_t dim, const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& write_blocks, const torch::Tensor& write_slots,
                          const torch::Tensor& indptr, const torch::Tensor& indices, const torch::Tensor& blocks,
                          double scale, const torch::Tensor& norm2,
                          const std::vector<std::vector<torch::Tensor>>& out,
                          const std::vector<std::vector<torch::Tensor>>& gate_up,
                          const std::vector<std::vector<torch::Tensor>>& down, int64_t intermediate) {
  const auto inputs = attention_inputs(hidden, norm1, eps, qkv, bias, cos, signed_sin, heads, kv_heads, dim);
  const auto attended = exact_attention(inputs[0], inputs[1], inputs[2], keys, values, write_blocks, write_slots,
                                        indptr, indices, blocks, scale);
  return mlp_block(hidden, attended, norm2, eps, out, gate_up, down, intermediate);
}
