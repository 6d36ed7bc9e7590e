#include "trainer/parallel/clip.h"

#include <torch/torch.h>

#include "trainer/dist/process_groups.h"
#include "trainer/parallel/training_state.h"

namespace nnstrain::parallel {

at::Tensor global_grad_norm(TrainingState& state, dist::Runtime* rt) {
  // Sum of squares per optimizer segment (a parameter, or a ZeRO chunk of one),
  // weighted so tensor-parallel replicas count once. On CPU each segment's sum
  // is accumulated in fp64: LibTorch's fp32 CPU norm of a 38M-element tensor is
  // off by ~1% (it accumulates in fp32), while CUDA's tree reduction is exact
  // enough in fp32.
  std::vector<at::Tensor> grads;
  for (const auto& s : state.optimizer_segments()) grads.push_back(s.grad);
  const auto acc = grads.front().is_cuda() ? torch::kFloat32 : torch::kFloat64;
  auto norms = torch::stack(at::_foreach_norm(grads, 2, acc));
  auto sq = (norms.pow(2) * state.norm_weights().to(acc)).sum().reshape({1}).to(torch::kFloat32);
  // ZeRO chunks are disjoint within the ZeRO group; TP pieces within the TP group.
  if (rt && state.options().zero() && rt->zero.size() > 1) rt->all_reduce(rt->zero, sq, "gradient norm all-reduce (ZeRO)");
  if (rt && rt->tp.size() > 1) rt->all_reduce(rt->tp, sq, "gradient norm all-reduce (TP)");
  return sq.sqrt().reshape({});
}

at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  return torch::clamp_max(max_norm / (norm + 1e-6), 1.0);
}

}  // namespace nnstrain::parallel
