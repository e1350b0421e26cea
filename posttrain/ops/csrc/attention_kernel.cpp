// Decode attention over the engine's group KV (runner._slot_attend), visiting only the keys each query sees.
//
// Layout of one layer's group KV, (groups, kv_heads, cap, D): group g's region holds its prompt's P keys once,
// then its W samples' tokens interleaved: sample m's j-th own token (position P + j) at P + j*W + m. Sample m
// sees the prompt and its own tokens only. SDPA over the region with a mask does W-fold work on the samples'
// part (every query meets all W*t own keys); here each (group, kv head) is one task:
//
//   rows  : the G query heads of that kv head for each live sample m (R = members x G rows, float32)
//   prompt: S_p = Q K_p^T over the prompt keys all rows see (one shared pass, VL = 16 or 8 keys per block)
//   own   : S_m = Q_m K_m^T over sample m's own keys (stride W in the region), its G rows only
//   out   : softmax over [S_p | S_m] (float32, SLEEF exp), O = P V, cast to the cache dtype
//
// with the new token's k/v written into the region first (it is the last own key). Given the step's RoPE rows
// (decode_layers), q and the new k are rotated as they are read, with `rope`'s function (rope.h). bf16 with AVX-512 BF16: the
// scores are vdpbf16ps dot products of the bf16 q and keys (exact products, float32 sums; `scores_bf16`); on Intel
// the shared prompt scores take the same values from float32 FMAs, twice vdpbf16ps's rate there (`scores_fma`).
// Windows (sliding attention): key position p visible to query position q iff q - p < window, so each sample's
// prompt and own ranges start later. Everything else in float32 (SDPA rounds the probabilities to bf16 before P V; this
// does not), scores scaled after the dot product as SDPA does. Threads claim runs of tasks (claimed.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "claimed.h"
#include "rope.h"
#include "transpose.h"

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)  // __builtin_shufflevector (else: masked SDPA runs)
#define POSTTRAIN_GROUP_ATTENTION 1

namespace {

using posttrain_vec::loadv;
using posttrain_vec::storev;
using posttrain_vec::vec;
constexpr int64_t VL = posttrain_vec::VL;  // lanes per vector: 16 (AVX-512) or 8
constexpr int64_t KB = VL;                 // keys per block: one vector of scores

using posttrain_bf16::to_f;

// x[0..n) <- exp(x - shift); returns their float32 sum (SLEEF's exp written out, 16 or 8 lanes; the AVX-512 tail masked)
float exp_sum(float* x, int64_t n, float shift) {
#if defined(__x86_64__) && defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift), none = _mm512_set1_ps(-INFINITY);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  auto block = [&](auto& w) {  // N vectors' exps interleaved (posttrain_vec::exp16), added in order
    constexpr int N = sizeof(w) / sizeof(__m512);
    __mmask16 m[N];
    for (int j = 0; j < N; ++j) {
      const int64_t k = n - i - 16 * j;  // >= 1: only vectors holding values
      m[j] = k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << k) - 1u);
      w[j] = _mm512_sub_ps(_mm512_mask_loadu_ps(none, m[j], x + i + 16 * j), sh);  // exp(-inf) = 0
    }
    posttrain_vec::exp16<N>(w);
    for (int j = 0; j < N; ++j) {
      _mm512_mask_storeu_ps(x + i + 16 * j, m[j], w[j]);
      acc = _mm512_add_ps(acc, w[j]);
    }
    i += 16 * N;
  };
  while (n - i > 48) {
    __m512 w[4];
    block(w);
  }
  if (const int64_t left = (n - i + 15) / 16; left == 3) {
    __m512 w[3];
    block(w);
  } else if (left == 2) {
    __m512 w[2];
    block(w);
  } else if (left == 1) {
    __m512 w[1];
    block(w);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__x86_64__) && defined(__AVX2__)
  return posttrain_vec::exp_block(x, n, shift, x);  // in place
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += (x[i] = std::exp(x[i] - shift));
  return s;
#endif
}

