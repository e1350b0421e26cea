// Fused CPU kernels for training (forward and backward), parallel over rows with ATen's thread pool.
// Each replaces a chain of eager ops that reads and writes whole activations several times:
//
//   rmsnorm_fwd(x, w, eps) -> (out, rstd)     fp32 HF RMSNorm: r = 1/sqrt(mean(x^2) + eps); out = w * (x * r)
//   rmsnorm_bwd(go, x, w, rstd) -> (gx, gw)   gy = go*w; gx = r*gy - x * r^3 * <gy, x>/D; gw = sum_rows go * (x*r)
//   swiglu_fwd(g, u) -> h                     h = silu(g) * u, silu(g) = g / (1 + exp(-g)), fp32
//   swiglu_bwd(gh, g, u) -> (gg, gu)          gu = gh*s, gs = gh*u, gg = gs * sig * (1 + g*(1 - sig))
//   rope_fwd(x, cos, sin) -> y                HF's x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1):
//                                             y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2; x float32 or bf16, y float32
//   rope_bwd(gy, cos, sin, bf16) -> gx        the transposed map: gx1 = gy1*c1 + gy2*s2, gx2 = gy2*c2 - gy1*s1
//   bf16_split(x) -> (xb, xr)                 float32 x -> bf16 cast and its float32 widening, one pass
//   round_bf16_(t)                            float32 t rounded to bf16 precision in place
//
// RMSNorm and SwiGLU: float32 only; under bf16 autocast the norms still see float32, and a bf16 SwiGLU pass measured no faster than
// the eager ops (2.67 vs 2.41 ms at (1024, 1536)). exp is a Cephes-style polynomial (< 2 ulp) written so the
// loops vectorize (the SwiGLU forward as AVX2 instructions: the compiled loop kept its clamps as compare + blend, 4x
// slower on AMD Zen 3); PyTorch's SLEEF exp differs from it by an ulp at most. RMSNorm's sums run in another order
// than PyTorch's reductions (a few ulps). Tests bound both (tests/test_ops_layers.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), exp(r) by Cephes' expf polynomial
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_approx on 8 lanes, the same steps written as AVX2 instructions (the compiler left the scalar form's
// clamps as compare + blend and ran SwiGLU at ~2.5 ns per element on AMD Zen 3)
inline __m256 exp_approx8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// h[i] = g[i] / (1 + exp(-g[i])) * u[i] for i < n, 8 at a time; a short tail through zero-padded vectors, so every
// element takes the same instructions
inline void silu_mul(const float* g, const float* u, float* h, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  auto body = [&](__m256 gv, __m256 uv) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(h + i, body(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ht[8];
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    _mm256_store_ps(ht, body(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::memcpy(h + i, ht, (n - i) * sizeof(float));
  }
}

// SwiGLU's backward for i < n, 8 at a time (the tail zero-padded, as silu_mul): with e = 1 + exp(-g), sig = 1/e,
// gu = gh * (g / e) and gg = (gh * u) * sig * (1 + g * (1 - sig)). The `omp simd` loop it replaces compiled
// exp's clamps to compare + blend too and ran at 1.8 ms for (800, 1536) on AMD Zen 2, 3.8x the forward
inline void silu_mul_bwd(const float* gh, const float* g, const float* u, float* gg, float* gu, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  auto body = [&](__m256 dy, __m256 x, __m256 uv, __m256& dg, __m256& du) {
    const __m256 e = _mm256_add_ps(one, exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    const __m256 sig = _mm256_div_ps(one, e);
    du = _mm256_mul_ps(dy, _mm256_div_ps(x, e));
    const __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, sig)));
    dg = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dy, uv), sig), slope);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 dg, du;
    body(_mm256_loadu_ps(gh + i), _mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), dg, du);
    _mm256_storeu_ps(gg + i, dg);
    _mm256_storeu_ps(gu + i, du);
  }
  if (i < n) {
    alignas(32) float ht[8] = {}, gt[8] = {}, ut[8] = {}, dgt[8], dut[8];
    std::memcpy(ht, gh + i, (n - i) * sizeof(float));
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    __m256 dg, du;
    body(_mm256_load_ps(ht), _mm256_load_ps(gt), _mm256_load_ps(ut), dg, du);
    _mm256_store_ps(dgt, dg);
    _mm256_store_ps(dut, du);
    std::memcpy(gg + i, dgt, (n - i) * sizeof(float));
    std::memcpy(gu + i, dut, (n - i) * sizeof(float));
  }
}
#else
inline void silu_mul(const float* g, const float* u, float* h, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}

inline void silu_mul_bwd(const float* gh, const float* g, const float* u, float* gg, float* gu, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], ex = 1.0f + exp_approx(-x), sig = 1.0f / ex;
    gu[i] = gh[i] * (x / ex);
    gg[i] = (gh[i] * u[i]) * sig * (1.0f + x * (1.0f - sig));
  }
}
#endif

constexpr int64_t kGrain = 1 << 14;  // elements per task of the elementwise kernels

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, name,
              ": a contiguous float32 CPU tensor is required");
}

}  // namespace

