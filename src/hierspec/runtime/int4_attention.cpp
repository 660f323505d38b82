// Exact tree attention on float32 or float16 caches, and an int4 layer around it, each one call from Python (see
// exact_attention.py for what "exact" means and int4_kernel.py for the build).
//
// exact_attention.py's numba kernel costs ~17 us for a one-row SmolLM2 layer, but its Python call (query copy, cache
// write, array views, numba's argument checks) another ~50 us, 30 times a forward (~1.5 ms of a ~13 ms step on an
// Intel Xeon), and it runs on one thread. Here the rows' keys and values are written into the cache buffer, then
// the call's (block of rows, key/value head, query) units are cut into one equal run a thread (share_out), each run
// attending its queries' slots a (block, head) piece at a time. A piece's rows read the slots they all attend once
// between them (a tree's rows share the cached context: 16 rows over 1,024 float16 keys, 30 SmolLM2 layers, 31 -> 22
// ms on a Zen 3), but each row's arithmetic is its own:
// every loop runs over its row's own key sequence (length and order the same alone, in a chain or anywhere in a
// tree), so a row's result is bit-identical whatever the other rows and whichever thread runs it. The results are not
// the numba kernel's bits (other reduction orders): the int4 decoder uses this kernel on every forward where the
// extension loads, so its methods and its plain decoding agree. A float16 cache (the int4 path's default) halves what
// each attended entry costs to read: with 8 sequences of ~500 entries a step reads more cache than weights. Entries
// are rounded once, when written, and every reader widens the same stored values.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "int4_layers.h"
#include "int4_team.h"
#include "int4_vectors.h"