// Lane sums of VL vectors in one: out[L] = sum of the lanes of a[REV[L]], REV = bit reversal of the lane index
// (log2 VL levels, each adding the two halves of every block of 2h lanes of two vectors).
#if defined(__AVX512F__)
inline vec lane_sums(const vec* a) {  // 16 lanes: 15 adds, 30 shuffles
  vec b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
constexpr int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
inline vec lane_sums(const vec* a) {  // 8 lanes: 7 adds, 14 shuffles
  vec b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(c[0], c[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
constexpr int REV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif

// S[r*lds + c] = scale * <Q[r], key(c)> for r < R (Q: rows of D floats), c < nk. VL keys at a time, converted
// to float32 once (Kf, VL x D) and shared by the rows: per row VL dot products of D/VL fused multiply-adds,
// then their lane sums in one vector (`lane_sums`: key c computed into slot REV[c] comes out in lane c).
// NV = D/VL when known at compile time (registers and unrolled loops), 0 for any D.
template <int NV, typename T, typename KeyAt>
void scores(const float* Q, int64_t R, int64_t D, KeyAt key, int64_t nk, float scale, float* S, int64_t lds, float* Kf) {
  const int64_t nv = NV ? NV : D / VL;
  for (int64_t c0 = 0; c0 < nk; c0 += KB) {
    const int64_t nb = std::min(KB, nk - c0);
    for (int64_t c = 0; c < KB; ++c) {
      const T* k = key(c0 + std::min(c, nb - 1));  // a short block repeats its last key (scores dropped)
      for (int64_t j = 0; j < nv; ++j) storev(Kf + REV[c] * D + j * VL, loadv(k + j * VL));
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* q = Q + r * D;
      vec a[KB];
      for (int64_t c = 0; c < KB; ++c) {
        const float* k = Kf + c * D;
        vec s = loadv(q) * loadv(k);
        for (int64_t j = 1; j < nv; ++j) s += loadv(q + j * VL) * loadv(k + j * VL);
        a[c] = s;
      }
      const vec out = lane_sums(a) * scale;
      if (nb == KB)
        storev(S + r * lds + c0, out);  // whole blocks in one store (a short copy would compile to rep movs)
      else
        for (int64_t c = 0; c < nb; ++c) S[r * lds + c0 + c] = out[c];
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define POSTTRAIN_ATTN_DPBF16 1
using posttrain_simd::transpose16;

// A block of 16 keys (from c0; a short block repeats its last key) as D/2 vectors of key pairs: put(j, v) gets pair j
// of the 16 keys (lane c: key c's elements 2j and 2j+1, 32 bits). The next block's keys are prefetched first.
template <typename KeyAt, typename Put>
void key_pairs(KeyAt key, int64_t c0, int64_t nk, int64_t D, Put put) {
  const int64_t nb = std::min<int64_t>(16, nk - c0), lines = D * 2 / 64;
  for (int64_t c = c0 + 16; c < std::min(nk, c0 + 32); ++c)
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(key(c)) + 64 * l, _MM_HINT_T0);
  for (int64_t j0 = 0; j0 < D / 2; j0 += 16) {  // 16 pairs (32 dims) of the 16 keys at a time
    __m512i in[16], out[16];
    for (int64_t c = 0; c < 16; ++c) in[c] = _mm512_loadu_si512(key(c0 + std::min(c, nb - 1)) + 2 * j0);
    transpose16(in, out);
    for (int64_t j = 0; j < 16; ++j) put(j0 + j, out[j]);
  }
}

// scores with bf16 dot products (vdpbf16ps): S[r*lds + c] = scale * <q_r, key(c)>, q_r = qrow[r] (D bf16), for
// r < R, c < nk. Each block of 16 keys is transposed once into Kt (`key_pairs`), then each row takes D/2 vdpbf16ps
// with its pair j broadcast: each key's lane sums its exact products in float32, even and odd pairs in two chains
// added at the end (8 independent chains for 4 rows: vdpbf16ps's latency is hidden).
template <typename KeyAt>
void scores_bf16(const uint16_t* const* qrow, int64_t R, int64_t D, KeyAt key, int64_t nk, float scale, float* S, int64_t lds,
                 float* Kt) {  // Kt: D/2 x 16 floats of scratch
  const int64_t pairs = D / 2;
  for (int64_t c0 = 0; c0 < nk; c0 += 16) {
    const int64_t nb = std::min<int64_t>(16, nk - c0);
    key_pairs(key, c0, nk, D, [&](int64_t j, __m512i v) { _mm512_storeu_si512(Kt + j * 16, v); });
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, R - r0);
      __m512 even[4], odd[4];
      const uint16_t* q[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = qrow[r0 + std::min<int64_t>(i, nr - 1)];
        even[i] = odd[i] = _mm512_setzero_ps();
      }
      for (int64_t j = 0; j < pairs; j += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(Kt + j * 16), k1 = (__m512bh)_mm512_loadu_si512(Kt + (j + 1) * 16);
        for (int i = 0; i < 4; ++i) {
          int32_t p0, p1;
          std::memcpy(&p0, q[i] + 2 * j, 4);
          std::memcpy(&p1, q[i] + 2 * j + 2, 4);
          even[i] = _mm512_dpbf16_ps(even[i], (__m512bh)_mm512_set1_epi32(p0), k0);
          odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_set1_epi32(p1), k1);
        }
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << nb) - 1u);  // masked stores: no rep movs for a short copy
      for (int64_t i = 0; i < nr; ++i)
        _mm512_mask_storeu_ps(S + (r0 + i) * lds + c0, keep, _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(scale)));
    }
  }
}

struct FlushDenormals {  // MXCSR's FTZ and DAZ for this thread while in scope
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// scores_bf16's values bit for bit from float32 FMAs, twice as fast where vdpbf16ps runs at half the FMA rate (Intel
// without AMX: 2 cycles per vdpbf16ps against 0.5 per FMA, measured). vdpbf16ps adds to each lane the product of the
// odd (high) elements, then that of the even ones, exact products with denormals flushed; here each pair lane of Kt
// is split into two float32 lanes (odd, even) and each row adds the same two products in the same order to the same
// two chains, with MXCSR's FTZ and DAZ set (`FlushDenormals`) while they run; their sum and the scaling after, as
// there, without. Qf: the rows in float32 (R x D); Kt: D x 16 floats of scratch. Six rows at a time: 12 chains of 2
// dependent FMAs per step.
template <typename KeyAt>
void scores_fma(const float* Qf, int64_t R, int64_t D, KeyAt key, int64_t nk, float scale, float* S, int64_t lds, float* Kt) {
  const int64_t pairs = D / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  thread_local std::vector<float> odd_sums;  // the odd chains (R x lds), added to the even ones (in S) at the end
  odd_sums.resize(std::max<size_t>(odd_sums.size(), R * lds));
  float* O = odd_sums.data();
  {
    FlushDenormals ftz;  // for the chains only: their sum and scaling below run as scores_bf16's do
    for (int64_t c0 = 0; c0 < nk; c0 += 16) {
      const int64_t nb = std::min<int64_t>(16, nk - c0);
      key_pairs(key, c0, nk, D, [&](int64_t j, __m512i v) {  // pair j: odd elements at Kt + 32j, even ones after
        _mm512_storeu_si512(Kt + j * 32, _mm512_and_si512(v, high));
        _mm512_storeu_si512(Kt + j * 32 + 16, _mm512_slli_epi32(v, 16));
      });
      for (int64_t r0 = 0; r0 < R; r0 += 6) {
        const int64_t nr = std::min<int64_t>(6, R - r0);
        __m512 even[6], odd[6];
        const float* q[6];
        for (int i = 0; i < 6; ++i) {
          q[i] = Qf + (r0 + std::min<int64_t>(i, nr - 1)) * D;
          even[i] = odd[i] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < pairs; j += 2) {  // pairs j (even chain) and j + 1 (odd chain)
          const float* k = Kt + j * 32;
          const __m512 h0 = _mm512_loadu_ps(k), l0 = _mm512_loadu_ps(k + 16), h1 = _mm512_loadu_ps(k + 32), l1 = _mm512_loadu_ps(k + 48);
#pragma GCC unroll 6
          for (int i = 0; i < 6; ++i) {
            even[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][2 * j + 1]), h0, even[i]);
            odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][2 * j + 3]), h1, odd[i]);
            even[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][2 * j]), l0, even[i]);
            odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][2 * j + 2]), l1, odd[i]);
          }
        }
        const __mmask16 keep = static_cast<__mmask16>((1u << nb) - 1u);
        for (int64_t i = 0; i < nr; ++i) {
          _mm512_mask_storeu_ps(S + (r0 + i) * lds + c0, keep, even[i]);
          _mm512_mask_storeu_ps(O + (r0 + i) * lds + c0, keep, odd[i]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c0 = 0; c0 < nk; c0 += 16) {
      const __mmask16 keep = nk - c0 >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nk - c0)) - 1u);
      float *s = S + r * lds + c0, *o = O + r * lds + c0;
      _mm512_mask_storeu_ps(s, keep, _mm512_mul_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(keep, s), _mm512_maskz_loadu_ps(keep, o)), _mm512_set1_ps(scale)));
    }
}

