// bf16 <-> float32 conversions written out (round to nearest even, NaN kept), so the kernels' loops vectorize.
// Shared by cpu_kernels.cpp and sample_kernel.cpp (cpu_kernels.py folds this file into the build's name).
#pragma once
#include <cstdint>
#include <cstring>

namespace posttrain_bf16 {

inline float bf2f(uint16_t b) {  // exact: bf16 is float32's upper half
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, as c10::BFloat16; branch-free (NaN -> 0x7fc0)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

inline float round_bf(float f) { return bf2f(f2bf(f)); }

}  // namespace posttrain_bf16

// Vectors of VL float32 lanes (GCC/Clang vector extensions): 16 lanes (one zmm) with AVX-512, else 8 (one ymm with
// AVX2). Eight lanes where AVX-512 is missing, because a 16-lane type there is split over two ymm registers by the
// compiler and its shuffles and spills cost more than the arithmetic (4-5x slower attention on an AVX2 CPU).
// Unaligned loads through these types.
namespace posttrain_vec {

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vec __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint32_t uvec __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2), aligned(2)));

inline vec loadv(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline vec loadv(const uint16_t* p) {  // VL bf16 -> VL float32 (exact: the upper halves)
  const uvec u = __builtin_convertvector(*reinterpret_cast<const hvec*>(p), uvec) << 16;
  vec f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void storev(float* p, vec x) { *reinterpret_cast<vec*>(p) = x; }

}  // namespace posttrain_vec