namespace {

using hierspec_int4::kLanes;
using hierspec_int4::load;
using hierspec_int4::exp_vector;
using hierspec_int4::fmadd;
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

// Rows are attended in blocks, one key/value head at a time: a block is a few rows of one sequence (one cache block)
// and the count of leading slots every one of them attends alike (a tree's rows share the whole cached context). A
// block's shared keys and values are read, and widened, once for all its rows' query heads; each row then reads its
// own remaining entries. Every (row, query head) takes exactly its own operations in its own order wherever the
// split falls — each key's score one chain over dim, the weighted values one chain over the row's keys in order — so
// which rows share a block never changes a bit.
struct RowBlock {
  int64_t first, last, shared;  // rows [first, last), their first `shared` slots alike
};

// keys (values) of a block read per tile, which stays in the first-level cache while every query takes it
constexpr int64_t kTileBytes = 16 * 1024;
// queries scored together over each key, as many as the vector registers hold beside their accumulators
constexpr int kQueryBlock = kLanes == 16 ? 12 : 6;
// queries weighing each value together (by four vectors of dim: accumulators, the values, a broadcast weight)
constexpr int kWeighBlock = kLanes == 16 ? 4 : 2;
// entries fetched ahead of the one read: a block's slots need not be adjacent in memory, so the hardware's own
// prefetch may not see them coming (one row over 1,024 float16 keys, 30 layers: ~10 % faster)
constexpr int64_t kPrefetchKeys = 32;

template <typename T>
inline void prefetch_entry(const T* entry, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(entry);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
}

// rows in a block at most, so that a block's score lines stay in the second-level cache
constexpr int64_t kBlockRows = 16;

// One thread's scratch, kept between calls: a score (then weight) line per query of a block (width + 2 kLanes
// floats: a part writes whole vectors from its first key on), and the block's cache entry, query, output and line
// addresses
template <typename T>
struct Scratch {
  std::vector<float> scores, totals;
  std::vector<const T*> keys, values, own_keys, own_values;  // the shared slots'; every row's own, row after row
  std::vector<const float*> queries;
  std::vector<float*> outs, lines, parts;
  int64_t stride = 0;
  void fit(int64_t queries_, int64_t width) {
    stride = width + 2 * kLanes;
    if (static_cast<int64_t>(scores.size()) < queries_ * stride) scores.resize(queries_ * stride);
    totals.resize(queries_);
    queries.resize(queries_);
    outs.resize(queries_);
    lines.resize(queries_);
    parts.resize(queries_);
  }
};

template <typename T>
Scratch<T>& thread_scratch() {
  thread_local Scratch<T> scratch;
  return scratch;
}

// Cache entries a kernel reads: a list of entry addresses (slots anywhere) or a run of consecutive slots (Strided);
// entries[j] is entry j's address and entries + j the entries from j on, either way
template <typename T>
struct Strided {
  const T* base;
  int64_t stride;  // elements from one entry to the next
  const T* operator[](int64_t j) const { return base + j * stride; }
  Strided operator+(int64_t j) const { return {base + j * stride, stride}; }
};

// the element type of entries E (float, or uint16_t for float16)
template <typename E>
using EntryOf = std::remove_cv_t<std::remove_pointer_t<std::decay_t<decltype(std::declval<const E&>()[0])>>>;

// QB queries' lane partials of kLanes keys at a time (key t: keys[min(j0 + t, count - 1)], so that a last partial
// block repeats the last key) and their lane_sums into lines[g] + j0: each key's vectors multiplied lane-wise with
// each query's over the whole vectors of dim in order. C is the count of whole vectors of dim when it is known at
// compile time (0: read it from `chunks`). A query's operations are the same whichever queries are beside it.
template <int QB, int C, typename E>
void score_batch(const float* const* q, const E& keys, int64_t count, int64_t chunks, float* const* lines) {
  const int64_t n = C > 0 ? C : chunks;
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    vf part[QB][kLanes];
    for (int64_t t = 0; t < kLanes; ++t) {
      const auto* key = keys[std::min(j0 + t, count - 1)];
      prefetch_entry(keys[std::min(j0 + t + kPrefetchKeys, count - 1)], n * kLanes);
      vf sum[QB] = {};
      for (int64_t c = 0; c < n; ++c) {
        const vf k = load(key + c * kLanes);
        for (int g = 0; g < QB; ++g) sum[g] = fmadd(load(q[g] + c * kLanes), k, sum[g]);
      }
      for (int g = 0; g < QB; ++g) part[g][t] = sum[g];
    }
    for (int g = 0; g < QB; ++g) {
      const vf sums = lane_sums(part[g]);
      std::memcpy(lines[g] + j0, &sums, sizeof sums);
    }
  }
}

template <int QB, typename E>
void score_sized(const float* const* q, const E& keys, int64_t count, int64_t chunks, float* const* lines) {
  if (chunks == 64 / kLanes) score_batch<QB, 64 / kLanes>(q, keys, count, chunks, lines);
  else if (chunks == 128 / kLanes) score_batch<QB, 128 / kLanes>(q, keys, count, chunks, lines);
  else score_batch<QB, 0>(q, keys, count, chunks, lines);
}

template <int QB = kQueryBlock, typename E>
void score_some(int64_t size, const float* const* q, const E& keys, int64_t count, int64_t chunks,
                float* const* lines) {
  if constexpr (QB > 0) {
    if (size == QB) score_sized<QB>(q, keys, count, chunks, lines);
    else score_some<QB - 1>(size, q, keys, count, chunks, lines);
  }
}

