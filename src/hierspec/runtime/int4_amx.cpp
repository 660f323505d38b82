// hierspec's quantized products on AMX tiles (Intel CPUs with AMX-BF16): 16 rows for ~1.4x the time of one.
//
// The compiled and PyTorch products cost a vector multiply-add per weight per row, so a forward of 16 rows costs
// several one-row forwards on two cores. Here the codes of 16 outputs are decoded once to bfloat16 (the codes are
// small integers: exact) and multiplied with up to 16 rows by one tile instruction (TDPBF16PS: bfloat16 pairs summed
// in float32), so decoding and streaming the weight dominate until 16 rows, as they do for one.
//
// Two forms (PackedAmx in int4_kernel.py), a group being the inputs one scale covers:
//   4-bit: P passes of codes 0..15, groups of 32, a bias per group folded from the passes' offsets:
//       out[m, n] = sum_g (sum_p scale[p, n, g] * C[p, g][m, n] + bias[n, g] * xsum[m, g])
//     codes uint8 [P, N / 16, G, 256]: byte q of chunk h holds tile row h, element q in its low nibble and tile row
//     h + 8, element q in its high nibble, tile row r, element q being code[16 b + q / 2, 32 g + 2 r + q % 2] (the
//     tile's pair layout); scale float32 [P, N / 16, G, 16]; bias float32 [N / 16, G, 16].
//   8-bit (Q8_0, Q6_K): signed codes, groups of 16, no bias: out[m, n] = sum_g scale[n, g] * C[g][m, n]
//     codes int8 [1, N / 16, G, 256]: element q of tile row r is code[16 b + q / 2, 16 g + 2 r + q % 2]; scale
//     float32 [1, N / 16, G, 16].
// C[p, g] is the tile product of the rows' inputs of group g, rounded to bfloat16, with the decoded codes; xsum[m, g]
// sums row m's float32 inputs of group g.
//
// Batch invariance: the tile unit computes each output element from its own row and column only, and every row's
// float32 operations after it run in one fixed order (groups, then passes, then the bias), whatever the number of
// rows, how they are split into tiles or how the outputs are split between threads (tests/test_int4_kernel.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HIERSPEC_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 16;        // outputs per tile column block
constexpr int64_t kCodeBytes = 256;   // packed codes of one block and group, either form
constexpr int64_t kTileRows = 16;     // rows of inputs per tile product

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

// The 4-bit form: a 32-input group is one tile of 16 pairs, decoded through a table of bfloat16 0..15.
struct FourBit {
  static constexpr int64_t kInputs = 32;
  static constexpr int64_t kDecoded = 512;  // bfloat16 elements of a decoded tile
  const __m512i table;

  FourBit() : table(make_table()) {}

  static __m512i make_table() {  // twice over: vpermw reads five index bits
    alignas(64) uint16_t table[32];
    for (int i = 0; i < 32; ++i) {
      const float value = static_cast<float>(i % 16);
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      table[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers need no rounding
    }
    return _mm512_load_si512(table);
  }

  void decode(const uint8_t* src, uint16_t* dst) const {
    for (int h = 0; h < 8; ++h) {
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * h)));
      _mm512_store_si512(dst + 32 * h, _mm512_permutexvar_epi16(_mm512_and_si512(words, _mm512_set1_epi16(15)), table));
      _mm512_store_si512(dst + 32 * (h + 8), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table));
    }
  }
};

// The 8-bit form: a 16-input group is one tile of 8 pairs, each code converted through float32 (exact).
struct EightBit {
  static constexpr int64_t kInputs = 16;
  static constexpr int64_t kDecoded = 256;

  void decode(const uint8_t* src, uint16_t* dst) const {
    for (int h = 0; h < 8; ++h) {
      const __m128i* bytes = reinterpret_cast<const __m128i*>(src + 32 * h);
      const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
      const __m512bh both = _mm512_cvtne2ps_pbh(high, low);
      std::memcpy(dst + 32 * h, &both, 64);
    }
  }
};

// tiles 0, 1: products [m x 16 float32]; 2, 3: inputs [m x Form::kInputs bfloat16]; 4, 5: codes
// [Form::kInputs / 2 pairs x 16 outputs]. Steps alternate between the two sets so that one step's tile work can
// overlap the next one's.
template <class Form>
void configure_tiles(int m) {
  TileConfig config;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = t < 4 ? m : Form::kInputs / 2;
    config.bytes_per_row[t] = t == 2 || t == 3 ? Form::kInputs * 2 : 64;
  }
  _tile_loadconfig(&config);
}

struct Operands {
  const uint16_t* inputs;  // bfloat16 [rows padded to whole tiles, K]
  const float* xsum;       // [rows padded, G], 4-bit form only
  const uint8_t* codes;
  const float* scale;
  const float* bias;       // nullptr for the 8-bit form
  float* out;              // [rows, N]
  int64_t rows, tile_rows, passes, groups, blocks, n, k;

