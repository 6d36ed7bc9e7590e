#include "trainer/parallel/clip.h"

#include <torch/torch.h>

#include "trainer/dist/process_groups.h"
#include "trainer/parallel/training_state.h"

namespace nnstrain::parallel {

at::Tensor global_grad_norm(TrainingState& state, dist::Runtime* rt) {
  const bool zero = state.options().zero();
  at::Tensor sq;
  if (!zero && !state.norm_weighted()) {
    sq = torch::linalg_vector_norm(state.flat_grad(), 2, {}, false, torch::kFloat32).pow(2).reshape({1});
  } else {
    // Sum of squares per segment, weighted so tensor-parallel replicas count once.
    std::vector<at::Tensor> grads;
    for (const auto& s : state.optimizer_segments()) grads.push_back(s.grad);
    auto norms = torch::stack(at::_foreach_norm(grads)).to(torch::kFloat32);
    sq = (norms.pow(2) * state.norm_weights()).sum().reshape({1});
  }
  // ZeRO chunks are disjoint within the ZeRO group; TP pieces within the TP group.
  if (rt && zero && rt->zero.size() > 1) rt->all_reduce(rt->zero, sq, "gradient norm all-reduce (ZeRO)");
  if (rt && rt->tp.size() > 1) rt->all_reduce(rt->tp, sq, "gradient norm all-reduce (TP)");
  return sq.sqrt().reshape({});
}

at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  return torch::clamp_max(max_norm / (norm + 1e-6), 1.0);
}

}  // namespace nnstrain::parallel
