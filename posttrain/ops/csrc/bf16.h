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

// 16-lane vectors (GCC/Clang vector extensions: zmm with AVX-512, two ymm with AVX2); unaligned through these types
namespace posttrain_vec {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u16v __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const uint16_t* p) {  // 16 bf16 -> 16 float32 (exact: the upper halves)
  const u16v u = __builtin_convertvector(*reinterpret_cast<const h16*>(p), u16v) << 16;
  v16 f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace posttrain_vec
