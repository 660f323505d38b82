// Vector types of the int4 extension's sources: the CPU's width, 16 float lanes with AVX-512, else 8 (gcc lowers
// wider vector types badly without it). Every loop written with them runs in an order fixed by its length alone.
#pragma once

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

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

}  // namespace hierspec_int4
