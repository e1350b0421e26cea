// What the kernels share (cpu_kernels.py folds this file into the build's name): bf16 <-> float32 conversions
// written out (round to nearest even, NaN kept) so the loops vectorize, VL-lane vectors, and on AVX2 the
// 8-lane exp block over SLEEF's expf (the routine torch's exp runs on x86).
#pragma once
#include <cmath>
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

// element access for kernels templated on the storage type (uint16_t = bf16 bits, or float)
inline float to_f(uint16_t v) { return bf2f(v); }
inline float to_f(float v) { return v; }
inline void put(uint16_t* p, float f) { *p = f2bf(f); }
inline void put(float* p, float f) { *p = f; }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }  // a row's tail in torch's vectorized SiLU loop

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

// VL float32 -> bf16 bits, round to nearest even (NaN -> 0x7fc0): f2bf on every lane
inline uvec f2bf_bits(vec x) {
  uvec u;
  std::memcpy(&u, &x, sizeof u);
  const uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uvec{} + 0x7fc0u : rounded;
}
inline vec round_bf(vec x) {  // each lane rounded to bf16 precision (round_bf on every lane)
  const uvec u = f2bf_bits(x) << 16;
  vec f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store_bf16(uint16_t* p, vec x) { *reinterpret_cast<hvec*>(p) = __builtin_convertvector(f2bf_bits(x), hvec); }
inline void storev(uint16_t* p, vec x) { store_bf16(p, x); }  // rounded to bf16

}  // namespace posttrain_vec

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>

extern "C" __m256 Sleef_expf8_u10(__m256);  // exported by libtorch_cpu (its vectorized exp)
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);  // the same with AVX-512
#endif

namespace posttrain_vec {

// exp on every lane with torch's vectorized exp (SLEEF u10: 16 lanes with AVX-512, 8 with AVX2)
inline vec vexp(vec x) {
#if defined(__AVX512F__)
  return (vec)Sleef_expf16_u10((__m512)x);
#else
  return (vec)Sleef_expf8_u10((__m256)x);
#endif
}

// torch's bf16 SiLU loop takes 2 x Vectorized<BFloat16> (4 vectors of VL floats) per step while a whole step fits
// in the row: values before the last whole step take the vector exp, the rest std::exp (posttrain_bf16::silu)
constexpr int64_t SILU_STEP = 4 * VL;

// silu(x) = x / (1 + exp(-x)) on every lane, -x by its sign bit: torch's vectorized SiLU
inline vec silu(vec x) {
  uvec bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits ^= 0x80000000u;
  vec neg;
  std::memcpy(&neg, &bits, sizeof neg);
  return x / (1.f + vexp(neg));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 float32 (exact)
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// w[i] = exp(float(x[i]) - shift) for i < n, 8 at a time (a short tail through a zero-padded vector, as
// torch's vectorized loops do, so every weight comes from the same routine). Returns the float32 sum of
// the weights (8 lane-wise partial sums, then the lanes in order); writes them to `out` when given (out = x:
// in place).
template <typename T>
float exp_block(const T* x, int64_t n, float shift, float* out) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 w = Sleef_expf8_u10(_mm256_sub_ps(load8(x + i), sh));
    if (out) _mm256_storeu_ps(out + i, w);
    acc = _mm256_add_ps(acc, w);
  }
  alignas(32) float buf[8];
  if (i < n) {
    const int64_t k = n - i;
    for (int64_t l = 0; l < 8; ++l) buf[l] = l < k ? posttrain_bf16::to_f(x[i + l]) : 0.f;
    _mm256_store_ps(buf, Sleef_expf8_u10(_mm256_sub_ps(_mm256_load_ps(buf), sh)));
    for (int64_t l = k; l < 8; ++l) buf[l] = 0.f;  // padding weighs nothing (the eager path pads with 0)
    if (out) std::memcpy(out + i, buf, k * sizeof(float));
    acc = _mm256_add_ps(acc, _mm256_load_ps(buf));
  }
  _mm256_store_ps(buf, acc);
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += buf[l];
  return s;
}

}  // namespace posttrain_vec
#endif
