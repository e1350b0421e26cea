// The engine's per-step bookkeeping on CPU, each in one call instead of a handful to ~30 small tensor ops.
// In a decode step such an op costs tens of microseconds, not the 1-3 it takes in a loop: its code and data are
// cold behind the step's kernels (torch.zeros(1) right after the LM head: 60-70 us, AMD Zen 4; any op not run
// for ~10 ms: ~100 us).
//   record_tokens   rollout/engine.py `_sample_and_record`'s stores and stop checks (`Engine._record` is the twin)
//   slot_layout     rollout/runner.py `_slot_offsets` + `_members` (where each row's new KV goes, who is where)
//   save_slot_kv    rollout/runner.py `save_decoded`'s copy of a finished sequence's KV to its paged rows
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

void check_rows(const char* what, std::initializer_list<torch::Tensor> ts, torch::ScalarType dtype);  // sample_kernel.cpp

// record_tokens: row i's draw (tok, lp, kept) goes to its slot r = rows[i] at completion index g = ngen[r]
// (out_tok, out_lp, out_kept (slots, L)); ngen[r] = g + 1, ntok[r] += 1, last[r] = tok. Returns the i (ascending)
// whose slot must be looked at: tok is one of stop_ids[r] (slots, k; -1 pads), g + 1 >= max_new[r], or
// has_stop_str[r].
torch::Tensor record_tokens(torch::Tensor rows, torch::Tensor tok, torch::Tensor lp, torch::Tensor kept,
                            torch::Tensor ngen, torch::Tensor ntok, torch::Tensor last, torch::Tensor out_tok,
                            torch::Tensor out_lp, torch::Tensor out_kept, torch::Tensor stop_ids,
                            torch::Tensor max_new, torch::Tensor has_stop_str) {
  check_rows("record_tokens", {rows, tok, kept, ngen, ntok, last, out_tok, stop_ids, max_new}, at::kLong);
  check_rows("record_tokens", {lp, out_lp}, at::kFloat);
  check_rows("record_tokens", {out_kept}, at::kInt);
  check_rows("record_tokens", {has_stop_str}, at::kBool);
  const int64_t N = rows.numel(), S = ngen.numel(), L = out_tok.size(1), K = stop_ids.size(1);
  TORCH_CHECK(tok.numel() == N && lp.numel() == N && kept.numel() == N, "record_tokens: one draw per row");
  TORCH_CHECK(ntok.numel() == S && last.numel() == S && max_new.numel() == S && has_stop_str.numel() == S &&
                  out_tok.size(0) == S && out_lp.sizes() == out_tok.sizes() && out_kept.sizes() == out_tok.sizes() &&
                  stop_ids.dim() == 2 && stop_ids.size(0) == S,
              "record_tokens: per-slot tensors of one size");
  const int64_t* r = rows.data_ptr<int64_t>();
  std::vector<int64_t> hits;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t k = r[i], t = tok.data_ptr<int64_t>()[i];
    TORCH_CHECK(k >= 0 && k < S, "record_tokens: row ", k, " outside ", S, " slots");
    const int64_t g = ngen.data_ptr<int64_t>()[k];
    TORCH_CHECK(g >= 0 && g < L, "record_tokens: slot ", k, " is full (", g, " of ", L, " tokens)");
    out_tok.data_ptr<int64_t>()[k * L + g] = t;
    out_lp.data_ptr<float>()[k * L + g] = lp.data_ptr<float>()[i];
    out_kept.data_ptr<int32_t>()[k * L + g] = static_cast<int32_t>(kept.data_ptr<int64_t>()[i]);
    ngen.data_ptr<int64_t>()[k] = g + 1;
    ntok.data_ptr<int64_t>()[k] += 1;
    last.data_ptr<int64_t>()[k] = t;
    const int64_t* stops = stop_ids.data_ptr<int64_t>() + k * K;
    bool hit = g + 1 >= max_new.data_ptr<int64_t>()[k] || has_stop_str.data_ptr<bool>()[k];
    for (int64_t j = 0; j < K && !hit; ++j) hit = stops[j] == t;
    if (hit) hits.push_back(i);
  }
  return torch::tensor(hits, rows.options());
}