  const uint8_t* codes_of(int64_t p, int64_t block, int64_t g) const {
    return codes + ((p * blocks + block) * groups + g) * kCodeBytes;
  }
  const float* scale_of(int64_t p, int64_t block, int64_t g) const {
    return scale + ((p * blocks + block) * groups + g) * kBlock;
  }
  const float* bias_of(int64_t block, int64_t g) const { return bias + (block * groups + g) * kBlock; }
};

// product = rows r0.. of group g times one decoded tile, on tile set S
template <int S, class Form>
inline void tile_product(const Operands& o, const uint16_t* tile, int64_t g, int64_t r0, float (*product)[16]) {
  const uint16_t* inputs = o.inputs + r0 * o.k + g * Form::kInputs;
  // the tile intrinsics take their tile numbers as literals
  if constexpr (S == 0) {
    _tile_loadd(2, inputs, o.k * 2);
    _tile_loadd(4, tile, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, product, 64);
  } else {
    _tile_loadd(3, inputs, o.k * 2);
    _tile_loadd(5, tile, 64);
    _tile_zero(1);
    _tile_dpbf16ps(1, 3, 5);
    _tile_stored(1, product, 64);
  }
}

// acc[j] += scale * product[j], then for a group's last pass its bias times the rows' sums
inline void accumulate(const Operands& o, const float (*product)[16], int64_t block, int64_t i, int64_t r0,
                       int64_t count, __m512* acc) {
  const int64_t g = i / o.passes, p = i % o.passes;
  const __m512 s = _mm512_loadu_ps(o.scale_of(p, block, g));
  for (int64_t j = 0; j < count; ++j) acc[j] = _mm512_fmadd_ps(_mm512_load_ps(product[j]), s, acc[j]);
  if (o.bias == nullptr || p != o.passes - 1) return;
  const __m512 bias = _mm512_loadu_ps(o.bias_of(block, g));
  for (int64_t j = 0; j < count; ++j)
    acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(o.xsum[(r0 + j) * o.groups + g]), bias, acc[j]);
}

// Rows r0 .. r0 + count of one output block, step i (group i / P, pass i % P) reading its decoded tile from
// tile_of(i) after decode_ahead(i) had its chance to decode tiles ahead. Step i's stored product is read back
// while step i + 1's tiles are multiplied (a tile store reaches ordinary loads late), every row adding the steps
// in order: the same operations per row on every path.
template <class Form, class TileOf, class DecodeAhead>
void block_rows(const Operands& o, int64_t block, int64_t r0, int64_t count, TileOf tile_of, DecodeAhead decode_ahead) {
  alignas(64) float products[2][16][16];
  __m512 acc[kTileRows];
  for (int64_t j = 0; j < count; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t steps = o.groups * o.passes;
  for (int64_t i = 0; i < steps; ++i) {
    decode_ahead(i);
    if (i & 1) tile_product<1, Form>(o, tile_of(i), i / o.passes, r0, products[1]);
    else tile_product<0, Form>(o, tile_of(i), i / o.passes, r0, products[0]);
    if (i > 0) accumulate(o, products[(i - 1) & 1], block, i - 1, r0, count, acc);
  }
  accumulate(o, products[(steps - 1) & 1], block, steps - 1, r0, count, acc);
  for (int64_t j = 0; j < count; ++j) _mm512_storeu_ps(o.out + (r0 + j) * o.n + block * kBlock, acc[j]);
}

// rows that fit one tile: each step's codes decoded kAhead steps before their product into a ring of slots, so
// that the tile loads find them written back
constexpr int64_t kAhead = 4;
constexpr int64_t kSlots = 8;

// The codes, scales and biases are read once per forward, block after block: each step asks for the lines it will
// read ~16 steps later (codes 4 KB ahead, scales and biases 1 KB), so memory is read while the tiles are decoded.
// Without it the 1-token products of a SmolLM2 forward streamed at ~9 GB/s where the LM head alone reaches ~30
// (BENCHMARKS.md, "Seventeenth session"). Prefetching past a tensor's end is harmless.
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_ahead(const uint8_t* codes, const float* scale, const float* bias) {
  const char* ahead = reinterpret_cast<const char*>(codes) + kPrefetchBytes;
  for (int64_t line = 0; line < kCodeBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scale) + kPrefetchBytes / 4, _MM_HINT_T0);
  if (bias != nullptr) _mm_prefetch(reinterpret_cast<const char*>(bias) + kPrefetchBytes / 4, _MM_HINT_T0);
}

