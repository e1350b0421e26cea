// One decode step's decoder layers in one call: the kernels runner._forward calls for each layer of a Llama-style
// model (pre-norm RMSNorm, one q|k|v projection, RoPE on every q and k head, attention over the group KV, a SiLU-gated
// MLP), in the same order on the same tensors (RoPE inside the attention, as q and k are read: the same function),
// so the result is the Python loop's bit for bit. What it removes is
// the interpreter between the kernels: ~10 Python calls and a dozen tensor views per layer, 3-4 ms of a decode step
// (6% of a 32-row float32 step of SmolLM2-135M on 2 cores, AMD Zen 2).
//
// Per layer i:
//   h  = rmsnorm(x, norm_in[i])                      bf16: rmsnorm; float32: rmsnorm_fwd (training's kernel)
//   q, k, v = qkv split by heads                        with qkv = gemm_packed(h, W_qkv) (+ bias)
//   x  = gemm_packed(group_attention(q, k, v, ..., cos, sin), W_o, residual = x)   RoPE on q and k inside the attention
//                                                    (`rope`'s function: the loop's rope(q|k) then attention, bit for bit)
//   h  = rmsnorm(x, norm_post[i])
//   g  = gemm_packed(h, W_gate_up, glu)              glu: silu(gate) * up from the GEMM's epilogue, else the two halves
//                                                    through swiglu_fwd (float32) or silu_mul (bf16)
//   x  = gemm_packed(g, W_down, residual = x)
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "decode_plan.h"

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u);
std::vector<torch::Tensor> rmsnorm_fwd(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor swiglu_fwd(torch::Tensor g, torch::Tensor u);
torch::Tensor group_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor member, torch::Tensor off, torch::Tensor prompt, double scale, int64_t window,
                              c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin,
                              c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                              c10::optional<torch::Tensor> dst);
torch::Tensor gemm_packed(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual, bool glu, c10::optional<torch::Tensor> out);

namespace {

c10::optional<torch::Tensor> opt(const torch::Tensor& t) {  // an empty tensor stands for "no bias"
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x.scalar_type() == torch::kFloat32 ? rmsnorm_fwd(x, w, eps)[0] : rmsnorm(x, w, eps);
}

// one layer's weights, in the order runner.Runner._layer_loop_args lists them
enum { NORM_IN, QKV, QKV_B, O, O_B, NORM_POST, GATE_UP, GATE_UP_B, DOWN, DOWN_B, PARTS };

}  // namespace

// layers[i]: the PARTS tensors above (packed panels, norm weights, biases or empty tensors); widths[i]: output columns of
// q|k|v, o, gate|up, down; glu[i]: gate|up packed for the SwiGLU epilogue; eps[2i], eps[2i+1]: the two norms';
// windows[i]: layer i's sliding window or 0. Built once per weight sync (`decode_plan`): converting these ~300 tensors
// from Python lists at every step cost ~0.2 ms of a decode step (cold objects behind the step's kernels).
DecodePlan::DecodePlan(std::vector<std::vector<torch::Tensor>> layers_, std::vector<std::vector<int64_t>> widths_,
                       std::vector<bool> glu_, std::vector<double> eps_, std::vector<int64_t> windows_)
    : layers(std::move(layers_)), widths(std::move(widths_)), glu(std::move(glu_)), eps(std::move(eps_)),
      windows(std::move(windows_)) {
  const size_t L = layers.size();
  TORCH_CHECK(widths.size() == L && glu.size() == L && eps.size() == 2 * L && windows.size() == L,
              "decode_plan: one entry per layer");
  for (size_t i = 0; i < L; ++i)
    TORCH_CHECK(layers[i].size() == PARTS && widths[i].size() == 4, "decode_plan: layer ", i, ": weights or widths");
}