torch::Tensor swiglu_fwd(torch::Tensor g, torch::Tensor u) {
  TORCH_CHECK(g.sizes() == u.sizes(), "swiglu_fwd: g and u of one shape");
  if (g.dim() == 2 && !(g.is_contiguous() && u.is_contiguous())) {  // rows of a wider tensor (the engine's gate|up halves)
    for (const auto& t : {g, u})
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.stride(1) == 1,
                  "swiglu_fwd: float32 CPU rows with contiguous columns");
    const int64_t N = g.size(0), I = g.size(1), lg = g.stride(0), lu = u.stride(0);
    auto h = torch::empty({N, I}, g.options());
    const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    at::parallel_for(0, N, std::max<int64_t>(1, kGrain / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        silu_mul(gp + r * lg, up + r * lu, hp + r * I, I);
      }
    });
    return h;
  }
  check_f32(g, "g");
  check_f32(u, "u");
  auto h = torch::empty_like(g);
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t b, int64_t e) { silu_mul(gp + b, up + b, hp + b, e - b); });
  return h;
}

std::vector<torch::Tensor> swiglu_bwd(torch::Tensor gh, torch::Tensor g, torch::Tensor u) {
  check_f32(gh, "gh");
  check_f32(g, "g");
  check_f32(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes() && gh.sizes() == g.sizes(), "swiglu_bwd: gh, g and u of one shape");
  auto gg = torch::empty_like(g), gu = torch::empty_like(u);
  const float *ghp = gh.data_ptr<float>(), *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float *ggp = gg.data_ptr<float>(), *gup = gu.data_ptr<float>();
  at::parallel_for(0, g.numel(), kGrain,
                   [&](int64_t b, int64_t e) { silu_mul_bwd(ghp + b, gp + b, up + b, ggp + b, gup + b, e - b); });
  return {gg, gu};
}

std::vector<torch::Tensor> rmsnorm_fwd(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() == 2 && w.dim() == 1 &&
                  w.size(0) == x.size(1),
              "rmsnorm_fwd: float32 x (N, D), w (D,)");
  const int64_t N = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
  auto rstd = torch::empty({N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *op = out.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  const float fe = static_cast<float>(eps), fd = static_cast<float>(D);
  at::parallel_for(0, N, std::max<int64_t>(1, kGrain / D), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* r = xp + i * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < D; ++j) ss += r[j] * r[j];
      const float inv = 1.0f / std::sqrt(ss / fd + fe);
      rp[i] = inv;
      float* o = op + i * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) o[j] = wp[j] * (r[j] * inv);
    }
  });
  return {out, rstd};
}

std::vector<torch::Tensor> rmsnorm_bwd(torch::Tensor go, torch::Tensor x, torch::Tensor w, torch::Tensor rstd) {
  check_f32(go, "go");
  check_f32(x, "x");
  check_f32(w, "w");
  check_f32(rstd, "rstd");
  TORCH_CHECK(go.sizes() == x.sizes() && go.scalar_type() == at::kFloat && x.dim() == 2 && rstd.size(0) == x.size(0),
              "rmsnorm_bwd: float32 go and x (N, D), rstd (N,)");
  const int64_t N = x.size(0), D = x.size(1);
  const int threads = at::get_num_threads();
  auto gx = torch::empty_like(x);
  auto partial = torch::zeros({threads, D}, x.options());  // gw per thread, summed below
  const float *gop = go.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float *gxp = gx.data_ptr<float>(), *pp = partial.data_ptr<float>();
  const float fd = static_cast<float>(D);
  at::parallel_for(0, N, std::max<int64_t>(1, kGrain / D), [&](int64_t b, int64_t e) {
    float* gw = pp + static_cast<int64_t>(at::get_thread_num()) * D;
    for (int64_t i = b; i < e; ++i) {
      const float *g = gop + i * D, *r = xp + i * D;
      const float inv = rp[i];
      float dot = 0.f;  // <go*w, x>
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < D; ++j) dot += g[j] * wp[j] * r[j];
      const float c = inv * inv * inv * dot / fd;
      float* o = gxp + i * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        o[j] = inv * (g[j] * wp[j]) - c * r[j];
        gw[j] += g[j] * (r[j] * inv);
      }
    }
  });
  return {gx, partial.sum(0)};
}

// ---------------------------------------------------------------- RoPE for training
// x (B, H, T, D) with any strides (HF's q/k are transposed views of (B, T, H, D)), cos/sin (B or 1, T, D) float32.
// The output is float32 laid out (B, T, H, D), as the eager ops lay it out, returned as its (B, H, T, D) view.
// Equal to the eager ops bit for bit: each product is rounded, then the two are added (no FMA contraction here),
// and for a bf16 x the gradient rounds each path's product to bf16 before adding, as autograd does.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif
namespace {

using posttrain_bf16::bf2f;
using posttrain_bf16::f2bf;
using posttrain_bf16::round_bf;

inline float val(float v) { return v; }
inline float val(at::BFloat16 v) { return bf2f(v.x); }

struct RopeShape {
  int64_t B, H, T, D, sb, sh, st, cb;  // sizes; strides of x (b, h, t); batch stride of cos/sin (0: broadcast)
};

RopeShape rope_shape(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rope: x (B, H, T, D), last dimension contiguous and even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 3 &&
                  (cos.size(0) == x.size(0) || cos.size(0) == 1) && cos.size(1) == x.size(2) && cos.size(2) == x.size(3),
              "rope: cos/sin float32 contiguous (B or 1, T, D)");
  const int64_t T = x.size(2), D = x.size(3);
  return {x.size(0), x.size(1), T, D, x.stride(0), x.stride(1), x.stride(2), cos.size(0) == 1 ? 0 : T * D};
}

