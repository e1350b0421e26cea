// The engine's plain sampling rows (temperature > 0, no top-k / top-p) in two passes over the logits,
// in place of posttrain/ops/sampling.py's eager path (max, float copy, subtract, exp, chunk sums: five
// passes and two (N, V) float32 temporaries). Same draw rule (`_inverse_cdf`):
//
//   y = float(x) / t - float(max x) / t              (t = 1: float(x) - float(max x), as the eager ops)
//   w = exp(y)                                       (SLEEF expf u10, the routine torch's exp runs on x86)
//   chunk sums s_c (C chunks of W = ceil(V / C) tokens, float32), csum = float64 cumsum, total = csum[C-1]
//   target = u * total; chunk c = #{csum <= target} (clamped to C-1); inside it the float64 cdf
//   csum[c-1] + cumsum(w) picks j = #{cdf <= target}, capped at the chunk's last token of w > 0
//   token = c*W + j, log-prob = y[token] - float(log(total))
//
// Only the order in which a chunk's float32 sum is added differs from torch's reduction, so a draw can
// differ only where u*total falls within rounding of a CDF step. Threads claim runs of rows (claimed.h).
//
// Also here: the trainer's kept softmax over the LM head's logits (`softmax_rows_`, ops/logprobs.py), the same
// max / exp / sum passes over rows of float32 logits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "bf16.h"
#include "claimed.h"

// sampling.counter_uniforms in one pass (its eager form is ~30 small tensor ops: 0.4 ms of a 64-row decode step):
// u = (h >> 8) / 2^24 with h = lowbias32 hashes of the step, the sample index and the seed's two 32-bit halves in turn
namespace {
inline uint32_t lowbias32(uint32_t x) {  // Chris Wellons' integer hash
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

inline double uniform_of(int64_t seed, int64_t sample_index, int64_t step) {
  const uint64_t bits = static_cast<uint64_t>(seed);
  uint32_t h = lowbias32(static_cast<uint32_t>(step) ^ 0x5bd1e995u);
  h = lowbias32(h ^ static_cast<uint32_t>(sample_index));
  h = lowbias32(h ^ static_cast<uint32_t>(bits));
  h = lowbias32(h ^ static_cast<uint32_t>(bits >> 32));
  return static_cast<double>(h >> 8) / static_cast<double>(1 << 24);
}
}  // namespace

// `what`'s arguments must be contiguous CPU tensors of `dtype` (also step_kernel.cpp's)
void check_rows(const char* what, std::initializer_list<torch::Tensor> ts, torch::ScalarType dtype) {
  for (const auto& t : ts)
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), what, ": contiguous ",
                c10::toString(dtype), " CPU tensors");
}

torch::Tensor counter_uniforms(torch::Tensor seed, torch::Tensor sample_index, torch::Tensor step) {
  check_rows("counter_uniforms", {seed, sample_index, step}, at::kLong);
  TORCH_CHECK(sample_index.numel() == seed.numel() && step.numel() == seed.numel(), "counter_uniforms: tensors of one size");
  auto out = torch::empty(seed.sizes(), seed.options().dtype(at::kDouble));
  const auto *s = seed.data_ptr<int64_t>(), *m = sample_index.data_ptr<int64_t>(), *k = step.data_ptr<int64_t>();
  double* u = out.data_ptr<double>();
  for (int64_t i = 0; i < seed.numel(); ++i) u[i] = uniform_of(s[i], m[i], k[i]);
  return out;
}

// counter_uniforms(seed[rows], sample_index[rows], ngen[rows]) for the engine's slots `rows` (N,) in one call (the
// gathers are small tensor ops, each tens of microseconds in a decode step: step_kernel.cpp says why).
torch::Tensor row_uniforms(torch::Tensor seed, torch::Tensor sample_index, torch::Tensor ngen, torch::Tensor rows) {
  check_rows("row_uniforms", {seed, sample_index, ngen, rows}, at::kLong);
  TORCH_CHECK(sample_index.numel() == seed.numel() && ngen.numel() == seed.numel(), "row_uniforms: per-slot tensors of one size");
  auto out = torch::empty({rows.numel()}, seed.options().dtype(at::kDouble));
  const auto *s = seed.data_ptr<int64_t>(), *m = sample_index.data_ptr<int64_t>(), *g = ngen.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  double* u = out.data_ptr<double>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < seed.numel(), "row_uniforms: row ", r[i], " outside ", seed.numel(), " slots");
    u[i] = uniform_of(s[r[i]], m[r[i]], g[r[i]]);
  }
  return out;
}