bool fma_scores() {  // the prompt scores' loop: scores_fma on Intel (measured), scores_bf16 elsewhere (not measured)
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// The same scores for few rows (a sample's G own rows), without the transpose: per row, each key's D/32 vdpbf16ps
// give 16 lane partials, and `lane_sums` adds the 16 keys' lanes at once (key c computed into slot REV[c]).
// A last block of at most kFewTail keys sums each key's lanes alone (`_mm512_reduce_add_ps`: the same tree as
// lane_sums, so the same values): a block of 16 costs ~16 keys' dot products whatever its length (measured: up to
// 12 keys the per-key sums are faster, at 15 they are even).
constexpr int64_t kFewTail = 12;
template <int NV32, typename KeyAt>
void scores_bf16_few(const uint16_t* const* qrow, int64_t R, int64_t D, KeyAt key, int64_t nk, float scale, float* S, int64_t lds) {
  const int64_t nv = NV32 ? NV32 : D / 32;  // vectors of 32 bf16 per row (known at compile time for D = 64, 128)
  auto dot = [&](const uint16_t* q, const uint16_t* k) {
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t j = 0; j < nv; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * j), (__m512bh)_mm512_loadu_si512(k + 32 * j));
    return acc;
  };
  for (int64_t c0 = 0; c0 < nk; c0 += 16) {
    const int64_t nb = std::min<int64_t>(16, nk - c0);
    if (nb <= kFewTail) {  // the last block
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < nb; ++c) S[r * lds + c0 + c] = _mm512_reduce_add_ps(dot(qrow[r], key(c0 + c))) * scale;
      break;
    }
    const uint16_t* k[16];
    for (int64_t c = 0; c < 16; ++c) k[REV[c]] = key(c0 + std::min(c, nb - 1));  // a short block repeats its last key
    for (int64_t r = 0; r < R; ++r) {
      vec a[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) a[c] = (vec)dot(qrow[r], k[c]);
      _mm512_mask_storeu_ps(S + r * lds + c0, static_cast<__mmask16>((1u << nb) - 1u), (__m512)(lane_sums(a) * scale));
    }
  }
}
#endif