// lines[g][j] = q_g · key j for `count` keys at `keys[j]` and `queries` queries: tiles of keys, each taken by every
// block of queries, kLanes keys at a time (a last partial block repeats its last key, so the line's entries up to
// whole vectors past `count` are copies of the last key's score), then the tail of dim in order.
template <typename E>
void score_queries(const float* const* q, int64_t queries, const E& keys, int64_t count, int64_t dim,
                   float* const* lines) {
  const int64_t chunks = dim / kLanes, whole = chunks * kLanes;
  const int64_t tile = std::max<int64_t>(kLanes, kTileBytes / (dim * sizeof(EntryOf<E>)) / kLanes * kLanes);
  float* tile_lines[kQueryBlock];
  for (int64_t j0 = 0; j0 < count; j0 += tile) {
    const int64_t n = std::min(tile, count - j0);
    for (int64_t g0 = 0; g0 < queries; g0 += kQueryBlock) {
      const int64_t size = std::min<int64_t>(kQueryBlock, queries - g0);
      for (int64_t g = 0; g < size; ++g) tile_lines[g] = lines[g0 + g] + j0;
      score_some(size, q + g0, keys + j0, n, chunks, tile_lines);
    }
  }
  for (int64_t g = 0; whole < dim && g < queries; ++g)
    for (int64_t j = 0; j < padded(count); ++j) {
      const auto* key = keys[std::min(j, count - 1)];
      float total = lines[g][j];
      // std::fma: one rounding each, whichever the entry type (gcc contracted only the float32 form)
      for (int64_t i = whole; i < dim; ++i) total = std::fma(q[g][i], widen(key[i]), total);
      lines[g][j] = total;
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

// out_g += sum_j weights[g][j] * value j over `count` values, for GB queries and CB vectors of dim from `offset`,
// the sums carried on from out_g where `resume`, else from 0: each element a chain of multiply-adds over the keys in
// order, the chains of GB x CB accumulators side by side.
template <int GB, int CB, typename E>
void weigh_panel(const float* const* weights, const E& values, int64_t count, int64_t offset, bool resume,
                 float* const* out) {
  vf acc[GB][CB];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CB; ++c) acc[g][c] = resume ? load(out[g] + offset + c * kLanes) : vf{};
  for (int64_t j = 0; j < count; ++j) {
    __builtin_prefetch(values[std::min(j + kPrefetchKeys, count - 1)] + offset);
    vf v[CB];
    for (int c = 0; c < CB; ++c) v[c] = load(values[j] + offset + c * kLanes);
    for (int g = 0; g < GB; ++g) {
      const vf w = vf{} + weights[g][j];
      for (int c = 0; c < CB; ++c) acc[g][c] = fmadd(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CB; ++c) std::memcpy(out[g] + offset + c * kLanes, &acc[g][c], sizeof(vf));
}

// weigh_panel over dim's whole vectors: panels of four vectors, then one at a time
template <int GB, typename E>
void weigh_dim(const float* const* w, const E& values, int64_t count, int64_t whole, bool resume,
               float* const* out) {
  int64_t offset = 0;
  for (; offset + 4 * kLanes <= whole; offset += 4 * kLanes)
    weigh_panel<GB, 4>(w, values, count, offset, resume, out);
  for (; offset < whole; offset += kLanes) weigh_panel<GB, 1>(w, values, count, offset, resume, out);
}

template <int GB = kWeighBlock, typename E>
void weigh_some(int64_t size, const float* const* w, const E& values, int64_t count, int64_t whole,
                bool resume, float* const* out) {
  if constexpr (GB > 0) {
    if (size == GB) weigh_dim<GB>(w, values, count, whole, resume, out);
    else weigh_some<GB - 1>(size, w, values, count, whole, resume, out);
  }
}

// out[g] (+)= sum_j weights[g][j] * value j for `queries` queries over `count` values (unnormalised; carried on
// from out[g] where `resume`): tiles of values, each taken by every block of queries, then the tail of dim element by
// element (the same chain, scalar).
template <typename E>
void weigh_queries(float* const* weights, int64_t queries, const E& values, int64_t count, int64_t dim,
                   bool resume, float* const* out) {
  const int64_t whole = dim - dim % kLanes;
  const int64_t tile = std::max<int64_t>(1, kTileBytes / (dim * sizeof(EntryOf<E>)));
  const float* tile_weights[kWeighBlock];
  for (int64_t j0 = 0; j0 < count; j0 += tile) {
    const int64_t n = std::min(tile, count - j0);
    for (int64_t g0 = 0; g0 < queries; g0 += kWeighBlock) {
      const int64_t size = std::min<int64_t>(kWeighBlock, queries - g0);
      for (int64_t g = 0; g < size; ++g) tile_weights[g] = weights[g0 + g] + j0;
      weigh_some(size, tile_weights, values + j0, n, whole, resume || j0 > 0, out + g0);
    }
  }
  for (int64_t g = 0; g < queries; ++g)
    for (int64_t i = whole; i < dim; ++i) {
      float total = resume ? out[g][i] : 0.f;
      for (int64_t j = 0; j < count; ++j) total = std::fma(weights[g][j], widen(values[j][i]), total);
      out[g][i] = total;
    }
}

// The cache addresses of `count` slots of cache block `block`, appended to keys and values
template <typename T>
void add_entries(const Operands<T>& o, int64_t block, const int64_t* slots, int64_t count,
                 std::vector<const T*>& keys, std::vector<const T*>& values) {
  for (int64_t j = 0; j < count; ++j) {
    keys.push_back(o.keys + (block + slots[j]) * o.dim);
    values.push_back(o.values + (block + slots[j]) * o.dim);
  }
}

// Queries [begin, end) of block b for key/value head `head` (query i is row b.first + i / groups's query head
// head * groups + i % groups): softmax(scale * q · k) · v over each query's row's slots — the shared slots scored and
// weighed for all the queries at once, then each row's own slots for its queries.
template <typename T>
void attend_block(const Operands<T>& o, const RowBlock& b, int64_t head, int64_t begin, int64_t end, Scratch<T>& s) {
  const int64_t groups = o.groups, dim = o.dim, queries = end - begin;
  s.fit(queries, o.width);
  const auto row_of = [&](int64_t i) { return b.first + (begin + i) / groups; };
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t r = row_of(i), j = head * groups + (begin + i) % groups;
    s.queries[i] = o.query + r * o.query_row + j * o.query_head;
    s.outs[i] = o.out + r * (o.kv_heads * groups * dim) + j * dim;
    s.lines[i] = s.scores.data() + i * s.stride;
    s.parts[i] = s.lines[i] + b.shared;
  }
  const int64_t block = (o.blocks[b.first] + head) * o.slots;
  // the rows these queries belong to: [first_row, last_row)
  const int64_t first_row = row_of(0), last_row = row_of(queries - 1) + 1;
  const auto own = [&](int64_t r) { return o.indptr[r + 1] - o.indptr[r] - b.shared; };
  // where row r's own entries start among those rows' own entries
  const auto own_start = [&](int64_t r) { return o.indptr[r] - o.indptr[first_row] - (r - first_row) * b.shared; };
  // row r's queries among [0, queries): [first, last)
  const auto row_queries = [&](int64_t r) {
    const int64_t at = (r - b.first) * groups - begin;
    return std::pair{std::max<int64_t>(at, 0), std::min(at + groups, queries)};
  };
  for (auto* list : {&s.own_keys, &s.own_values}) list->clear();
  for (int64_t r = first_row; r < last_row; ++r)
    add_entries(o, block, o.indices + o.indptr[r] + b.shared, own(r), s.own_keys, s.own_values);
  // the shared slots scored, each row's own ones, the softmax, then the values weighed alike
  const auto attend = [&](const auto& keys, const auto& values) {
    score_queries(s.queries.data(), queries, keys, b.shared, dim, s.lines.data());
    for (int64_t r = first_row; r < last_row; ++r) {
      const auto [lo, hi] = row_queries(r);
      score_queries(s.queries.data() + lo, hi - lo, s.own_keys.data() + own_start(r), own(r), dim,
                    s.parts.data() + lo);
    }
    for (int64_t i = 0; i < queries; ++i) {
      // past the row's last key, to whole vectors: copies of its score (the same bits its own block would give)
      const int64_t count = b.shared + own(row_of(i));
      std::fill(s.lines[i] + count, s.lines[i] + padded(count), s.lines[i][count - 1]);
      s.totals[i] = softmax_weights(s.lines[i], o.scale, count);
    }
    weigh_queries(s.lines.data(), queries, values, b.shared, dim, false, s.outs.data());
    for (int64_t r = first_row; r < last_row; ++r) {
      const auto [lo, hi] = row_queries(r);
      weigh_queries(s.parts.data() + lo, hi - lo, s.own_values.data() + own_start(r), own(r), dim, b.shared > 0,
                    s.outs.data() + lo);
    }
  };
  // a sequence's cached context is one run of slots: read at a stride, with no list of addresses (a row's slots are
  // ascending, so a first and last slot count - 1 apart hold every slot between them in order)
  const int64_t* shared = o.indices + o.indptr[b.first];
  if (b.shared > 0 && shared[b.shared - 1] - shared[0] == b.shared - 1) {
    const int64_t first = (block + shared[0]) * dim;
    attend(Strided<T>{o.keys + first, dim}, Strided<T>{o.values + first, dim});
  } else {
    s.keys.clear();
    s.values.clear();
    add_entries(o, block, shared, b.shared, s.keys, s.values);
    attend(s.keys.data(), s.values.data());
  }
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t d = 0; d < dim; ++d) s.outs[i][d] = s.outs[i][d] / s.totals[i];
}

// Each sequence's rows (consecutive rows of one cache block) in blocks of at most kBlockRows rows, with the count of
// leading slots all of a block's rows attend alike
std::vector<RowBlock> row_blocks(const int64_t* ptr, const int64_t* indices, const int64_t* blocks, int64_t rows) {
  std::vector<RowBlock> out;
  for (int64_t first = 0; first < rows;) {
    int64_t end = first + 1;
    while (end < rows && blocks[end] == blocks[first]) ++end;
    const int64_t count = (end - first + kBlockRows - 1) / kBlockRows;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t a = first + (end - first) * k / count, z = first + (end - first) * (k + 1) / count;
      int64_t shared = ptr[a + 1] - ptr[a];
      for (int64_t r = a + 1; r < z; ++r) {
        const int64_t* row = indices + ptr[r];
        shared = std::mismatch(indices + ptr[a], indices + ptr[a] + std::min(shared, ptr[r + 1] - ptr[r]), row).first -
                 (indices + ptr[a]);
      }
      out.push_back(RowBlock{a, z, shared});
    }
    first = end;
  }
  return out;
}

