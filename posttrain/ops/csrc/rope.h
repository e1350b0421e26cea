// RoPE rows with eager PyTorch's roundings, shared by `rope` (cpu_kernels.cpp) and the decode attention, which rotates
// each query and new key as it reads them (attention_kernel.cpp); cpu_kernels.py folds this file into the build's name.
#pragma once
#include <cstdint>
#include <type_traits>

#include "bf16.h"

// The products and sum each rounded, as the eager ops round them: no contraction into FMAs (GCC contracts by
// default in C++ too)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif
namespace posttrain_rope {

// out[n, h] = x[n, h] * cos[n] + swap_halves(x[n, h]) * sin_signed[n] for n < N, h < H (x: row stride sn, head
// stride sh; out: (N, H, D) contiguous; cos/sin: (N, D) contiguous), each product and the sum rounded to T as the
// eager ops round them (T = uint16_t: bf16 bits; float: float32, no rounding step)
template <typename T>
inline void rope_rows(const T* xp, const T* cp, const T* sp, T* op, int64_t N, int64_t H, int64_t D, int64_t sn, int64_t sh) {
  using posttrain_bf16::put;
  using posttrain_bf16::round_bf;
  using posttrain_bf16::to_f;
  const int64_t half = D / 2;
  auto rnd = [](float v) { return std::is_same<T, float>::value ? v : round_bf(v); };
  for (int64_t n = 0; n < N; ++n) {
    const T *c = cp + n * D, *s = sp + n * D;
    for (int64_t h = 0; h < H; ++h) {
      const T* r = xp + n * sn + h * sh;
      T* o = op + (n * H + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) put(o + d, rnd(to_f(r[d]) * to_f(c[d])) + rnd(to_f(r[d + half]) * to_f(s[d])));
#pragma omp simd
      for (int64_t d = half; d < D; ++d) put(o + d, rnd(to_f(r[d]) * to_f(c[d])) + rnd(to_f(r[d - half]) * to_f(s[d])));
    }
  }
}

}  // namespace posttrain_rope
#pragma GCC pop_options
