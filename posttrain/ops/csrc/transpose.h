// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, shared by the attention kernel (bf16 pairs as int32)
// and the GEMM's x packing (floats, through casts); cpu_kernels.py folds this file into the build's name.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace posttrain_simd {

// out[c] lane i = in[i] lane c. Three rounds: 32-bit interleaves of row pairs, 64-bit interleaves of those, then
// 128-bit lane shuffles gather each column's four quarters.
inline void transpose16(const __m512i (&in)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xee);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44), w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xee);
    out[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    out[8 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

inline void transpose16(const __m512 (&in)[16], __m512 (&out)[16]) {  // the same moves on floats' bits
  __m512i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_castps_si512(in[i]);
  transpose16(a, b);
  for (int i = 0; i < 16; ++i) out[i] = _mm512_castsi512_ps(b[i]);
}

}  // namespace posttrain_simd
#endif