// Part of a thread's share of a call: key/value head `head` of row block `block`, its queries [begin, end)
struct Piece {
  int64_t block, head, begin, end;
};

// Every (row block, key/value head, query) of a call, in that order, cut into `threads` runs of equal length (to a
// query): each thread reads about the same keys and values and scores about as many queries, whatever the count of
// key/value heads (three SmolLM2 heads on two threads: one row's 9 queries as 5 and 4, not as two heads and one)
std::vector<std::vector<Piece>> share_out(const std::vector<RowBlock>& row_set, int64_t kv_heads, int64_t groups,
                                          int64_t threads) {
  int64_t total = 0;
  for (const auto& b : row_set) total += kv_heads * (b.last - b.first) * groups;
  std::vector<std::vector<Piece>> shares(threads);
  int64_t at = 0;  // units before the current (block, head)
  for (int64_t k = 0; k < static_cast<int64_t>(row_set.size()); ++k) {
    const int64_t queries = (row_set[k].last - row_set[k].first) * groups;
    for (int64_t h = 0; h < kv_heads; ++h, at += queries)
      for (int64_t t = 0; t < threads; ++t) {
        const int64_t lo = std::max(total * t / threads - at, int64_t{0});
        const int64_t hi = std::min(total * (t + 1) / threads - at, queries);
        if (lo < hi) shares[t].push_back(Piece{k, h, lo, hi});
      }
  }
  return shares;
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
  const auto row_set = row_blocks(ptr, o.indices, o.blocks, rows);
  const int64_t threads = indices.size(0) * heads < kParallelWork ? 1 : at::get_num_threads();
  const auto shares = share_out(row_set, kv_heads, heads / kv_heads, threads);
  hierspec_team::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    auto& scratch = thread_scratch<T>();
    for (int64_t t = begin; t < end; ++t)
      for (const auto& piece : shares[t])
        attend_block(o, row_set[piece.block], piece.head, piece.begin, piece.end, scratch);
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
  auto out = hierspec_scratch::tensor(hierspec_scratch::kAttended, {rows, heads * dim}, query.options());
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

// A layer's projections in the order the forward multiplies them
std::array<const std::vector<std::vector<at::Tensor>>*, 4> projections(const ExactLayerWeights& w) {
  return {&w.qkv, &w.out, &w.gate_up, &w.down};
}

// A layer's integer products' weights, the helper's share of each, queued to be fetched in the order the forward
// reads them (int4_team.h).
void warm_layer(const ExactLayerWeights& w) {
  for (const auto* projection : projections(w))
    for (const auto& stack : *projection) warm_helper_share(stack);
}

// Whether every product of the layer runs on the integer kernels, whose threads the team shares out (int4_vnni.cpp;
// another kernel inside a team would run on one thread).
bool integer_products(const ExactLayerWeights& w) {
  for (const auto* projection : projections(w))
    for (const auto& stack : *projection)
      if (stack.empty() || stack[0].is_mkldnn() || stack[0].dim() != 6) return false;
  return true;
}

}  // namespace