// acc[r*D + d] += sum_c p[r*ldp + c] * V(c)[d] for r < R, c < n; rows RB at a time, each value row converted
// once per block (V(c): D floats or T values), D in chunks of CH vectors (RB x CH accumulators: up to 24 of
// AVX-512's 32 registers, 8 of AVX2's 16). Rows of p past R up to the next multiple of RB must be readable.
template <int NV, typename T, int RB, typename ValAt>
void weighted_sum(const float* p, int64_t ldp, int64_t R, int64_t n, ValAt val, int64_t D, float* acc) {
  constexpr int64_t CH = (VL == 16 ? 24 : 8) / RB;
  const int64_t nv = NV ? NV : D / VL;
  for (int64_t r0 = 0; r0 < R; r0 += RB) {
    const float* pr[RB];
    for (int i = 0; i < RB; ++i) pr[i] = p + (r0 + i) * ldp;
    for (int64_t j0 = 0; j0 < nv; j0 += CH) {
      const int64_t nj = std::min(CH, nv - j0);
      vec o[RB][CH] = {};
      for (int64_t c = 0; c < n; ++c) {
        const T* v = val(c) + j0 * VL;
        for (int64_t j = 0; j < nj; ++j) {
          const vec x = loadv(v + j * VL);
#pragma GCC unroll 8
          for (int i = 0; i < RB; ++i) o[i][j] += pr[i][c] * x;
        }
      }
      for (int64_t i = 0; i < RB && r0 + i < R; ++i)
        for (int64_t j = 0; j < nj; ++j) {
          float* out = acc + (r0 + i) * D + (j0 + j) * VL;
          storev(out, loadv(out) + o[i][j]);
        }
    }
  }
}

float row_max(const float* x, int64_t n) {
#if defined(__x86_64__) && defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {  // the tail masked: its missing lanes keep m
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    m = _mm512_max_ps(_mm512_mask_loadu_ps(m, k, x + i), m);  // x > m ? x : m
  }
  return _mm512_reduce_max_ps(m);
#else
  vec m = vec{} - INFINITY;
  int64_t i = 0;
  for (; i + VL <= n; i += VL) {
    const vec y = loadv(x + i);
    m = y > m ? y : m;
  }
  float mx = -INFINITY;
  for (int l = 0; l < VL; ++l) mx = m[l] > mx ? m[l] : mx;
  for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return mx;
#endif
}

template <typename T>
struct Job {
  const T *q, *kn, *vn;  // (B, H, D), (B, KV, D), (B, KV, D): strided rows, contiguous heads
  int64_t q0, q1, k0, k1, v0, v1;
  T *kc, *vc;  // (groups, KV, cap, D) contiguous
  T* out;      // (B, H*D)
  const int64_t *member, *off, *prompt;  // (groups*W) batch row or -1, (B,), (groups,)
  int64_t KV, cap, D, G, W, window;
  float scale;
  const T *cos, *sin;  // (B, D) each: this step's RoPE rows, applied to q and the new k as they are read; or null
  T *kp, *vp;            // (rows, KV, D) contiguous: the paged KV the new k/v also go to, at row dst[n]; or null
  const int64_t* dst;    // (B,)
};

// A new key or value row (D values, just written to the region: in L1) to its paged row, which nothing reads this
// step: streamed past the caches where whole lines (no read for ownership of lines that are cold), else copied.
template <typename T>
void to_page(T* out, const T* row, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
#if defined(__AVX512F__)
  if (bytes % 64 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
    for (int64_t c = 0; c < bytes; c += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(reinterpret_cast<char*>(out) + c),
                          _mm512_loadu_si512(reinterpret_cast<const char*>(row) + c));
    return;
  }
#endif
  if (bytes % 32 == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0) {
    for (int64_t c = 0; c < bytes; c += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(reinterpret_cast<char*>(out) + c),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const char*>(row) + c)));
    return;
  }
  std::memcpy(out, row, bytes);
}

