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
};

torch::Tensor decode_layers(torch::Tensor x, const DecodePlan& plan, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_slot, torch::Tensor v_slot, torch::Tensor member, torch::Tensor off,
                            torch::Tensor prompt, double scale, int64_t H, int64_t KV, int64_t D,
                            c10::optional<torch::Tensor> k_pages, c10::optional<torch::Tensor> v_pages,
                            c10::optional<torch::Tensor> dst);