#if defined(__x86_64__) && defined(__AVX2__)  // built with -march=native: AVX2 machines (else the eager path runs)
namespace {

using posttrain_bf16::to_f;
using posttrain_vec::exp_block;
using posttrain_vec::load8;

// Weights exp(y - shift) of x[0..n), y = float(x) / t (t = 1 takes x as is: dividing by 1 is exact; other t
// divide per element, as the eager x.float() / t); their float32 sum, the weights in `out` when given.
template <typename T>
float weights(const T* x, int64_t n, float t, float shift, float* out, std::vector<float>& scratch) {
  if (t == 1.f) return exp_block<T>(x, n, shift, out);
  scratch.resize(n);
  for (int64_t i = 0; i < n; ++i) scratch[i] = to_f(x[i]) / t;
  return exp_block<float>(scratch.data(), n, shift, out);
}

template <typename T>
float row_max(const T* x, int64_t V) {  // 8 lanes, 4 accumulators (the loads overlap)
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    m0 = _mm256_max_ps(m0, load8(x + i));
    m1 = _mm256_max_ps(m1, load8(x + i + 8));
    m2 = _mm256_max_ps(m2, load8(x + i + 16));
    m3 = _mm256_max_ps(m3, load8(x + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float mx = lanes[0];
  for (int l = 1; l < 8; ++l) mx = std::max(mx, lanes[l]);
  for (; i < V; ++i) mx = std::max(mx, to_f(x[i]));
  return mx;
}

template <typename T>
void sample_row(const T* x, int64_t V, float t, double u, int64_t chunks, int64_t* tok, float* lp, std::vector<double>& csum,
                std::vector<float>& w, std::vector<float>& scratch) {
  const float shift = row_max<T>(x, V) / t;  // max(x / t) = max(x) / t: rounding is monotone
  const int64_t W = (V + chunks - 1) / chunks;
  auto span = [&](int64_t c) { const int64_t a = std::min(V, c * W); return std::make_pair(a, std::min(V, a + W) - a); };
  csum.resize(chunks);
  double run = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const auto [a, n] = span(c);
    csum[c] = run += static_cast<double>(weights<T>(x + a, n, t, shift, nullptr, scratch));
  }
  const double total = csum[chunks - 1], target = u * total;
  const int64_t c = std::min<int64_t>(std::upper_bound(csum.begin(), csum.end(), target) - csum.begin(), chunks - 1);
  const auto [a, n] = span(c);
  w.assign(W, 0.f);
  weights<T>(x + a, n, t, shift, w.data(), scratch);
  int64_t j = W, last = W - 1;
  double cdf = c > 0 ? csum[c - 1] : 0.0;
  for (int64_t i = 0; i < W; ++i) {  // first cdf > target
    cdf += static_cast<double>(w[i]);
    if (cdf > target) { j = i; break; }
  }
  for (int64_t i = W - 1; i >= 0; --i)
    if (w[i] > 0.f) { last = i; break; }
  const int64_t k = c * W + std::min(j, last);
  *tok = k;
  *lp = (to_f(x[k]) / t - shift) - static_cast<float>(std::log(total));
}

// Sum of 8 float lanes added into two double accumulators (4 lanes each).
inline void add_pd(__m256d& lo, __m256d& hi, __m256 w) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
}

inline double sum_pd(__m256d lo, __m256d hi) {
  alignas(32) double l[4];
  _mm256_store_pd(l, _mm256_add_pd(lo, hi));
  return (l[0] + l[1]) + (l[2] + l[3]);
}

// One pass over a row of V float32 logits: y = z - shift, w = exp(y) (SLEEF expf u10 written out, posttrain_vec::exp8:
// four vectors interleaved, the tail through a zero-padded vector as exp_block), w written over z when `store`;
// returns (sum w, sum w*y) in double, added 8 lanes at a time in order.
std::pair<double, double> exp_pass(float* z, int64_t V, float shift, bool store, bool weighted) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, t0 = s0, t1 = s0;
  alignas(32) float buf[8];
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    __m256 y[4], w[4];
    for (int j = 0; j < 4; ++j) w[j] = y[j] = _mm256_sub_ps(_mm256_loadu_ps(z + i + 8 * j), sh);
    posttrain_vec::exp8<4>(w);
    for (int j = 0; j < 4; ++j) {
      if (store) _mm256_storeu_ps(z + i + 8 * j, w[j]);
      add_pd(s0, s1, w[j]);
      if (weighted) add_pd(t0, t1, _mm256_mul_ps(w[j], y[j]));
    }
  }
  for (; i < V; i += 8) {
    const int64_t k = std::min<int64_t>(8, V - i);
    __m256 y;
    if (k == 8) {
      y = _mm256_sub_ps(_mm256_loadu_ps(z + i), sh);
    } else {
      for (int64_t l = 0; l < 8; ++l) buf[l] = l < k ? z[i + l] : 0.f;
      y = _mm256_sub_ps(_mm256_load_ps(buf), sh);
    }
    __m256 w = posttrain_vec::exp8(y);
    if (k < 8) {  // padding weighs nothing
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), lane));
      w = _mm256_and_ps(w, keep);
      y = _mm256_and_ps(y, keep);
    }
    if (store) {
      if (k == 8) {
        _mm256_storeu_ps(z + i, w);
      } else {
        _mm256_store_ps(buf, w);
        std::memcpy(z + i, buf, k * sizeof(float));
      }
    }
    add_pd(s0, s1, w);
    if (weighted) add_pd(t0, t1, _mm256_mul_ps(w, y));
  }
  return {sum_pd(s0, s1), weighted ? sum_pd(t0, t1) : 0.0};
}

}  // namespace

