// hierspec's quantized products on AMX tiles (Intel CPUs with AMX-BF16): 16 rows for little more than one.
//
// A tile of 16 outputs by 32 inputs is decoded once to bfloat16 weights (each code's scale and offset applied in
// float32, then rounded to nearest even) and multiplied with up to 16 rows (rounded to bfloat16) by one tile
// instruction (TDPBF16PS: bfloat16 pairs summed in float32). The weights are the left operand (a row per output),
// the inputs the right one (a column per row), and an output block's products accumulate inside two tiles over all
// its input steps (even and odd steps, added at the end), so that more rows add no vector work per step: decoding
// and streaming the weights dominate at 1 and 16 rows alike. (Before, the tiles multiplied the exact codes and every
// row's products were scaled per group in vector registers: a 16-row product cost ~1.6x a one-row one in a forward;
// BENCHMARKS.md, "Eighteenth session".)
//
// The layout, its two forms (4-bit and 8-bit codes) and their decoding are int4_tiles.h's, shared with the
// AVX512-BF16 dot products (int4_bf16.cpp); on an Intel Xeon float16 scales gained a forward only ~2 %, its
// products' stream being bound by more than its bytes (BENCHMARKS.md, "Twenty-second session").
//
// Batch invariance: the tile unit computes each output element from its own row of weights and column of inputs
// only, every element's steps accumulate in one fixed order, and the two tiles are added in one order, whatever the
// number of rows, how they are split into tiles or how the outputs are split between threads
// (tests/test_int4_kernel.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HIERSPEC_BF16_TILES)
#define HIERSPEC_AMX 1
#endif

namespace {

using hierspec_tiles::kBlock;
using hierspec_tiles::kDecoded;
using hierspec_tiles::kStep;
using hierspec_tiles::checked_tiles;
using hierspec_tiles::CodeLayout;
using hierspec_tiles::TileShape;
#ifdef HIERSPEC_AMX
using hierspec_tiles::bits;
using hierspec_tiles::Tiles;
using hierspec_tiles::with_form;
#endif

constexpr int64_t kTileCols = 16;  // rows of inputs per tile product: the right tile's columns

#ifdef HIERSPEC_AMX

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// A product's weights with the rows as the right tiles take them (prepare_inputs) and its output
template <typename S>
struct Operands : Tiles<S> {
  const uint32_t* inputs;  // bfloat16 pairs [steps, 16, padded rows]: the right tiles
  float* out;              // [rows, N]
  int64_t rows, padded;
};

// tiles 0, 1: products [16 outputs x cols float32] of a column tile's even and odd steps (2, 3: a second column
// tile's); 4, 5: decoded weights [16 outputs x 32 bfloat16] of even and odd steps; 6, 7: inputs [16 pairs x cols
// pairs]. Steps alternate between the tile sets so that one step's tile work can overlap the next one's.
void configure_tiles(int cols) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = t == 4 || t == 5 ? 64 : 4 * cols;
  }
  _tile_loadconfig(&config);
}

// a 16 x 16 float32 matrix in 16 registers, transposed in place
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// out[c0 + j, block's 16 outputs] = even[., j] + odd[., j] (the tiles hold an output per row, an input row per
// column): a column gathered for a few rows, the whole sum transposed in registers for more
template <class O>
inline void write_rows(const O& o, int64_t block, int64_t c0, int64_t count, float (*even)[16],
                       const float (*odd)[16]) {
  float* out = o.out + c0 * o.n + block * kBlock;
  if (count <= 4) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int64_t j = 0; j < count; ++j)
      _mm512_storeu_ps(out + j * o.n, _mm512_add_ps(_mm512_i32gather_ps(column, &even[0][j], 4),
                                                    _mm512_i32gather_ps(column, &odd[0][j], 4)));
    return;
  }
  __m512 sums[16];
  for (int r = 0; r < 16; ++r) sums[r] = _mm512_add_ps(_mm512_load_ps(even[r]), _mm512_load_ps(odd[r]));
  transpose16(sums);
  for (int64_t j = 0; j < count; ++j) _mm512_storeu_ps(out + j * o.n, sums[j]);
}

