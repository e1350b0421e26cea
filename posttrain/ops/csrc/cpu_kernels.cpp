// Fused CPU kernels for bf16 decode (the rollout engine). Each reproduces the roundings of the
// sequence of bf16 PyTorch ops it replaces (RMSNorm up to the order of its sum of squares) (the eager reference lives next to its caller in
// posttrain/ops/cpu_kernels.py and tests compare the two), in one pass instead of 4-9 dispatched ops:
// at decode shapes (64 rows) eager bf16 elementwise ops cost ~10 us each, mostly fixed overhead.
//
//   rmsnorm(x, w, eps)        HF LlamaRMSNorm: h = float(x) * rsqrt(mean(float(x)^2) + eps); w * bf16(h)
//   rope(x, cos, sin_signed)  x (N, H, D) row-strided, bf16 or float32: x*cos + cat(x2, x1)*sin_signed, each product rounded
//   silu_mul(g, u)            bf16 rows: bf16(float(bf16(silu(g))) * float(u)), silu(g) = g / (1 + exp(-g)) with torch's
//                             vectorized exp (SLEEF), as F.silu(g) * u computes it in bf16
//
// bf16 <-> float conversions are written out (round to nearest even, NaN kept) so loops vectorize.
// Rows split over threads from 16K values on (kRowsGrain): a decode step's 64 x 576 RMSNorm and 64 x 12 x 64 RoPE
// run on both cores (the engine's decode step 55.4 -> 54.7 ms in an in-process A/B on AMD Zen 4: the OpenMP
// worker is still spinning from the GEMM before, so the team costs little, and a serial op ran ~2x slower
// in a step than alone while the other core spun). Eager F.silu on the strided gate half of the engine's gate|up output ran at
// ~0.7 ns per element (72 us at 64 x 1536, AMD Zen 4) plus ~22 us for the product.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "rope.h"

namespace {

constexpr int64_t kRowsGrain = 16384;  // values per thread's share below which a small op stays on one thread

using posttrain_bf16::bf2f;
using posttrain_bf16::f2bf;
using posttrain_bf16::round_bf;

const uint16_t* cptr(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* mptr(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": a bf16 CPU tensor is required");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

}  // namespace

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), "rmsnorm: x (M, H), w (H,)");
  const int64_t M = x.size(0), H = x.size(1), ld = x.stride(0);
  auto out = torch::empty({M, H}, x.options());
  const uint16_t *xp = cptr(x), *wp = cptr(w);
  uint16_t* op = mptr(out);
  at::parallel_for(0, M, std::max<int64_t>(1, kRowsGrain / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint16_t* r = xp + i * ld;
      uint16_t* o = op + i * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < H; ++j) {
        const float v = bf2f(r[j]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) o[j] = f2bf(bf2f(wp[j]) * round_bf(bf2f(r[j]) * inv));
    }
  });
  return out;
}


torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "rope: bf16 or float32");
  for (const auto& t : {x, cos, sin_signed})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.stride(-1) == 1, "rope: CPU tensors of one dtype, last dimension contiguous");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin_signed.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0 && cos.is_contiguous() && sin_signed.is_contiguous(),
              "rope: x (N, H, D), cos/sin (N, D)");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  auto out = torch::empty({N, H, D}, x.options());
  const int64_t sn = x.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, kRowsGrain / std::max<int64_t>(H * D, 1)), [&](int64_t b, int64_t e) {
    if (dt == at::kBFloat16)
      posttrain_rope::rope_rows(cptr(x) + b * sn, cptr(cos) + b * D, cptr(sin_signed) + b * D, mptr(out) + b * H * D, e - b, H, D, sn, x.stride(1));
    else
      posttrain_rope::rope_rows(x.data_ptr<float>() + b * sn, cos.data_ptr<float>() + b * D, sin_signed.data_ptr<float>() + b * D,
                out.data_ptr<float>() + b * H * D, e - b, H, D, sn, x.stride(1));
  });
  return out;
}

namespace {

// silu then product for one row of n values, rounded as torch's bf16 kernels round them, with the same split
// between its vector exp and std::exp (posttrain_vec::SILU_STEP), so every value takes the same exp as in eager.
inline void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* h, int64_t n) {
  int64_t j = 0;
#if defined(__x86_64__) && defined(__AVX2__)
  namespace v = posttrain_vec;
  for (const int64_t nv = n / v::SILU_STEP * v::SILU_STEP; j < nv; j += v::VL)
    v::store_bf16(h + j, v::round_bf(v::silu(v::loadv(g + j))) * v::loadv(u + j));
#endif
  for (; j < n; ++j) h[j] = f2bf(round_bf(posttrain_bf16::silu(bf2f(g[j]))) * bf2f(u[j]));
}

}  // namespace