ExactLayerStack::ExactLayerStack(double eps, double scale, int64_t heads, int64_t kv_heads, int64_t dim, bool team)
    : eps_(eps), scale_(scale), heads_(heads), kv_heads_(kv_heads), dim_(dim), team_(team) {}

bool ExactLayerStack::runs_as_team(int64_t rows) const {
  return team_ && rows <= kTeamRows && !layers_.empty() &&
         std::all_of(layers_.begin(), layers_.end(), integer_products);
}

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
  // the layers' tensors reused from the last forward (int4_scratch.h), unless another thread's forward holds them
  std::unique_lock<std::mutex> arena(arena_mutex_, std::try_to_lock);
  // each layer's weights queued a layer ahead: fetched while the layer before runs its one-thread parts
  const auto layers = [&] {
    std::optional<hierspec_scratch::Using> reused;
    if (arena.owns_lock()) reused.emplace(arena_);
    warm_layer(layers_[0]);
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (i + 1 < layers_.size()) warm_layer(layers_[i + 1]);
      hidden = planned_layer(hidden, layers_[i], eps_, cos, signed_sin, heads_, kv_heads_, dim_, keys[i], values[i],
                             write_blocks, write_slots, indptr, indices, blocks, scale_);
    }
  };
  if (runs_as_team(hidden.size(0))) hierspec_team::with_team(layers);
  else layers();
  return arena.owns_lock() ? hidden.clone() : hidden;  // the arena's tensor is the next forward's
}

