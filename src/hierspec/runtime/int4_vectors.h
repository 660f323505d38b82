// Vector types and helpers of the int4 extension's sources: the CPU's width, 16 float lanes with AVX-512, else 8
// (gcc lowers wider vector types badly without it). Every loop written with them runs in an order fixed by its
// length alone.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hierspec_int4 {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Half-precision (IEEE float16) entries of a KV cache: widened to float32 exactly, narrowed rounding to nearest
// even as PyTorch's conversion rounds (F16C's instructions where the CPU has them, c10's bit arithmetic otherwise)
#if defined(__F16C__)
inline vf load(const uint16_t* p) {
#ifdef __AVX512F__
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  vf v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline void store_half(uint16_t* p, vf v) {
#ifdef __AVX512F__
  __m512 wide;
  std::memcpy(&wide, &v, sizeof v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(wide, _MM_FROUND_TO_NEAREST_INT));
#else
  __m256 wide;
  std::memcpy(&wide, &v, sizeof v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(wide, _MM_FROUND_TO_NEAREST_INT));
#endif
}

inline float widen(uint16_t x) { return _cvtsh_ss(x); }
inline uint16_t narrow_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
#else
inline float widen(uint16_t x) { return c10::detail::fp16_ieee_to_fp32_value(x); }
inline uint16_t narrow_half(float x) { return c10::detail::fp16_ieee_from_fp32_value(x); }

inline vf load(const uint16_t* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = widen(p[i]);
  return v;
}

inline void store_half(uint16_t* p, vf v) {
  for (int i = 0; i < kLanes; ++i) p[i] = narrow_half(v[i]);
}
#endif

inline float widen(float x) { return x; }

// a * b + c rounded once (FMA, which every AVX2 and AVX-512 CPU has), spelled out: gcc contracted `a * b + c` in some
// instantiations of one template and not in others, so that a row's bits depended on the rows beside it
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Cephes' expf: ln 2 split in two for the range reduction, the polynomial of e^r on |r| <= ln2 / 2
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpFloor = -87.f;  // below it exp leaves float32's normal range

// exp(x) for x in [kExpFloor, 0], within ~1 ulp: n = floor(x log2 e + 1/2), r = x - n ln 2 in two parts, e^r by its
// polynomial, 2^n built in the exponent bits (floor as truncation less one where that rounded up: exact for these
// magnitudes).
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

}  // namespace hierspec_int4