struct Span {  // a piece of the scratch buffer
  float* p;
  float* data() const { return p; }
  float& operator[](int64_t i) const { return p[i]; }
};

struct Row {  // a live sample of the task's group
  int64_t m, n, own, p0, j0;  // member, batch row, own keys (incl. the new one), first visible prompt key and own key
};

// The next task's keys and values (its region up to the newest token), prefetched into the cache while a task runs:
// the KV of a layer comes from memory at every step (a step streams all weights between two visits). Each time the
// task asks for a key or value row (its accessors) it issues the next line of each (`tick`), so the misses overlap
// its arithmetic; `upto`
// catches up at fixed points (part/parts of the region by then). Issued only in bursts (upto alone), the
// prefetches queued behind each other and the task waited on them: cold KV cost as much with as without them
// (AMD Zen 4, 3 MB a layer: 297 vs 290 us, against 127 us hot), 254 us with the ticks. Into L2 (T1), not L1 (the
// next task's region, ~130 KB there, is 4x L1): 0.82-0.88x the cold time of T0 prefetches after 32 and 56 tokens,
// in both orders of an in-process A/B on Zen 4, the same hot time.
struct Prefetch {
  const char *k = nullptr, *v = nullptr;
  int64_t bytes = 0, done = 0;
  void upto(int64_t part, int64_t parts) {  // lines up to part/parts of the region, keys and values
    const int64_t stop = bytes * part / parts;
    for (; done < stop; done += 64) {
      _mm_prefetch(k + done, _MM_HINT_T1);
      _mm_prefetch(v + done, _MM_HINT_T1);
    }
  }
  void tick() {  // one more line of the keys and of the values, while any are left
    if (done < bytes) {
      _mm_prefetch(k + done, _MM_HINT_T1);
      _mm_prefetch(v + done, _MM_HINT_T1);
      done += 64;
    }
  }
};

template <typename T>
Prefetch region(const Job<T>& a, int64_t g, int64_t h) {
  int64_t end = 0;
  for (int64_t m = 0; m < a.W; ++m) {
    const int64_t n = a.member[g * a.W + m];
    if (n >= 0) end = std::max(end, a.off[n] + 1);
  }
  return {reinterpret_cast<const char*>(a.kc + (g * a.KV + h) * a.cap * a.D), reinterpret_cast<const char*>(a.vc + (g * a.KV + h) * a.cap * a.D),
          end * a.D * static_cast<int64_t>(sizeof(T)), 0};
}

