// What the kernels share (cpu_kernels.py folds this file into the build's name): bf16 <-> float32 conversions
// written out (round to nearest even, NaN kept) so the loops vectorize, VL-lane vectors, and on AVX2 the
// 8-lane exp block over SLEEF's expf (the routine torch's vectorized exp runs on x86, e.g. in F.silu).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

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
#if defined(__AVX512BW__)
  // one widening load and a shift; GCC's tuning for Zen 4 (256-bit preferred) splits the generic form below into two
  // halves and joins them
  return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  const uvec u = __builtin_convertvector(*reinterpret_cast<const hvec*>(p), uvec) << 16;
  vec f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
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
inline void store_bf16(uint16_t* p, vec x) {
#if defined(__AVX512BW__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)f2bf_bits(x)));  // vpmovdw, as loadv
#else
  *reinterpret_cast<hvec*>(p) = __builtin_convertvector(f2bf_bits(x), hvec);
#endif
}
inline void storev(uint16_t* p, vec x) { store_bf16(p, x); }  // rounded to bf16

}  // namespace posttrain_vec

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>

extern "C" __m256 Sleef_expf8_u10(__m256);  // exported by libtorch_cpu (its vectorized exp)
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);  // the same with AVX-512
#endif

namespace posttrain_vec {

#if defined(__FMA__)
// SLEEF's expf8_u10 for AVX2 + FMA (what torch's Sleef_expf8_u10 runs on such CPUs) written out: the same operations on
// the same constants in the same order, so its results bit for bit (every float32 input checked once; a test compares
// all bf16 values and 2^20 random floats with torch's SLEEF). Inline, N vectors at a time step by step: a call per vector kept the exps' ~60-cycle
// dependency chains from overlapping (3.8 vs 5.9 ns a vector for N = 4, AMD Zen 2).
//   q = rint(d / ln2), s = d - q ln2 (two FMAs: ln2 in a high and a low part), e^s by a degree-7 polynomial,
//   times 2^q as two powers of two (q>>1 and q - q>>1, so 2^q overflows or underflows only where the result does);
//   0 below d = -104, inf above 100.
inline __m256 bits8(uint32_t b) { return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(b))); }

template <int N>
inline void exp8(__m256 (&d)[N]) {
  __m256i q[N];
  __m256 qf[N], s[N], u[N];
  for (int i = 0; i < N; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(d[i], bits8(0x3fb8aa3b)));  // 1/ln2
  for (int i = 0; i < N; ++i) qf[i] = _mm256_cvtepi32_ps(q[i]);
  for (int i = 0; i < N; ++i) s[i] = _mm256_fmadd_ps(qf[i], bits8(0xbf317200), d[i]);  // -ln2, high part
  for (int i = 0; i < N; ++i) s[i] = _mm256_fmadd_ps(qf[i], bits8(0xb5bfbe8e), s[i]);  // -ln2, low part
  for (int i = 0; i < N; ++i) u[i] = _mm256_fmadd_ps(bits8(0x39502bda), s[i], bits8(0x3ab696c9));
  for (int i = 0; i < N; ++i) u[i] = _mm256_fmadd_ps(u[i], s[i], bits8(0x3c0888a6));
  for (int i = 0; i < N; ++i) u[i] = _mm256_fmadd_ps(u[i], s[i], bits8(0x3d2aaa7a));
  for (int i = 0; i < N; ++i) u[i] = _mm256_fmadd_ps(u[i], s[i], bits8(0x3e2aaaab));
  for (int i = 0; i < N; ++i) u[i] = _mm256_fmadd_ps(u[i], s[i], bits8(0x3f000000));
  for (int i = 0; i < N; ++i) u[i] = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(s[i], s[i]), u[i], s[i]), bits8(0x3f800000));
  const __m256i bias = _mm256_set1_epi32(0x7f);
  for (int i = 0; i < N; ++i) {
    const __m256i h = _mm256_srai_epi32(q[i], 1);
    u[i] = _mm256_mul_ps(u[i], _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23)));
    u[i] = _mm256_mul_ps(u[i], _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_add_epi32(q[i], bias), h), 23)));
  }
  for (int i = 0; i < N; ++i) {
    u[i] = _mm256_andnot_ps(_mm256_cmp_ps(d[i], bits8(0xc2d00000), _CMP_LT_OQ), u[i]);            // d < -104: 0
    d[i] = _mm256_blendv_ps(u[i], bits8(0x7f800000), _mm256_cmp_ps(bits8(0x42c80000), d[i], _CMP_LT_OQ));  // 100 < d: inf
  }
}

#else
template <int N>
inline void exp8(__m256 (&d)[N]) {
  for (int i = 0; i < N; ++i) d[i] = Sleef_expf8_u10(d[i]);
}
#endif

inline __m256 exp8(__m256 x) {
  __m256 d[1] = {x};
  exp8<1>(d);
  return d[0];
}

#if defined(__AVX512F__)
// The same written out for 16 lanes: torch's Sleef_expf16_u10 (Sleef_finz_expf16_u10avx512f) runs exp8's operations
// on the same constants in the same order (its disassembly, torch 2.13), so both give the same bits per lane (a test
// compares all bf16 values and 2^20 random floats with torch's routine). Inline, N vectors interleaved: a call per
// vector kept each ~60-cycle chain from overlapping the next.
inline __m512 bits16(uint32_t b) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(b))); }