// x (N, hidden) the residual stream after the embedding; cos/sin (N, D): this step's RoPE rows; k_slot/v_slot (layers,
// groups, KV, cap, D): the group KV (member, off, prompt, scale as group_attention takes them); k_pages/v_pages (layers,
// rows, KV, D) and dst (N,): the paged KV each row's new k/v also go to (group_attention's), or None. Returns x after the
// last layer (before the final norm).
torch::Tensor decode_layers(torch::Tensor x, const DecodePlan& plan, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_slot, torch::Tensor v_slot, torch::Tensor member, torch::Tensor off,
                            torch::Tensor prompt, double scale, int64_t H, int64_t KV, int64_t D,
                            c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                            c10::optional<torch::Tensor> dst) {
  const int64_t L = static_cast<int64_t>(plan.layers.size()), N = x.size(0), nqk = (H + KV) * D;
  TORCH_CHECK(k_slot.size(0) >= L, "decode_layers: the group KV holds ", k_slot.size(0), " layers, not ", L);
  TORCH_CHECK(k_pages.has_value() == v_pages.has_value() && (!k_pages || (k_pages->size(0) >= L && v_pages->size(0) >= L)),
              "decode_layers: paged KV (layers, rows, KV, D) for K and V, or neither");
  auto page = [&](const c10::optional<torch::Tensor>& t, int64_t i) {
    return t ? c10::optional<torch::Tensor>((*t)[i]) : c10::nullopt;
  };
  for (int64_t i = 0; i < L; ++i) {
    const auto& w = plan.layers[i];
    const auto& widths = plan.widths[i];
    TORCH_CHECK(widths[0] == nqk + KV * D, "decode_layers: layer ", i, ": q|k|v width");
    const torch::Tensor qkv = gemm_packed(norm(x, w[NORM_IN], plan.eps[2 * i]), w[QKV], widths[0], opt(w[QKV_B]),
                                          c10::nullopt, false, c10::nullopt);
    const torch::Tensor q = qkv.slice(1, 0, H * D).view({N, H, D}), k = qkv.slice(1, H * D, nqk).view({N, KV, D});
    const torch::Tensor v = qkv.slice(1, nqk, nqk + KV * D).view({N, KV, D});
    const torch::Tensor a = group_attention(q, k, v, k_slot[i], v_slot[i], member, off, prompt, scale, plan.windows[i], cos, sin,
                                              page(k_pages, i), page(v_pages, i), dst);
    x = gemm_packed(a, w[O], widths[1], opt(w[O_B]), x, false, c10::nullopt);
    torch::Tensor g = gemm_packed(norm(x, w[NORM_POST], plan.eps[2 * i + 1]), w[GATE_UP], widths[2], opt(w[GATE_UP_B]),
                                  c10::nullopt, plan.glu[i], c10::nullopt);
    if (!plan.glu[i]) {
      const int64_t I = g.size(1) / 2;
      g = g.scalar_type() == torch::kFloat32 ? swiglu_fwd(g.slice(1, 0, I), g.slice(1, I, 2 * I))
                                             : silu_mul(g.slice(1, 0, I), g.slice(1, I, 2 * I));
    }
    x = gemm_packed(g, w[DOWN], widths[3], opt(w[DOWN_B]), x, false, c10::nullopt);
  }
  return x;
}

void DecodePlan::set_ends(torch::Tensor embed_, torch::Tensor cos_, torch::Tensor sin_, torch::Tensor final_norm_,
                          double final_eps_, torch::Tensor head_, torch::Tensor head_b_, int64_t head_n_) {
  TORCH_CHECK(embed_.dim() == 2 && cos_.dim() == 2 && sin_.sizes() == cos_.sizes() && final_norm_.dim() == 1 &&
                  final_norm_.size(0) == embed_.size(1) && head_n_ >= 1,
              "decode_plan.set_ends: embedding (vocab, hidden), cos/sin (positions, D), final norm (hidden,), head width");
  embed = std::move(embed_), cos = std::move(cos_), sin = std::move(sin_), final_norm = std::move(final_norm_);
  head = std::move(head_), head_b = std::move(head_b_), final_eps = final_eps_, head_n = head_n_;
}

// A whole decode step's forward in one call: tokens (N,) and positions (N,) int64 -> logits (N, head width). The
// runner's `embedding(tokens)`, `cos[positions]` / `sin[positions]`, decode_layers, `norm` and `logits` in that order,
// on the same kernels (the rows gathered as index_select gathers them): the same values. What it removes is the
// interpreter and the small ops at the step's two ends, each of which runs cold there (behind the LM head, or behind
// the layers' weights streaming through the caches).
torch::Tensor decode_step(torch::Tensor tokens, torch::Tensor positions, const DecodePlan& plan, torch::Tensor k_slot,
                          torch::Tensor v_slot, torch::Tensor member, torch::Tensor off, torch::Tensor prompt, double scale,
                          int64_t H, int64_t KV, int64_t D, c10::optional<torch::Tensor> k_pages,
                          c10::optional<torch::Tensor> v_pages, c10::optional<torch::Tensor> dst) {
  TORCH_CHECK(plan.embed.defined(), "decode_step: the plan has no ends (set_ends)");
  torch::Tensor x = plan.embed.index_select(0, tokens);
  if (x.scalar_type() != plan.cos.scalar_type()) x = x.to(plan.cos.scalar_type());  // rows cast to the compute dtype
  x = decode_layers(x, plan, plan.cos.index_select(0, positions),
                                  plan.sin.index_select(0, positions), k_slot, v_slot, member, off, prompt, scale, H, KV,
                                  D, k_pages, v_pages, dst);
  return gemm_packed(norm(x, plan.final_norm, plan.final_eps), plan.head, plan.head_n, opt(plan.head_b), c10::nullopt,
                     false, c10::nullopt);
}