template <int NV, typename T>
void task(const Job<T>& a, int64_t g, int64_t h, Prefetch& pf) {
  const int64_t D = a.D, G = a.G, W = a.W, P = a.prompt[g];
  T* kc = a.kc + (g * a.KV + h) * a.cap * D;
  T* vc = a.vc + (g * a.KV + h) * a.cap * D;
  thread_local std::vector<Row> rows;
  rows.clear();
  int64_t pmin = P, own_max = 0;
  for (int64_t m = 0; m < W; ++m) {
    const int64_t n = a.member[g * W + m];
    if (n < 0) continue;
    const int64_t o = a.off[n], j = (o - P - m) / W;  // new token: own index j, position P + j
    if (a.cos)  // the new key rotated into its cache row (`rope`'s roundings)
      posttrain_rope::rope_rows(a.kn + n * a.k0 + h * a.k1, a.cos + n * D, a.sin + n * D, kc + o * D, 1, 1, D, 0, 0);
    else
      std::memcpy(kc + o * D, a.kn + n * a.k0 + h * a.k1, D * sizeof(T));
    std::memcpy(vc + o * D, a.vn + n * a.v0 + h * a.v1, D * sizeof(T));
    if (a.kp) {  // the paged copy the prefix cache keeps: a finished sequence's KV is there without a copy
      to_page(a.kp + (a.dst[n] * a.KV + h) * D, kc + o * D, D);
      to_page(a.vp + (a.dst[n] * a.KV + h) * D, vc + o * D, D);
    }
    const int64_t lo = a.window > 0 ? P + j - a.window + 1 : 0;  // first visible position
    Row r{m, n, j + 1, std::min(P, std::max<int64_t>(0, lo)), std::max<int64_t>(0, lo - P)};
    pmin = std::min(pmin, r.p0);
    own_max = std::max(own_max, r.own - r.j0);
    rows.push_back(r);
  }
  const int64_t R = static_cast<int64_t>(rows.size()) * G, np = P - pmin, Ls = std::max<int64_t>(np, 1), Lo = std::max<int64_t>(own_max, 1);
  if (R == 0) return;
  // scratch, kept per thread across tasks and calls: Q (R x D), Kf (16 x D), Sp / So (R + 8 rows: weighted_sum
  // reads whole blocks of rows), acc (R x D, zeroed), Vp (np x D), inv (R)
  thread_local std::vector<float> scratch;
  const int64_t sizes[7] = {R * D, KB * D, (R + 8) * Ls, (R + 8) * Lo, R * D, np * D, R};
  int64_t total = 0;
  for (int64_t z : sizes) total += (z + 15) / 16 * 16;
  if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
  float* parts[7];
  for (int i = 0, at = 0; i < 7; at += (sizes[i] + 15) / 16 * 16, ++i) parts[i] = scratch.data() + at;
  Span Q{parts[0]}, Kf{parts[1]}, Sp{parts[2]}, So{parts[3]}, acc{parts[4]}, Vp{parts[5]}, inv{parts[6]};
  std::fill(acc.data(), acc.data() + R * D, 0.f);
  // sample i's query head j of h: from q, or rotated into qrot (its rows' G heads, once per task) where RoPE is applied here
  thread_local std::vector<T> qrot;
  if (a.cos) {
    qrot.resize(R * D);
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t n = rows[i].n;
      posttrain_rope::rope_rows(a.q + n * a.q0 + h * G * a.q1, a.cos + n * D, a.sin + n * D, qrot.data() + i * G * D, 1, G, D, 0, a.q1);
    }
  }
  auto q_row = [&](int64_t i, int64_t j) { return a.cos ? qrot.data() + (i * G + j) * D : a.q + rows[i].n * a.q0 + (h * G + j) * a.q1; };
  auto prompt_key = [&](int64_t c) { pf.tick(); return kc + (pmin + c) * D; };
  auto float_queries = [&] {  // Q (R x D): every row's query widened to float32 (exactly)
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t j = 0; j < G; ++j) {
        const T* q = q_row(i, j);
        float* out = Q.data() + (i * G + j) * D;
        int64_t d = 0;
        for (; d + VL <= D; d += VL) storev(out + d, loadv(q + d));
        for (; d < D; ++d) out[d] = to_f(q[d]);
      }
  };
  // the next task's KV comes in 3S + 2 parts spread over this one (S samples): after the set-up, the prompt scores,
  // and each sample's own scores, softmax and own values
  const int64_t S = static_cast<int64_t>(rows.size()), steps = 3 * S + 2;
  pf.upto(1, steps);
  // scores: the prompt keys every row sees (shared), then each sample's own keys (its G rows)
#if defined(POSTTRAIN_ATTN_DPBF16)
  if (std::is_same_v<T, uint16_t> && D % 32 == 0) {  // bf16 dot products straight from the bf16 q and keys
    auto bits = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
    thread_local std::vector<const uint16_t*> qrow;
    qrow.resize(R);
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t j = 0; j < G; ++j) qrow[i * G + j] = bits(q_row(i, j));
    if (fma_scores()) {
      float_queries();
      scores_fma(Q.data(), R, D, [&](int64_t c) { return bits(prompt_key(c)); }, np, a.scale, Sp.data(), Ls, Kf.data());
    } else {
      scores_bf16(qrow.data(), R, D, [&](int64_t c) { return bits(prompt_key(c)); }, np, a.scale, Sp.data(), Ls, Kf.data());
    }
    pf.upto(2, steps);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      scores_bf16_few<NV * VL / 32>(qrow.data() + i * G, G, D, [&](int64_t c) { pf.tick(); return bits(kc + (P + (r.j0 + c) * W + r.m) * D); },
                                    r.own - r.j0, a.scale, So.data() + i * G * Lo, Lo);
      pf.upto(3 + i, steps);
    }
  } else