uint16_t* aligned_scratch(std::vector<uint16_t>& storage, int64_t elements) {
  if (storage.size() < static_cast<size_t>(elements + 32)) storage.resize(static_cast<size_t>(elements + 32));
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

template <class Form>
void blocks_of_outputs(const Operands& o, int64_t begin, int64_t end) {
  thread_local std::vector<uint16_t> storage;
  const Form form;
  const int64_t passes = o.passes, steps = o.groups * passes;
  configure_tiles<Form>(static_cast<int>(o.tile_rows));
  if (o.rows <= o.tile_rows) {
    uint16_t* slots = aligned_scratch(storage, kSlots * Form::kDecoded);
    for (int64_t block = begin; block < end; ++block) {
      auto decode = [&](int64_t i) {
        const int64_t g = i / passes, p = i % passes;
        const uint8_t* codes = o.codes_of(p, block, g);
        prefetch_ahead(codes, o.scale_of(p, block, g), o.bias == nullptr ? nullptr : o.bias_of(block, g));
        form.decode(codes, slots + (i % kSlots) * Form::kDecoded);
      };
      for (int64_t i = 0; i < std::min(kAhead, steps); ++i) decode(i);
      block_rows<Form>(o, block, 0, o.rows, [&](int64_t i) { return slots + (i % kSlots) * Form::kDecoded; },
                       [&](int64_t i) { if (i + kAhead < steps) decode(i + kAhead); });
    }
  } else {  // many rows (a prompt, a large batch): the block's codes decoded once for all its row tiles
    uint16_t* tiles = aligned_scratch(storage, steps * Form::kDecoded);
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t i = 0; i < steps; ++i)
        form.decode(o.codes_of(i % passes, block, i / passes), tiles + i * Form::kDecoded);
      for (int64_t r0 = 0; r0 < o.rows; r0 += o.tile_rows)
        block_rows<Form>(o, block, r0, std::min(o.tile_rows, o.rows - r0),
                         [&](int64_t i) { return tiles + i * Form::kDecoded; }, [](int64_t) {});
    }
  }
  _tile_release();
}

// The rows as bfloat16 [rows padded to whole tiles, K] (round to nearest even), and for the 4-bit form each row's
// float32 sum per group of 32.
void prepare_inputs(const float* x, int64_t rows, int64_t padded, int64_t k, bool sums, std::vector<uint16_t>& inputs,
                    std::vector<float>& xsum) {
  inputs.assign(static_cast<size_t>(padded * k), 0);
  xsum.assign(sums ? static_cast<size_t>(padded * (k / 32)) : 0, 0.f);
  for (int64_t i = 0; i < rows * k / 32; ++i) {
    const __m512 a = _mm512_loadu_ps(x + i * 32), b = _mm512_loadu_ps(x + i * 32 + 16);
    if (sums) xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const __m512bh both = _mm512_cvtne2ps_pbh(b, a);  // a in the low half: elements in order
    std::memcpy(inputs.data() + i * 32, &both, 64);
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

// x: float32 [M, K]; codes: uint8 (4-bit form) or int8 (8-bit form) [P, N / 16, G, 256]; scale: float32
// [P, N / 16, G, 16]; bias: float32 [N / 16, G, 16] for the 4-bit form, empty for the 8-bit one. Returns float32
// [M, N].
torch::Tensor int4_amx_mm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& bias) {
  TORCH_CHECK(amx_ready(), "the AMX product is not available in this build or process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool eight = codes.scalar_type() == torch::kInt8;
  TORCH_CHECK(codes.dim() == 4 && (eight || codes.scalar_type() == torch::kUInt8) && codes.is_contiguous() &&
                  codes.size(3) == kCodeBytes && (!eight || codes.size(0) == 1),
              "codes: contiguous uint8 [P, N / 16, G, 256] or int8 [1, N / 16, G, 256]");
  const int64_t rows = x.size(0), k = x.size(1), passes = codes.size(0), blocks = codes.size(1),
                groups = codes.size(2), n = blocks * kBlock;
  TORCH_CHECK(k == groups * (eight ? 16 : 32) && k % 32 == 0, "K must match the codes' groups (32 or 16 inputs)");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 &&
                  scale.sizes() == torch::IntArrayRef({passes, blocks, groups, kBlock}),
              "scale: contiguous float32 [P, N / 16, G, 16]");
  TORCH_CHECK(eight ? bias.numel() == 0 : (bias.is_contiguous() && bias.scalar_type() == torch::kFloat32 &&
                                           bias.sizes() == torch::IntArrayRef({blocks, groups, kBlock})),
              "bias: contiguous float32 [N / 16, G, 16] (4-bit codes) or empty (8-bit codes)");
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;  // nothing to multiply (and no tile of 0 rows to configure)
#ifdef HIERSPEC_AMX
  const int64_t tile_rows = std::min<int64_t>(rows, kTileRows);
  const int64_t padded = (rows + tile_rows - 1) / tile_rows * tile_rows;
  thread_local std::vector<uint16_t> inputs;
  thread_local std::vector<float> xsum;
  prepare_inputs(x.data_ptr<float>(), rows, padded, k, !eight, inputs, xsum);
  const Operands o{inputs.data(), xsum.data(), static_cast<const uint8_t*>(codes.data_ptr()),
                   scale.data_ptr<float>(), eight ? nullptr : bias.data_ptr<float>(), out.data_ptr<float>(),
                   rows, tile_rows, passes, groups, blocks, n, k};
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    if (eight) blocks_of_outputs<EightBit>(o, begin, end);
    else blocks_of_outputs<FourBit>(o, begin, end);
  });
#endif
  return out;
}