template <int N>
inline void exp16(__m512 (&d)[N]) {
  __m512i q[N];
  __m512 qf[N], s[N], u[N];
  for (int i = 0; i < N; ++i) q[i] = _mm512_cvtps_epi32(_mm512_mul_ps(d[i], bits16(0x3fb8aa3b)));  // 1/ln2
  for (int i = 0; i < N; ++i) qf[i] = _mm512_cvtepi32_ps(q[i]);
  for (int i = 0; i < N; ++i) s[i] = _mm512_fmadd_ps(qf[i], bits16(0xbf317200), d[i]);  // -ln2, high part
  for (int i = 0; i < N; ++i) s[i] = _mm512_fmadd_ps(qf[i], bits16(0xb5bfbe8e), s[i]);  // -ln2, low part
  for (int i = 0; i < N; ++i) u[i] = _mm512_fmadd_ps(bits16(0x39502bda), s[i], bits16(0x3ab696c9));
  for (int i = 0; i < N; ++i) u[i] = _mm512_fmadd_ps(u[i], s[i], bits16(0x3c0888a6));
  for (int i = 0; i < N; ++i) u[i] = _mm512_fmadd_ps(u[i], s[i], bits16(0x3d2aaa7a));
  for (int i = 0; i < N; ++i) u[i] = _mm512_fmadd_ps(u[i], s[i], bits16(0x3e2aaaab));
  for (int i = 0; i < N; ++i) u[i] = _mm512_fmadd_ps(u[i], s[i], bits16(0x3f000000));
  for (int i = 0; i < N; ++i) u[i] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(s[i], s[i]), u[i], s[i]), bits16(0x3f800000));
  const __m512i bias = _mm512_set1_epi32(0x7f);
  for (int i = 0; i < N; ++i) {
    const __m512i h = _mm512_srai_epi32(q[i], 1);
    u[i] = _mm512_mul_ps(u[i], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, bias), 23)));
    u[i] = _mm512_mul_ps(u[i], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_add_epi32(q[i], bias), h), 23)));
  }
  for (int i = 0; i < N; ++i) {
    u[i] = _mm512_mask_mov_ps(u[i], _mm512_cmp_ps_mask(d[i], bits16(0xc2d00000), _CMP_LT_OQ), _mm512_setzero_ps());  // d < -104: 0
    d[i] = _mm512_mask_mov_ps(u[i], _mm512_cmp_ps_mask(bits16(0x42c80000), d[i], _CMP_LT_OQ), bits16(0x7f800000));  // 100 < d: inf
  }
}
#endif

// exp on every lane of N vectors with torch's vectorized exp (SLEEF u10: 16 lanes with AVX-512, 8 with AVX2, where
// the N vectors' exps run interleaved), in place
template <int N>
inline void vexp(vec (&x)[N]) {
#if defined(__AVX512F__)
  __m512 d[N];
  for (int i = 0; i < N; ++i) d[i] = (__m512)x[i];
  exp16<N>(d);
  for (int i = 0; i < N; ++i) x[i] = (vec)d[i];
#else
  __m256 d[N];
  for (int i = 0; i < N; ++i) d[i] = (__m256)x[i];
  exp8<N>(d);
  for (int i = 0; i < N; ++i) x[i] = (vec)d[i];
#endif
}

// torch's bf16 SiLU loop takes 2 x Vectorized<BFloat16> (4 vectors of VL floats) per step while a whole step fits
// in the row: values before the last whole step take the vector exp, the rest std::exp (posttrain_bf16::silu)
constexpr int64_t SILU_STEP = 4 * VL;

inline vec negate(vec x) {  // -x by the sign bit, as torch's vectorized SiLU
  uvec bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits ^= 0x80000000u;
  vec neg;
  std::memcpy(&neg, &bits, sizeof neg);
  return neg;
}

// silu(x) = x / (1 + exp(-x)) on every lane of N vectors (torch's vectorized SiLU), in place
template <int N>
inline void silu(vec (&x)[N]) {
  vec e[N];
  for (int i = 0; i < N; ++i) e[i] = negate(x[i]);
  vexp<N>(e);
  for (int i = 0; i < N; ++i) x[i] = x[i] / (1.f + e[i]);
}

inline vec silu(vec x) {
  vec v[1] = {x};
  silu<1>(v);
  return v[0];
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
  auto block = [&](auto& w) {  // exps of whole vectors from x + i, added in order
    constexpr int N = sizeof(w) / sizeof(__m256);
    for (int j = 0; j < N; ++j) w[j] = _mm256_sub_ps(load8(x + i + 8 * j), sh);
    exp8<N>(w);
    for (int j = 0; j < N; ++j) {
      if (out) _mm256_storeu_ps(out + i + 8 * j, w[j]);
      acc = _mm256_add_ps(acc, w[j]);
    }
  };
#if defined(__AVX512F__)
  const __m512 sh16 = _mm512_set1_ps(shift);
  for (; i + 64 <= n; i += 64) {  // 4 vectors of 16 (exp16: the same bits), their 8-lane halves added in order
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_sub_ps((__m512)loadv(x + i + 16 * j), sh16);
    exp16<4>(w);
    for (int j = 0; j < 4; ++j) {
      if (out) _mm512_storeu_ps(out + i + 16 * j, w[j]);
      acc = _mm256_add_ps(acc, _mm512_castps512_ps256(w[j]));
      acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[j]), 1)));
    }
  }
#endif
  for (; i + 32 <= n; i += 32) {
    __m256 w[4];
    block(w);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 w[1];
    block(w);
  }
  alignas(32) float buf[8];
  if (i < n) {
    const int64_t k = n - i;
    for (int64_t l = 0; l < 8; ++l) buf[l] = l < k ? posttrain_bf16::to_f(x[i + l]) : 0.f;
    _mm256_store_ps(buf, exp8(_mm256_sub_ps(_mm256_load_ps(buf), sh)));
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