#endif
  {
    float_queries();
    scores<NV, T>(Q.data(), R, D, prompt_key, np, a.scale, Sp.data(), Ls, Kf.data());
    pf.upto(2, steps);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      scores<NV, T>(Q.data() + i * G * D, G, D, [&](int64_t c) { pf.tick(); return kc + (P + (r.j0 + c) * W + r.m) * D; }, r.own - r.j0, a.scale,
                    So.data() + i * G * Lo, Lo, Kf.data());
      pf.upto(3 + i, steps);
    }
  }
  // softmax of each row over its visible keys: unnormalised weights in place, 1 / their sum in inv
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const int64_t skip = r.p0 - pmin, npr = np - skip, nown = r.own - r.j0;
    for (int64_t j = 0; j < G; ++j) {
      float *sp = Sp.data() + (i * G + j) * Ls, *so = So.data() + (i * G + j) * Lo;
      std::fill(sp, sp + skip, 0.f);  // keys before this sample's window weigh nothing
      const float mx = std::max(row_max(sp + skip, npr), row_max(so, nown));
      inv[i * G + j] = 1.f / (exp_sum(sp + skip, npr, mx) + exp_sum(so, nown, mx));
    }
    pf.upto(S + 3 + i, steps);
  }
  // out = weights @ V: the prompt's values in float32 once, for all rows; each sample's own values for its rows
  for (int64_t c = 0; c < np; ++c, pf.tick())
    for (int64_t j = 0; j < D / VL; ++j) storev(Vp.data() + c * D + j * VL, loadv(vc + (pmin + c) * D + j * VL));
  weighted_sum<NV, float, VL == 16 ? 6 : 4>(Sp.data(), Ls, R, np, [&](int64_t c) { return Vp.data() + c * D; }, D, acc.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    auto own_val = [&](int64_t c) { pf.tick(); return vc + (P + (r.j0 + c) * W + r.m) * D; };
    if (G % 3 == 0 && G % 4 != 0)  // a sample's G rows in blocks of 3 (no padding row for G = 3, 6, 9) or 4
      weighted_sum<NV, T, 3>(So.data() + i * G * Lo, Lo, G, r.own - r.j0, own_val, D, acc.data() + i * G * D);
    else
      weighted_sum<NV, T, 4>(So.data() + i * G * Lo, Lo, G, r.own - r.j0, own_val, D, acc.data() + i * G * D);
    for (int64_t j = 0; j < G; ++j) {
      T* o = a.out + r.n * (a.KV * G * D) + (h * G + j) * D;
      const float* x = acc.data() + (i * G + j) * D;
      for (int64_t d = 0; d < D; d += VL) storev(o + d, loadv(x + d) * inv[i * G + j]);  // rounded once to T
    }
    pf.upto(2 * S + 3 + static_cast<int64_t>(i), steps);
  }
}

template <typename T>
void run(const Job<T>& a, int64_t groups) {
  posttrain_par::claimed_for(groups * a.KV, [&](int64_t first) {  // threads claim runs of tasks
    region(a, first / a.KV, first % a.KV).upto(1, 1);  // a thread's first task's KV, all of it before it starts
    return [&](int64_t t, int64_t n) {  // task t; n: this thread's next task, whose KV t's steps prefetch
      Prefetch next = n < groups * a.KV ? region(a, n / a.KV, n % a.KV) : Prefetch{};
      if (a.D == 64)
        task<64 / VL, T>(a, t / a.KV, t % a.KV, next);
      else if (a.D == 128)
        task<128 / VL, T>(a, t / a.KV, t % a.KV, next);
      else
        task<0, T>(a, t / a.KV, t % a.KV, next);
      if (a.kp) _mm_sfence();  // the paged rows' streamed stores drained before the region's end
    };
  });
}

template <typename T>
T* data(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

}  // namespace