// One verification forward of a breadth-first tree (tokens, parents, depths: int64 [n], parents[0] = -1 and every
// other parent an earlier node) in `rows` >= n rows over `past` cached entries, whose keys and values go to slots
// past .. past + rows - 1: each row's token and position (padding rows repeat the root's token and position, as
// TreeInputs writes them), its embedding row and rotation rows copied from the tables, the attention plan
// (ExactPlan.of_tree's: row r attends slots 0 .. past - 1, then past + each node on its path from the root; a padding
// row past + r alone), every layer (forward), then the final norm of the tree's n rows and the head -> {logits
// [n, vocab], the normed rows [n, hidden]}. The decoder's own operations in one call instead of ~30 Python-level
// steps around the stack (BENCHMARKS.md, "Seventy-first session").
std::vector<at::Tensor> ExactLayerStack::step(const at::Tensor& embedding, const at::Tensor& tokens,
                                              const at::Tensor& parents, const at::Tensor& depths, int64_t past,
                                              int64_t rows, const at::Tensor& cos_table, const at::Tensor& sin_table,
                                              const std::vector<at::Tensor>& keys,
                                              const std::vector<at::Tensor>& values, const at::Tensor& final_norm,
                                              const std::vector<std::vector<at::Tensor>>& head,
                                              const c10::optional<at::Tensor>& head_bias) const {
  for (const auto& [t, name] : {std::pair{&tokens, "tokens"}, {&parents, "parents"}, {&depths, "depths"}})
    check_int64(*t, name);
  const int64_t n = tokens.size(0);
  TORCH_CHECK(n >= 1 && rows >= n && past >= 0 && parents.size(0) == n && depths.size(0) == n,
              "step: a tree of n >= 1 nodes (tokens, parents, depths alike) in rows >= n");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat && embedding.is_contiguous(),
              "step: a contiguous float32 embedding table");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == dim_ && sin_table.sizes() == cos_table.sizes() &&
                  cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous(),
              "step: contiguous float32 rotation tables [positions, head_dim]");
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* parent = parents.data_ptr<int64_t>();
  const int64_t* depth = depths.data_ptr<int64_t>();
  TORCH_CHECK(parent[0] == -1, "step: the root's parent must be -1");
  for (int64_t i = 1; i < n; ++i) TORCH_CHECK(parent[i] >= 0 && parent[i] < i, "step: parents must precede children");
  const int64_t vocab = embedding.size(0), width = embedding.size(1), positions = cos_table.size(0);
  const auto longs = at::TensorOptions().dtype(at::kLong);
  auto hidden = at::empty({rows, width}, embedding.options());
  auto cos = at::empty({1, 1, rows, dim_}, cos_table.options());
  auto sin = at::empty({1, 1, rows, dim_}, sin_table.options());
  auto write_slots = at::empty({rows}, longs);
  auto indptr = at::empty({rows + 1}, longs);
  int64_t* ptr = indptr.data_ptr<int64_t>();
  ptr[0] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    // a row's path: the root's depth 0 up to its own (the plan's depths, from the parents alone)
    int64_t steps = 0;
    for (int64_t node = r < n ? r : -1; node > 0; node = parent[node]) ++steps;
    ptr[r + 1] = ptr[r] + past + (r < n ? steps + 1 : 1);
  }
  auto indices = at::empty({ptr[rows]}, longs);
  int64_t* slot = indices.data_ptr<int64_t>();
  int64_t* written = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t id = r < n ? token[r] : token[0], position = past + (r < n ? depth[r] : 0);
    TORCH_CHECK(id >= 0 && id < vocab, "step: a token outside the embedding table");
    TORCH_CHECK(position >= 0 && position < positions, "step: a position beyond the rotation tables");
    std::memcpy(hidden.data_ptr<float>() + r * width, embedding.data_ptr<float>() + id * width, width * sizeof(float));
    std::memcpy(cos.data_ptr<float>() + r * dim_, cos_table.data_ptr<float>() + position * dim_, dim_ * sizeof(float));
    std::memcpy(sin.data_ptr<float>() + r * dim_, sin_table.data_ptr<float>() + position * dim_, dim_ * sizeof(float));
    written[r] = past + r;
    int64_t* row = slot + ptr[r];
    for (int64_t j = 0; j < past; ++j) row[j] = j;
    int64_t end = ptr[r + 1] - ptr[r];
    if (r >= n) row[end - 1] = past + r;
    for (int64_t node = r < n ? r : -1; node >= 0; node = parent[node]) row[--end] = past + node;
  }
  const auto zeros = at::zeros({rows}, longs);
  hidden = forward(hidden, cos, sin, keys, values, zeros, write_slots, indptr, indices, zeros);
  const auto last = rms_norm(hidden.narrow(0, 0, n), final_norm, eps_);
  return {project_stacks(last, head, head_bias), last};
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