bool sample_kernel_available() { return true; }

// The kept softmax of the trainer's LM head (ops/logprobs.py `_softmax_in_place`), rows in parallel, in place:
//   m = max z, lse = m + log sum exp(z - m) (the sum in double), logp = z[target] - lse,
//   z <- p = exp(z - lse)  (what a recomputing backward forms from the saved lse, with the same exp routine),
//   entropy = -sum p * (z - lse) (double sum; only when asked).
std::vector<torch::Tensor> softmax_rows_(torch::Tensor z, torch::Tensor targets, bool want_entropy) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.dim() == 2 && z.stride(1) == 1, "z: (N, V) float32 CPU, rows contiguous");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous() && targets.numel() == z.size(0), "targets: (N,) int64");
  const int64_t N = z.size(0), V = z.size(1), ld = z.stride(0);
  TORCH_CHECK(V >= 1, "V >= 1");
  auto logp = torch::empty({N}, z.options()), lse = torch::empty({N}, z.options());
  auto ent = want_entropy ? torch::empty({N}, z.options()) : torch::empty({0}, z.options());
  float* zp = z.data_ptr<float>();
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "targets: row ", r, " is ", tp[r], ", outside [0, ", V, ")");
  float *lp = logp.data_ptr<float>(), *lsp = lse.data_ptr<float>(), *ep = want_entropy ? ent.data_ptr<float>() : nullptr;
  posttrain_par::claimed_for(N, [&](int64_t) {
    return [&](int64_t r, int64_t) {
      float* row = zp + r * ld;
      const float m = row_max<float>(row, V);
      const double s = exp_pass(row, V, m, false, false).first;
      const float l = static_cast<float>(static_cast<double>(m) + std::log(s));
      lsp[r] = l;
      lp[r] = row[tp[r]] - l;
      const double py = exp_pass(row, V, l, true, want_entropy).second;
      if (want_entropy) ep[r] = static_cast<float>(-py);
    };
  });
  return {logp, lse, ent};
}

