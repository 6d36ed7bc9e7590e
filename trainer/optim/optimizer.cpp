#include "trainer/optim/optimizer.h"

#include <torch/torch.h>

namespace nnstrain::optim {

void Optimizer::save_tensors(const std::vector<at::Tensor>& live, std::vector<at::Tensor>& saved) {
  torch::NoGradGuard no_grad;
  if (saved.size() != live.size()) {
    saved.clear();
    for (const auto& t : live) saved.push_back(torch::empty_like(t, at::MemoryFormat::Contiguous));
  }
  for (size_t i = 0; i < live.size(); ++i) saved[i].copy_(live[i]);
}

void Optimizer::load_tensors(const std::vector<at::Tensor>& saved, const std::vector<at::Tensor>& live) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < live.size(); ++i) live[i].copy_(saved[i]);
}

}  // namespace nnstrain::optim