// g, u (M, I) bf16 rows (the halves of the engine's gate|up output: row-strided) -> (M, I) bf16
torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u) {
  check_bf16(g, "g");
  check_bf16(u, "u");
  TORCH_CHECK(g.dim() == 2 && g.sizes() == u.sizes(), "silu_mul: g and u (M, I) of one shape");
  const int64_t M = g.size(0), I = g.size(1), lg = g.stride(0), lu = u.stride(0);
  auto h = torch::empty({M, I}, g.options());
  const uint16_t *gp = cptr(g), *up = cptr(u);
  uint16_t* hp = mptr(h);
  at::parallel_for(0, M, std::max<int64_t>(1, kRowsGrain / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_row(gp + r * lg, up + r * lu, hp + r * I, I);
  });
  return h;
}

// training kernels (train_kernels.cpp)
torch::Tensor swiglu_fwd(torch::Tensor g, torch::Tensor u);
std::vector<torch::Tensor> swiglu_bwd(torch::Tensor gh, torch::Tensor g, torch::Tensor u);
std::vector<torch::Tensor> rmsnorm_fwd(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> rmsnorm_bwd(torch::Tensor go, torch::Tensor x, torch::Tensor w, torch::Tensor rstd);
torch::Tensor rope_fwd(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor rope_bwd(torch::Tensor gy, torch::Tensor cos, torch::Tensor sin, bool bf16);
std::vector<torch::Tensor> bf16_split(torch::Tensor x);
torch::Tensor round_bf16_(torch::Tensor t);
// the engine's plain sampling rows (sample_kernel.cpp)
std::vector<torch::Tensor> sample_plain(torch::Tensor logits, torch::Tensor temperature, torch::Tensor uniforms, int64_t chunks);
bool sample_kernel_available();
std::vector<torch::Tensor> softmax_rows_(torch::Tensor z, torch::Tensor targets, bool want_entropy);
torch::Tensor exp_rows_(torch::Tensor z, torch::Tensor shift);
torch::Tensor exp_lanes_(torch::Tensor z, int64_t lanes, bool sleef);
torch::Tensor counter_uniforms(torch::Tensor seed, torch::Tensor sample_index, torch::Tensor step);
torch::Tensor row_uniforms(torch::Tensor seed, torch::Tensor sample_index, torch::Tensor ngen, torch::Tensor rows);
// the engine's per-step bookkeeping (step_kernel.cpp)
torch::Tensor record_tokens(torch::Tensor rows, torch::Tensor tok, torch::Tensor lp, torch::Tensor kept,
                            torch::Tensor ngen, torch::Tensor ntok, torch::Tensor last, torch::Tensor out_tok,
                            torch::Tensor out_lp, torch::Tensor out_kept, torch::Tensor stop_ids,
                            torch::Tensor max_new, torch::Tensor has_stop_str);
std::vector<torch::Tensor> slot_layout(torch::Tensor rows, torch::Tensor positions, torch::Tensor prompt_len, int64_t width,
                                       c10::optional<torch::Tensor> tables, int64_t block_size);
// decode attention over the group KV (attention_kernel.cpp)
torch::Tensor group_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor member, torch::Tensor off, torch::Tensor prompt, double scale, int64_t window,
                              c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin,
                              c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                              c10::optional<torch::Tensor> dst);
bool group_attention_available();
torch::Tensor prompt_scores(torch::Tensor q, torch::Tensor keys, double scale, bool fma);
bool attention_fma_scores();
// the engine's linears against packed weights, float32 or bf16 (gemm_kernel.cpp)
torch::Tensor gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> into);
torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual, bool glu,
                          c10::optional<torch::Tensor> out);