// slot_layout: for running slots rows (N,) at positions (N,), with group slot g = row / width holding prompt_len[g]
// prompt tokens: off[i] = P + (positions[i] - P) * width + rows[i] % width (where row i's new KV goes in its group
// region), members (groups, width) = the batch row of each group slot's sample or -1 (groups = max(rows) / width + 1),
// and top = max(off) + 1 (one element: the region must reach it).
std::vector<torch::Tensor> slot_layout(torch::Tensor rows, torch::Tensor positions, torch::Tensor prompt_len, int64_t width) {
  check_rows("slot_layout", {rows, positions, prompt_len}, at::kLong);
  const int64_t N = rows.numel();
  TORCH_CHECK(N > 0 && positions.numel() == N && width >= 1, "slot_layout: one position per row, width >= 1");
  const int64_t *r = rows.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>(), *P = prompt_len.data_ptr<int64_t>();
  const int64_t groups = *std::max_element(r, r + N) / width + 1;
  TORCH_CHECK(*std::min_element(r, r + N) >= 0 && groups <= prompt_len.numel(), "slot_layout: rows outside the slots");
  auto off = torch::empty({N}, rows.options()), members = torch::full({groups, width}, -1, rows.options());
  int64_t *o = off.data_ptr<int64_t>(), *m = members.data_ptr<int64_t>(), top = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t g = r[i] / width;
    o[i] = P[g] + (pos[i] - P[g]) * width + r[i] % width;
    m[r[i]] = i;
    top = std::max(top, o[i] + 1);
  }
  return {off, members, torch::tensor({top}, rows.options())};
}

// runner.save_decoded's copy in one call: the KV of n decoded tokens of one sequence, token t at position
// first + t * width of group slot gs in k_slot / v_slot (layers, groups, KV, cap, D), to row dst[t] of k_cache / v_cache
// (layers, rows, KV, D), every layer and head (any dtype: rows of D elements are copied as bytes). Threads split the
// layers' K and V. The strided torch copies it replaces took ~0.4 ms a sequence of SmolLM2 (1.5 MB of KV for 64
// tokens): ~25 ms when a batch of 64 finishes.
void save_slot_kv(torch::Tensor k_slot, torch::Tensor v_slot, torch::Tensor k_cache, torch::Tensor v_cache, int64_t gs,
                  int64_t first, int64_t width, torch::Tensor dst) {
  for (const auto& t : {k_slot, v_slot, k_cache, v_cache})
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == k_slot.scalar_type(),
                "save_slot_kv: contiguous CPU tensors of one dtype");
  TORCH_CHECK(k_slot.dim() == 5 && v_slot.sizes() == k_slot.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(0) == k_slot.size(0) && k_cache.size(2) == k_slot.size(2) && k_cache.size(3) == k_slot.size(4),
              "save_slot_kv: slot KV (layers, groups, KV, cap, D) and paged KV (layers, rows, KV, D) of one model");
  TORCH_CHECK(dst.device().is_cpu() && dst.scalar_type() == at::kLong && dst.is_contiguous(), "save_slot_kv: int64 dst rows");
  const int64_t layers = k_slot.size(0), G = k_slot.size(1), KV = k_slot.size(2), cap = k_slot.size(3), rows = k_cache.size(1);
  const int64_t n = dst.numel();
  const int64_t* d = dst.data_ptr<int64_t>();
  TORCH_CHECK(gs >= 0 && gs < G && first >= 0 && width >= 1 && (n == 0 || first + (n - 1) * width < cap),
              "save_slot_kv: positions outside the group region");
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(d[t] >= 0 && d[t] < rows, "save_slot_kv: dst row ", d[t], " outside ", rows);
  const int64_t row = k_slot.size(4) * static_cast<int64_t>(k_slot.element_size());  // bytes of one head's D values
  const auto* ks = static_cast<const char*>(k_slot.data_ptr());
  const auto* vs = static_cast<const char*>(v_slot.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, 2 * layers, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const int64_t l = j / 2;
      const char* src = (j % 2 ? vs : ks) + (l * G + gs) * KV * cap * row;
      char* out = (j % 2 ? vc : kc) + l * rows * KV * row;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t ahead = std::min(t + 8, n - 1);  // rows are a stride apart in the region, far apart in the cache:
        for (int64_t h = 0; h < KV; ++h) {              // fetch the lines 8 tokens ahead (the copy waits on memory)
          const char* s_ahead = src + (h * cap + first + ahead * width) * row;
          char* o_ahead = out + (d[ahead] * KV + h) * row;
          for (int64_t c = 0; c < row; c += 64) {
            __builtin_prefetch(s_ahead + c, 0, 0);
            __builtin_prefetch(o_ahead + c, 1, 0);
          }
          std::memcpy(out + (d[t] * KV + h) * row, src + (h * cap + first + t * width) * row, row);
        }
      }
    }
  });
}

