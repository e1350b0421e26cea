// Fused CPU kernels for training (forward and backward), parallel over rows with ATen's thread pool.
// Each replaces a chain of eager ops that reads and writes whole activations several times:
//
//   rmsnorm_fwd(x, w, eps) -> (out, rstd)     fp32 HF RMSNorm: r = 1/sqrt(mean(x^2) + eps); out = w * (x * r)
//   rmsnorm_bwd(go, x, w, rstd) -> (gx, gw)   gy = go*w; gx = r*gy - x * r^3 * <gy, x>/D; gw = sum_rows go * (x*r)
//   swiglu_fwd(g, u) -> h                     h = silu(g) * u, silu(g) = g / (1 + exp(-g)), fp32 or bf16
//   swiglu_bwd(gh, g, u) -> (gg, gu)          gu = gh*s, gs = gh*u, gg = gs * sig * (1 + g*(1 - sig))
//
// bf16 tensors round each intermediate the eager ops round (silu's output, each product), with the math in
// float as PyTorch's bf16 kernels do. exp is a Cephes-style polynomial (< 2 ulp in float) written so the
// loops vectorize; PyTorch's SLEEF exp differs from it by an ulp at most. RMSNorm's sums run in another order
// than PyTorch's reductions (a few float ulps). Tests bound both (tests/test_train_kernels.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using posttrain_bf16::bf2f;
using posttrain_bf16::f2bf;

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

// element access for float and bf16 (stored as uint16_t); rnd = the rounding of a stored intermediate
struct F32 {
  using T = float;
  static float ld(float v) { return v; }
  static float st(float v) { return v; }
  static float rnd(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static float ld(uint16_t v) { return bf2f(v); }
  static uint16_t st(float v) { return f2bf(v); }
  static float rnd(float v) { return bf2f(f2bf(v)); }
};

constexpr int64_t kGrain = 1 << 14;  // elements per task of the elementwise kernels

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, ": a contiguous CPU tensor is required");
}

template <class E>
void swiglu_fwd_impl(const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& h) {
  using T = typename E::T;
  const T* gp = reinterpret_cast<const T*>(g.data_ptr());
  const T* up = reinterpret_cast<const T*>(u.data_ptr());
  T* hp = reinterpret_cast<T*>(h.data_ptr());
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t b, int64_t e) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float x = E::ld(gp[i]);
      const float s = E::rnd(x / (1.0f + exp_approx(-x)));
      hp[i] = E::st(s * E::ld(up[i]));
    }
  });
}

template <class E>
void swiglu_bwd_impl(const torch::Tensor& gh, const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& gg,
                     torch::Tensor& gu) {
  using T = typename E::T;
  const T* ghp = reinterpret_cast<const T*>(gh.data_ptr());
  const T* gp = reinterpret_cast<const T*>(g.data_ptr());
  const T* up = reinterpret_cast<const T*>(u.data_ptr());
  T* ggp = reinterpret_cast<T*>(gg.data_ptr());
  T* gup = reinterpret_cast<T*>(gu.data_ptr());
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t b, int64_t e) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float x = E::ld(gp[i]), dy = E::ld(ghp[i]);
      const float ex = 1.0f + exp_approx(-x);
      const float sig = 1.0f / ex;
      gup[i] = E::st(dy * E::rnd(x / ex));
      const float gs = E::rnd(dy * E::ld(up[i]));
      ggp[i] = E::st(gs * sig * (1.0f + x * (1.0f - sig)));
    }
  });
}

}  // namespace

torch::Tensor swiglu_fwd(torch::Tensor g, torch::Tensor u) {
  check(g, "g");
  check(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(), "swiglu: g and u of one shape and dtype");
  auto h = torch::empty_like(g);
  if (g.scalar_type() == at::kFloat) {
    swiglu_fwd_impl<F32>(g, u, h);
  } else {
    TORCH_CHECK(g.scalar_type() == at::kBFloat16, "swiglu: float32 or bfloat16");
    swiglu_fwd_impl<BF16>(g, u, h);
  }
  return h;
}

std::vector<torch::Tensor> swiglu_bwd(torch::Tensor gh, torch::Tensor g, torch::Tensor u) {
  check(gh, "gh");
  check(g, "g");
  check(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes() && gh.sizes() == g.sizes() && g.scalar_type() == u.scalar_type() &&
                  gh.scalar_type() == g.scalar_type(),
              "swiglu_bwd: gh, g and u of one shape and dtype");
  auto gg = torch::empty_like(g), gu = torch::empty_like(u);
  if (g.scalar_type() == at::kFloat) {
    swiglu_bwd_impl<F32>(gh, g, u, gg, gu);
  } else {
    TORCH_CHECK(g.scalar_type() == at::kBFloat16, "swiglu_bwd: float32 or bfloat16");
    swiglu_bwd_impl<BF16>(gh, g, u, gg, gu);
  }
  return {gg, gu};
}

std::vector<torch::Tensor> rmsnorm_fwd(torch::Tensor x, torch::Tensor w, double eps) {
  check(x, "x");
  check(w, "w");
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
  check(go, "go");
  check(x, "x");
  check(w, "w");
  check(rstd, "rstd");
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
