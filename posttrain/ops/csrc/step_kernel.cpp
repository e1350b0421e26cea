// The engine's per-step bookkeeping on CPU, each in one call instead of a handful to ~30 small tensor ops.
// In a decode step such an op costs tens of microseconds, not the 1-3 it takes in a loop: its code and data are
// cold behind the step's kernels (torch.zeros(1) right after the LM head: 60-70 us, AMD Zen 4; any op not run
// for ~10 ms: ~100 us).
//   record_tokens   rollout/engine.py `_sample_and_record`'s stores and stop checks (`Engine._record` is the twin)
//   slot_layout     rollout/runner.py `_slot_offsets` + `_members` + `_paged_rows` (where each row's new KV goes, who is
//                   where)
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
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
// top = max(off) + 1 (one element: the region must reach it), and, given the engine's block tables (slots, max blocks),
// dst[i] = tables[rows[i], p / block_size] * block_size + p % block_size for p = positions[i] (the paged row of that
// KV; empty without tables).
std::vector<torch::Tensor> slot_layout(torch::Tensor rows, torch::Tensor positions, torch::Tensor prompt_len, int64_t width,
                                       c10::optional<torch::Tensor> tables, int64_t block_size) {
  check_rows("slot_layout", {rows, positions, prompt_len}, at::kLong);
  const int64_t N = rows.numel();
  TORCH_CHECK(N > 0 && positions.numel() == N && width >= 1, "slot_layout: one position per row, width >= 1");
  const int64_t *r = rows.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>(), *P = prompt_len.data_ptr<int64_t>();
  const int64_t groups = *std::max_element(r, r + N) / width + 1;
  TORCH_CHECK(*std::min_element(r, r + N) >= 0 && groups <= prompt_len.numel(), "slot_layout: rows outside the slots");
  auto off = torch::empty({N}, rows.options()), members = torch::full({groups, width}, -1, rows.options());
  auto dst = torch::empty({tables ? N : 0}, rows.options());
  int64_t *o = off.data_ptr<int64_t>(), *m = members.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>(), top = 0;
  if (tables)
    TORCH_CHECK(tables->device().is_cpu() && tables->scalar_type() == at::kLong && tables->dim() == 2 && tables->is_contiguous() &&
                    block_size >= 1,
                "slot_layout: tables (slots, max blocks) contiguous int64, block_size >= 1");
  for (int64_t i = 0; i < N; ++i) {
    const int64_t g = r[i] / width;
    o[i] = P[g] + (pos[i] - P[g]) * width + r[i] % width;
    m[r[i]] = i;
    top = std::max(top, o[i] + 1);
    if (tables) {
      const int64_t b = pos[i] / block_size;
      TORCH_CHECK(r[i] < tables->size(0) && pos[i] >= 0 && b < tables->size(1), "slot_layout: row ", r[i], " position ",
                  pos[i], " outside the block tables");
      d[i] = tables->data_ptr<int64_t>()[r[i] * tables->size(1) + b] * block_size + pos[i] % block_size;
    }
  }
  return {off, members, torch::tensor({top}, rows.options()), dst};
}