// Rows c0 .. c0 + count of one output block (one column tile, or two: count up to 32), step i's decoded weights
// read from tile_of(i) after decode_ahead(i) had its chance to decode steps ahead. Each column tile's even and odd
// steps go to tiles of their own, added at the end: the same operations for a row in either form.
template <int Tiles, class O, class TileOf, class DecodeAhead>
void block_rows(const O& o, int64_t block, int64_t c0, int64_t count, TileOf tile_of, DecodeAhead decode_ahead) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Tiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t stride = o.padded * 4;
  for (int64_t i = 0; i < o.steps; ++i) {
    decode_ahead(i);
    const uint32_t* inputs = o.inputs + i * 16 * o.padded + c0;
    // the tile intrinsics take their tile numbers as literals; one column tile alternates its input tiles too
    if (i & 1) {
      _tile_loadd(5, tile_of(i), 64);
      if constexpr (Tiles == 2) {
        _tile_loadd(6, inputs, stride);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, inputs + kTileCols, stride);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_loadd(7, inputs, stride);
        _tile_dpbf16ps(1, 5, 7);
      }
    } else {
      _tile_loadd(4, tile_of(i), 64);
      _tile_loadd(6, inputs, stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (Tiles == 2) {
        _tile_loadd(7, inputs + kTileCols, stride);
        _tile_dpbf16ps(2, 4, 7);
      }
    }
  }
  alignas(64) float even[16][16], odd[16][16];
  _tile_stored(0, even, 64);
  _tile_stored(1, odd, 64);
  write_rows(o, block, c0, std::min(count, kTileCols), even, odd);
  if constexpr (Tiles == 2) {
    _tile_stored(2, even, 64);
    _tile_stored(3, odd, 64);
    write_rows(o, block, c0 + kTileCols, count - kTileCols, even, odd);
  }
}

// rows that fit one tile: each step's codes decoded kAhead steps before their product into a ring of slots, so
// that the tile loads find them written back
constexpr int64_t kAhead = 4;
constexpr int64_t kSlots = 8;

// The codes, scales and biases are read once per forward, block after block: each step asks for the lines it will
// read 4-8 steps later (codes 2 KB ahead, scales and biases as many steps ahead), so memory is read while the tiles are
// decoded. Without it the 1-token products of a SmolLM2 forward streamed at ~9 GB/s where the LM head alone reaches
// ~30 (BENCHMARKS.md, "Seventeenth session"); with this kernel 2 KB ahead measured better than 1, 4 and 8 KB.
// Prefetching past a tensor's end is harmless. The helpers are forced inline: gcc 12 otherwise finds them free of
// side effects and deletes their calls, prefetches and all (it did, silently, in a first build of this kernel).
constexpr int64_t kPrefetchBytes = 2048;

__attribute__((always_inline)) inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* ahead = static_cast<const char*>(start);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

template <class Form>
__attribute__((always_inline)) inline void prefetch_ahead(const Operands<typename Form::Scale>& o, int64_t block,
                                                          int64_t step) {
  prefetch_lines(o.codes + (block * o.steps + step) * Form::kCodeBytes + kPrefetchBytes, Form::kCodeBytes);
  prefetch_lines(Form::scale_of(o, block, step) + kPrefetchBytes / 16, Form::kScaleBytes);
  if (o.bias != nullptr) prefetch_lines(Form::bias_of(o, block, step) + kPrefetchBytes / 16, Form::kScaleBytes);
}

uint16_t* aligned_scratch(std::vector<uint16_t>& storage, int64_t elements) {
  if (storage.size() < static_cast<size_t>(elements + 32)) storage.resize(static_cast<size_t>(elements + 32));
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

template <class Form>
void blocks_of_outputs(const Operands<typename Form::Scale>& o, int64_t begin, int64_t end) {
  thread_local std::vector<uint16_t> storage;
  const Form form;
  const int64_t steps = o.steps;
  configure_tiles(static_cast<int>(std::min(o.rows, kTileCols)));
  if (o.rows <= 2 * kTileCols) {  // a token, a tree, a few sequences' trees: decoded into a ring as they are used
    uint16_t* slots = aligned_scratch(storage, kSlots * kDecoded);
    auto slot = [&](int64_t i) { return slots + (i % kSlots) * kDecoded; };
    for (int64_t block = begin; block < end; ++block) {
      auto decode = [&](int64_t i) {
        prefetch_ahead<Form>(o, block, i);
        form.decode(o, block, i, slot(i));
      };
      for (int64_t i = 0; i < std::min(kAhead, steps); ++i) decode(i);
      auto ahead = [&](int64_t i) { if (i + kAhead < steps) decode(i + kAhead); };
      if (o.rows <= kTileCols) block_rows<1>(o, block, 0, o.rows, slot, ahead);
      else block_rows<2>(o, block, 0, o.rows, slot, ahead);
    }
  } else {  // many rows (a prompt, a large batch): the block's weights decoded once for all its column tiles
    uint16_t* tiles = aligned_scratch(storage, steps * kDecoded);
    auto tile = [&](int64_t i) { return tiles + i * kDecoded; };
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t i = 0; i < steps; ++i) form.decode(o, block, i, tile(i));
      for (int64_t c0 = 0; c0 < o.rows; c0 += 2 * kTileCols) {
        const int64_t count = std::min(2 * kTileCols, o.rows - c0);
        if (count > kTileCols) block_rows<2>(o, block, c0, count, tile, [](int64_t) {});
        else block_rows<1>(o, block, c0, count, tile, [](int64_t) {});
      }
    }
  }
  _tile_release();
}