std::vector<torch::Tensor> sample_plain(torch::Tensor logits, torch::Tensor temperature, torch::Tensor uniforms, int64_t chunks) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1, "logits: (N, V) CPU, rows contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat, "logits: bf16 or float32");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == logits.size(0), "temperature: (N,) float32");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == logits.size(0), "uniforms: (N,) float64");
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(chunks >= 1 && V >= 1, "chunks >= 1, V >= 1");
  auto tok = torch::empty({N}, logits.options().dtype(at::kLong));
  auto lp = torch::empty({N}, logits.options().dtype(at::kFloat));
  const float* tp = temperature.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* kp = tok.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* base = logits.data_ptr();
  posttrain_par::claimed_for(N, [&](int64_t) {  // threads claim runs of rows, each with its own buffers
    return [&, csum = std::vector<double>(), w = std::vector<float>(), scratch = std::vector<float>()](int64_t r, int64_t) mutable {
      if (bf16)
        sample_row<uint16_t>(static_cast<const uint16_t*>(base) + r * ld, V, tp[r], up[r], chunks, kp + r, lpp + r, csum, w, scratch);
      else
        sample_row<float>(static_cast<const float*>(base) + r * ld, V, tp[r], up[r], chunks, kp + r, lpp + r, csum, w, scratch);
    };
  });
  return {tok, lp};
}

// z[r] <- exp(z[r] - shift[r]) in place, the exp of softmax_rows_ (a recomputing backward's tile of p).
torch::Tensor exp_rows_(torch::Tensor z, torch::Tensor shift) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.dim() == 2 && z.stride(1) == 1, "z: (N, V) float32 CPU, rows contiguous");
  TORCH_CHECK(shift.scalar_type() == at::kFloat && shift.is_contiguous() && shift.numel() == z.size(0), "shift: (N,) float32");
  const int64_t N = z.size(0), V = z.size(1), ld = z.stride(0);
  float* zp = z.data_ptr<float>();
  const float* sp = shift.data_ptr<float>();
  posttrain_par::claimed_for(N, [&](int64_t) { return [&](int64_t r, int64_t) { exp_pass(zp + r * ld, V, sp[r], true, false); }; });
  return z;
}

// z <- exp(z) in place, `lanes` (8, or 16 where built with AVX-512) at a time, by torch's SLEEF routine
// (Sleef_expf8_u10 / Sleef_expf16_u10, one call per vector: `sleef`) or by the kernels' inline copies of it
// (posttrain_vec::exp8 / exp16), for the test that compares the two bit for bit; z's length a multiple of 64
torch::Tensor exp_lanes_(torch::Tensor z, int64_t lanes, bool sleef) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.is_contiguous() && z.numel() % 64 == 0, "z: float32, contiguous, 64k values");
  float* p = z.data_ptr<float>();
  if (lanes == 8) {
    for (int64_t i = 0; i < z.numel(); i += 32) {
      __m256 d[4];
      for (int j = 0; j < 4; ++j) d[j] = _mm256_loadu_ps(p + i + 8 * j);
      if (sleef)
        for (int j = 0; j < 4; ++j) d[j] = Sleef_expf8_u10(d[j]);
      else
        posttrain_vec::exp8<4>(d);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(p + i + 8 * j, d[j]);
    }
    return z;
  }
#if defined(__AVX512F__)
  if (lanes == 16) {
    for (int64_t i = 0; i < z.numel(); i += 64) {
      __m512 d[4];
      for (int j = 0; j < 4; ++j) d[j] = _mm512_loadu_ps(p + i + 16 * j);
      if (sleef)
        for (int j = 0; j < 4; ++j) d[j] = Sleef_expf16_u10(d[j]);
      else
        posttrain_vec::exp16<4>(d);
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(p + i + 16 * j, d[j]);
    }
    return z;
  }
#endif
  TORCH_CHECK(false, "exp_lanes_: lanes 8, or 16 in an AVX-512 build");
}

#else
torch::Tensor exp_lanes_(torch::Tensor, int64_t, bool) { TORCH_CHECK(false, "exp_lanes_ needs an x86-64 CPU with AVX2"); }
bool sample_kernel_available() { return false; }
torch::Tensor exp_rows_(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "exp_rows_ needs an x86-64 CPU with AVX2"); }
std::vector<torch::Tensor> softmax_rows_(torch::Tensor, torch::Tensor, bool) {
  TORCH_CHECK(false, "softmax_rows_ needs an x86-64 CPU with AVX2");
}
std::vector<torch::Tensor> sample_plain(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "sample_plain needs an x86-64 CPU with AVX2");
}
#endif