torch::Tensor gemm_pack_bf16(torch::Tensor w, c10::optional<torch::Tensor> into);
torch::Tensor gemm_once(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                        c10::optional<torch::Tensor> out);
bool gemm_kernel_available();
bool gemm_bf16_kernel_available();
int64_t gemm_panel_width();
// a decode step's decoder layers, the kernels above in runner._forward's order (decode_kernel.cpp)
#include "decode_plan.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rmsnorm", &rmsnorm, "HF RMSNorm, bf16");
  m.def("silu_mul", &silu_mul, "F.silu(g) * u of bf16 rows, eager's roundings");
  m.def("rope", &rope, "rotary embedding, bf16 or float32");
  m.def("swiglu_fwd", &swiglu_fwd, "silu(g) * u, float32");
  m.def("swiglu_bwd", &swiglu_bwd, "gradients of silu(g) * u: (gg, gu)");
  m.def("rmsnorm_fwd", &rmsnorm_fwd, "float32 RMSNorm for training: (out, rstd)");
  m.def("rmsnorm_bwd", &rmsnorm_bwd, "float32 RMSNorm gradients: (gx, gw)");
  m.def("rope_fwd", &rope_fwd, "training RoPE, float32 or bf16 x, float32 cos/sin -> float32 (B, H, T, D)");
  m.def("rope_bwd", &rope_bwd, "gradient of rope_fwd: float32 gy -> gx in x's dtype");
  m.def("bf16_split", &bf16_split, "float32 x -> (its bf16 cast, those values as float32), one pass");
  m.def("round_bf16_", &round_bf16_, "float32 t rounded to bf16 precision in place");
  m.def("sample_plain", &sample_plain, "inverse-CDF draw from softmax(logits / t): (tokens, log-probs)");
  m.def("softmax_rows_", &softmax_rows_, "the head's kept softmax in place: (logp, lse, entropy)");
  m.def("exp_rows_", &exp_rows_, "z <- exp(z - shift[:, None]) in place");
  m.def("counter_uniforms", &counter_uniforms, "sampling.counter_uniforms (seed, sample index, step) int64 -> float64, one pass");
  m.def("slot_layout", &slot_layout, "runner._slot_offsets + _members (+ the paged rows) in one call: (off, members "
        "(groups, width), top, dst)");
  m.def("row_uniforms", &row_uniforms, "counter_uniforms(seed[rows], sample_index[rows], ngen[rows])");
  m.def("record_tokens", &record_tokens, "the engine's bookkeeping of one draw per row; -> the rows to look at");
  m.def("exp_lanes_", &exp_lanes_, "z <- exp(z) in place, 8 or 16 lanes at a time: torch's SLEEF (sleef) or the inline copy");
  m.def("group_attention", &group_attention, "decode attention over the group KV, visible keys only");
  m.def("group_attention_available", &group_attention_available, "whether group_attention was built (GCC >= 12 or Clang)");
  m.def("prompt_scores", &prompt_scores, "group_attention's two prompt-score loops alone (float32 FMAs or vdpbf16ps), for "
        "the tests: bf16 q (R, D), keys (n, D) -> (R, n) float32; empty without AVX-512 BF16");
  m.def("attention_fma_scores", &attention_fma_scores, "whether group_attention scores the prompt with float32 FMAs here (Intel)");
  m.def("gemm_pack", &gemm_pack, "weight (N, K) -> float32 panels (P, K, NR) for gemm_packed, into `into` if it fits",
        py::arg("w"), py::arg("into") = py::none());
  m.def("gemm_packed", &gemm_packed, "x (M, K) @ packed weight^T (+ bias) (+ residual) -> (M, N): float32, or bf16 panels and x; "
        "glu: bf16 panels of glu_rows order -> silu(gate) * up (M, N/2); written into `out` if given", py::arg("x"), py::arg("packed"), py::arg("N"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none(), py::arg("glu") = false, py::arg("out") = py::none());
  m.def("gemm_once", &gemm_once, "x (M, K) @ w (N, K)^T (+ bias), float32, w packed into scratch for this call only "
        "(w may be the transposed view of a contiguous tensor, x too), into `out` if given", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none(), py::arg("out") = py::none());
  m.def("gemm_pack_bf16", &gemm_pack_bf16, "bf16 weight (N, K), K even -> bf16 panels of pairs (P, K/2, NR, 2) for "
        "gemm_packed (AVX-512 BF16), into `into` if it fits", py::arg("w"), py::arg("into") = py::none());
  m.def("gemm_bf16_kernel_available", &gemm_bf16_kernel_available, "whether the bf16 variant was built (AVX-512 BF16)");
  m.def("gemm_kernel_available", &gemm_kernel_available, "whether gemm_packed was built (x86-64 with AVX2 and FMA)");
  m.def("gemm_panel_width", &gemm_panel_width, "output columns per packed panel (16 with AVX2, 32 with AVX-512)");
  py::class_<DecodePlan>(m, "DecodePlan", "decode_layers' per-layer weights, widths, glu flags, eps and windows",
                         py::module_local())  // local: two builds of the extension may be loaded in one process
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>, std::vector<bool>,
                    std::vector<double>, std::vector<int64_t>>())
      .def("set_ends", &DecodePlan::set_ends, "decode_step's embedding, RoPE rows, final norm and LM head");
  m.def("decode_layers", &decode_layers, "a decode step's Llama-style decoder layers over the group KV (runner._forward's kernels)");
  m.def("decode_step", &decode_step, "a whole decode step's forward: tokens, positions -> logits (decode_layers between the "
        "embedding and the LM head)");
  m.def("sample_kernel_available", &sample_kernel_available, "whether sample_plain was built (x86-64 with AVX2)");
}