// The rows as the right tiles take them: bfloat16 (round to nearest even) pairs [steps, 16, padded], pair r of
// step s of row m holding its inputs 32 s + 2 r and 32 s + 2 r + 1; padding rows are zero. Each step of up to 16
// rows is one 16 x 16 transpose of their pairs in registers (a scatter per row and step cost ~0.6 ms of a 16-row
// SmolLM2 forward).
void prepare_inputs(const float* x, int64_t rows, int64_t padded, int64_t steps, std::vector<uint32_t>& inputs) {
  inputs.assign(static_cast<size_t>(steps * 16 * padded), 0);
  for (int64_t m0 = 0; m0 < rows; m0 += 16) {
    const int64_t count = std::min<int64_t>(16, rows - m0);
    const __mmask16 written = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t s = 0; s < steps; ++s) {
      __m512 pairs[16];
      for (int64_t j = 0; j < 16; ++j) {
        const float* src = x + (m0 + j) * steps * kStep + s * kStep;
        pairs[j] = j < count ? _mm512_castsi512_ps(bits<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16),
                                                                                 _mm512_loadu_ps(src))))
                             : _mm512_setzero_ps();
      }
      transpose16(pairs);  // moves only: pairs[r] holds pair r of each row
      uint32_t* dst = inputs.data() + s * 16 * padded + m0;
      for (int r = 0; r < 16; ++r) _mm512_mask_storeu_epi32(dst + r * padded, written, _mm512_castps_si512(pairs[r]));
    }
  }
}

#endif  // HIERSPEC_AMX

}  // namespace

// Whether this build and this process can run the AMX products (compiled for a CPU with AMX-BF16, tiles granted).
bool amx_ready() {
#ifdef HIERSPEC_AMX
  return tiles_granted();
#else
  return false;
#endif
}

// x: float32 [M, K]; codes: uint8 [1, N / 16, K / 32, 256] (4-bit form) or int8 [1, N / 16, K / 32, 512] (8-bit
// form); scale: float32 or float16 [1, N / 16, K / 32, 16] or [1, N / 16, K / 16, 16]; bias: the scale's dtype
// [N / 16, K / 32, 16] for the 4-bit form, empty for the 8-bit one. Returns float32 [M, N].
at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(amx_ready(), "the AMX product is not available in this build or process");
  const TileShape shape = checked_tiles(x, codes, scale, bias, CodeLayout::kTiles);
  const int64_t rows = x.size(0), n = shape.blocks * kBlock;
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;  // nothing to multiply (and no tile of 0 columns to configure)
#ifdef HIERSPEC_AMX
  const int64_t cols = std::min(rows, kTileCols);
  const int64_t padded = (rows + cols - 1) / cols * cols;
  thread_local std::vector<uint32_t> inputs;
  prepare_inputs(x.data_ptr<float>(), rows, padded, shape.steps, inputs);
  // every block of the product, shared out between the threads
  with_form(shape, codes, scale, bias, n, [&](auto form, const auto& weights) {
    const Operands<typename decltype(form)::Scale> o{weights, inputs.data(), out.data_ptr<float>(), rows, padded};
    at::parallel_for(0, o.blocks, 4, [&](int64_t begin, int64_t end) {
      blocks_of_outputs<decltype(form)>(o, begin, end);
    });
  });
#endif
  return out;
}