// q (B, H, D), k/v (B, KV, D): this step's queries and new keys/values (rows strided, heads D apart);
// k_cache/v_cache (>= groups, KV, cap, D) one layer's group KV, written at `off`; member (groups, W) int64:
// the batch row of each group slot's sample or -1 (idle); off (B,) int64: where each row's new token goes
// (P + j*W + m); prompt (groups,) int64: P per group; window 0 = none; cos/sin (B, D) in q's dtype: RoPE's rows for
// q and k (as `rope` rotates them, bit for bit), or None where q and k come rotated; k_pages/v_pages (rows, KV, D) and
// dst (B,) int64, or None: one layer's paged KV, where row n's new k/v (rotated) also go, at row dst[n] (the engine's
// prefix cache then holds a finished sequence's KV without a copy). Returns (B, H*D) in q's dtype.
torch::Tensor group_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor member, torch::Tensor off, torch::Tensor prompt, double scale, int64_t window,
                              c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin,
                              c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                              c10::optional<torch::Tensor> dst) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "group_attention: bf16 or float32");
  for (const auto& t : {q, k, v, k_cache, v_cache})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt, "group_attention: CPU tensors of one dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "group_attention: shapes");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D && v.stride(1) == D,
              "group_attention: heads of q/k/v contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == KV && k_cache.size(3) == D, "group_attention: cache (groups, KV, cap, D)");
  TORCH_CHECK(D % 16 == 0 && D <= 256 && H % KV == 0 && k.size(0) == B && v.size(0) == B, "group_attention: D a multiple of 16 up to 256, H a multiple of KV");
  TORCH_CHECK(member.dim() == 2 && member.size(0) <= k_cache.size(0) && member.is_contiguous() && off.is_contiguous() && prompt.is_contiguous() &&
                  member.scalar_type() == at::kLong && off.scalar_type() == at::kLong && prompt.scalar_type() == at::kLong && off.numel() == B &&
                  prompt.numel() == member.size(0),
              "group_attention: member (groups, W), off (B,), prompt (groups,) int64");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "group_attention: cos and sin together");
  for (const auto& t : {cos, sin})
    TORCH_CHECK(!t.has_value() || (t->device().is_cpu() && t->scalar_type() == dt && t->is_contiguous() && t->dim() == 2 &&
                                   t->size(0) == B && t->size(1) == D),
                "group_attention: cos/sin (B, D) contiguous CPU tensors of q's dtype");
  TORCH_CHECK(k_pages.has_value() == v_pages.has_value() && k_pages.has_value() == dst.has_value(),
              "group_attention: k_pages, v_pages and dst together");
  if (k_pages) {
    TORCH_CHECK(k_pages->device().is_cpu() && k_pages->scalar_type() == dt && k_pages->is_contiguous() && v_pages->is_contiguous() &&
                    k_pages->dim() == 3 && k_pages->sizes() == v_pages->sizes() && k_pages->size(1) == KV && k_pages->size(2) == D,
                "group_attention: k_pages/v_pages (rows, KV, D) contiguous, q's dtype");
    TORCH_CHECK(dst->device().is_cpu() && dst->scalar_type() == at::kLong && dst->is_contiguous() && dst->numel() == B,
                "group_attention: dst (B,) int64");
    const int64_t* d = dst->data_ptr<int64_t>();
    for (int64_t n = 0; n < B; ++n)
      TORCH_CHECK(d[n] >= 0 && d[n] < k_pages->size(0), "group_attention: dst ", d[n], " outside the ", k_pages->size(0), " paged rows");
  }
  auto out = torch::empty({B, H * D}, q.options());
  const int64_t groups = member.size(0);
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Job<T> a{data<T>(q), data<T>(k), data<T>(v), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             data<T>(k_cache), data<T>(v_cache), data<T>(out), member.data_ptr<int64_t>(), off.data_ptr<int64_t>(),
             prompt.data_ptr<int64_t>(), KV, k_cache.size(2), D, H / KV, member.size(1), window, static_cast<float>(scale),
             cos ? data<T>(*cos) : nullptr, sin ? data<T>(*sin) : nullptr, k_pages ? data<T>(*k_pages) : nullptr,
             v_pages ? data<T>(*v_pages) : nullptr, dst ? dst->data_ptr<int64_t>() : nullptr};
    run<T>(a, groups);
  };
  if (dt == at::kBFloat16)
    fill(static_cast<uint16_t*>(nullptr));
  else
    fill(static_cast<float*>(nullptr));
  return out;
}

bool group_attention_available() { return true; }

// Whether group_attention scores the prompt with scores_fma on this CPU (the loop the tests hold to vdpbf16ps).
bool attention_fma_scores() {
#if defined(POSTTRAIN_ATTN_DPBF16)
  return fma_scores();
#else
  return false;
#endif
}

// The two prompt-score loops of AVX-512 BF16 builds on their own, for the tests that hold them equal bit for bit:
// q (R, D) and keys (n, D) bf16, D a multiple of 32 -> (R, n) float32 scores, from scores_fma (fma) or scores_bf16.
// Builds without AVX-512 BF16 have neither and return an empty tensor.
torch::Tensor prompt_scores(torch::Tensor q, torch::Tensor keys, double scale, bool fma) {
#if defined(POSTTRAIN_ATTN_DPBF16)
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 && q.is_contiguous() && keys.is_contiguous() &&
                  q.dim() == 2 && keys.dim() == 2 && q.size(1) == keys.size(1) && q.size(1) % 32 == 0 && keys.size(0) > 0,
              "prompt_scores: contiguous bf16 q (R, D) and keys (n, D), D a multiple of 32");
  const int64_t R = q.size(0), n = keys.size(0), D = q.size(1);
  auto S = torch::empty({R, n}, q.options().dtype(at::kFloat));
  std::vector<float> Kt(16 * D), Qf(R * D);
  const auto* k = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto key = [&](int64_t c) { return k + c * D; };
  if (fma) {
    for (int64_t i = 0; i < R * D; ++i) Qf[i] = to_f(qp[i]);
    scores_fma(Qf.data(), R, D, key, n, static_cast<float>(scale), S.data_ptr<float>(), n, Kt.data());
  } else {
    std::vector<const uint16_t*> rows(R);
    for (int64_t r = 0; r < R; ++r) rows[r] = qp + r * D;
    scores_bf16(rows.data(), R, D, key, n, static_cast<float>(scale), S.data_ptr<float>(), n, Kt.data());
  }
  return S;
#else
  return torch::empty({0});
#endif
}

#else
bool group_attention_available() { return false; }
torch::Tensor prompt_scores(torch::Tensor, torch::Tensor, double, bool) { return torch::empty({0}); }
bool attention_fma_scores() { return false; }
torch::Tensor group_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                              torch::Tensor, double, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "group_attention needs GCC >= 12 or Clang");
}
#endif