// body(c, s, x offset, output offset) for every (b, t, h), in parallel over the (b, t) rows
template <typename Body>
void each_head(const RopeShape& a, const float* cp, const float* sp, Body body) {
  at::parallel_for(0, a.B * a.T, std::max<int64_t>(1, kGrain / (a.H * a.D)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / a.T, t = r % a.T;
      const float *c = cp + b * a.cb + t * a.D, *s = sp + b * a.cb + t * a.D;
      for (int64_t h = 0; h < a.H; ++h) body(c, s, b * a.sb + h * a.sh + t * a.st, (r * a.H + h) * a.D);
    }
  });
}

template <typename In>
void rope_fwd_impl(const In* xp, const float* cp, const float* sp, float* yp, const RopeShape& a) {
  const int64_t half = a.D / 2;
  each_head(a, cp, sp, [&](const float* c, const float* s, int64_t in, int64_t out) {
    const In* x = xp + in;
    float* y = yp + out;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = val(x[d]), x2 = val(x[d + half]);
      y[d] = x1 * c[d] - x2 * s[d];
      y[d + half] = x2 * c[d + half] + x1 * s[d + half];
    }
  });
}

template <typename Out>
void rope_bwd_impl(const float* gp, const float* cp, const float* sp, Out* xp, const RopeShape& a) {
  const int64_t half = a.D / 2;
  each_head(a, cp, sp, [&](const float* c, const float* s, int64_t in, int64_t out) {
    const float* g = gp + in;
    Out* o = xp + out;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float g1 = g[d], g2 = g[d + half];
      if constexpr (std::is_same_v<Out, float>) {
        o[d] = g1 * c[d] + g2 * s[d + half];
        o[d + half] = g2 * c[d + half] - g1 * s[d];
      } else {  // bf16: each path's gradient rounded, then the bf16 sum
        o[d].x = f2bf(round_bf(g1 * c[d]) + round_bf(g2 * s[d + half]));
        o[d + half].x = f2bf(round_bf(g2 * c[d + half]) - round_bf(g1 * s[d]));
      }
    }
  });
}

torch::Tensor bthd(const RopeShape& a, at::ScalarType dtype) {  // (B, T, H, D) memory, viewed as (B, H, T, D)
  return torch::empty({a.B, a.T, a.H, a.D}, torch::TensorOptions().dtype(dtype)).transpose(1, 2);
}

}  // namespace

torch::Tensor rope_fwd(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const RopeShape a = rope_shape(x, cos, sin);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rope_fwd: x float32 or bf16");
  auto y = bthd(a, at::kFloat);
  if (x.scalar_type() == at::kFloat)
    rope_fwd_impl(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), a);
  else
    rope_fwd_impl(x.data_ptr<at::BFloat16>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), a);
  return y;
}

torch::Tensor rope_bwd(torch::Tensor gy, torch::Tensor cos, torch::Tensor sin, bool bf16) {
  const RopeShape a = rope_shape(gy, cos, sin);
  TORCH_CHECK(gy.scalar_type() == at::kFloat, "rope_bwd: gy float32");
  auto gx = bthd(a, bf16 ? at::kBFloat16 : at::kFloat);
  if (bf16)
    rope_bwd_impl(gy.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), gx.data_ptr<at::BFloat16>(), a);
  else
    rope_bwd_impl(gy.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), gx.data_ptr<float>(), a);
  return gx;
}
#pragma GCC pop_options

// ---------------------------------------------------------------- bf16 rounding for fp32 GEMMs over bf16 values
// bf16_split(x) -> (xb, xr)   x float32 -> its bf16 cast xb and the same values widened to float32 xr, one pass
// round_bf16_(t)             float32 t rounded to bf16's precision in place (t.to(bf16).float() without a copy)
// Both round to nearest even with NaN -> 0x7fc0, as c10::BFloat16 does: the results equal torch's casts bit for bit.
std::vector<torch::Tensor> bf16_split(torch::Tensor x) {
  check_f32(x, "x");
  auto xb = torch::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  auto xr = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  uint16_t* b = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  float* r = xr.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const uint16_t h = posttrain_bf16::f2bf(src[i]);
      b[i] = h;
      r[i] = posttrain_bf16::bf2f(h);
    }
  });
  return {xb, xr};
}

torch::Tensor round_bf16_(torch::Tensor t) {
  check_f32(t, "t");
  float* p = t.data_ptr<float>();
  at::parallel_for(0, t.numel(), kGrain, [&](int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) p[i] = posttrain_bf16::round_bf(p[i]);
  });
  return t;
}
