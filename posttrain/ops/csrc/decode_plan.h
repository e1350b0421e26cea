// A decode step's layer weights for decode_layers (decode_kernel.cpp), held on the C++ side between steps.
#pragma once
#include <torch/extension.h>

#include <vector>

struct DecodePlan {
  DecodePlan(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<int64_t>> widths,
             std::vector<bool> glu, std::vector<double> eps, std::vector<int64_t> windows);
  std::vector<std::vector<torch::Tensor>> layers;
  std::vector<std::vector<int64_t>> widths;
  std::vector<bool> glu;
  std::vector<double> eps;
  std::vector<int64_t> windows;
  // the step's two ends for decode_step, where the runner's embedding, RoPE table, final norm and LM head allow
  // (`set_ends`; undefined tensors otherwise): the embedding (vocab, hidden; its rows cast to the compute dtype where
  // it is another), RoPE rows (positions, D) in the compute dtype, the final norm's weight and eps, the LM head's
  // packed panels, bias (or empty) and width
  torch::Tensor embed, cos, sin, final_norm, head, head_b;
  double final_eps = 0.0;
  int64_t head_n = 0;
  void set_ends(torch::Tensor embed, torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm, double final_eps,
                torch::Tensor head, torch::Tensor head_b, int64_t head_n);
};

torch::Tensor decode_layers(torch::Tensor x, const DecodePlan& plan, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_slot, torch::Tensor v_slot, torch::Tensor member, torch::Tensor off,
                            torch::Tensor prompt, double scale, int64_t H, int64_t KV, int64_t D,
                            c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                            c10::optional<torch::Tensor> dst);
torch::Tensor decode_step(torch::Tensor tokens, torch::Tensor positions, const DecodePlan& plan, torch::Tensor k_slot,
                          torch::Tensor v_slot, torch::Tensor member, torch::Tensor off, torch::Tensor prompt, double scale,
                          int64_t H, int64_t KV, int64_t D, c10::optional<torch::Tensor> k_pages,
                          c10::optional<torch::Tensor> v_pages, c10::optional<torch::Tensor> dst);
