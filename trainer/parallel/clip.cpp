#include "trainer/parallel/clip.h"

#include <torch/torch.h>

#include <map>
#include <string>

#include "trainer/dist/process_groups.h"
#include "trainer/parallel/training_state.h"

namespace nnstrain::parallel {

at::Tensor stage_grad_norm_sq(TrainingState& state, dist::Runtime* rt) {
  // Sum of squares per optimizer segment (a parameter, or a ZeRO chunk of one),
  // weighted so tensor-parallel replicas count once. On CPU each segment's sum
  // is accumulated in fp64: LibTorch's fp32 CPU norm of a 38M-element tensor is
  // off by ~1% (it accumulates in fp32), while CUDA's tree reduction is exact
  // enough in fp32.
  std::vector<at::Tensor> grads;
  for (const auto& s : state.optimizer_segments()) grads.push_back(s.grad);
  const auto dev = state.norm_weights().device();
  const auto acc = dev.is_cuda() ? torch::kFloat32 : torch::kFloat64;
  // Under offload some segments' gradients are on the host: each device's
  // segments are normed where they are, in segment order, then brought together.
  std::map<std::string, std::vector<int64_t>> by_device;
  for (size_t i = 0; i < grads.size(); ++i) by_device[grads[i].device().str()].push_back(static_cast<int64_t>(i));
  at::Tensor norms;
  if (by_device.size() == 1) {
    norms = torch::stack(at::_foreach_norm(grads, 2, grads.front().is_cuda() ? torch::kFloat32 : torch::kFloat64));
  } else {
    // One copy per device group, not one per segment.
    norms = torch::empty({static_cast<int64_t>(grads.size())}, torch::TensorOptions().device(dev).dtype(acc));
    for (const auto& [name, idx] : by_device) {
      std::vector<at::Tensor> g;
      for (auto i : idx) g.push_back(grads[i]);
      auto n = torch::stack(at::_foreach_norm(g, 2, g.front().is_cuda() ? torch::kFloat32 : torch::kFloat64));
      norms.index_copy_(0, torch::tensor(idx).to(dev), n.to(dev, acc));
    }
  }
  auto weighted = norms.pow(2) * state.norm_weights().to(acc);
  auto sq = weighted.sum().reshape({1}).to(torch::kFloat32);
  // Expert parallelism: the ep ranks hold different experts. Under ZeRO their
  // chunks are disjoint over dp x cp (edp chunks of ep slices), as the ZeRO
  // group's are; without it they are summed over the ep group here.
  if (rt && rt->ep.size() > 1 && !state.options().zero()) {
    std::vector<double> mask;
    for (size_t i = 0; i < grads.size(); ++i) mask.push_back(state.segment_expert(i) ? 1.0 : 0.0);
    const auto m = torch::tensor(mask, weighted.options());
    auto experts = (weighted * m).sum().reshape({1}).to(torch::kFloat32);
    auto others = (weighted * (1 - m)).sum().reshape({1}).to(torch::kFloat32);
    rt->all_reduce(rt->ep, experts, "gradient norm all-reduce (experts)");
    sq = others + experts;
  }
  // ZeRO chunks are disjoint within the ZeRO group; TP pieces within the TP group.
  if (rt && state.options().zero() && rt->zero.size() > 1) rt->all_reduce(rt->zero, sq, "gradient norm all-reduce (ZeRO)");
  if (rt && rt->tp.size() > 1) rt->all_reduce(rt->tp, sq, "gradient norm all-reduce (TP)");
  return sq;
}

at::Tensor global_grad_norm(TrainingState& state, dist::Runtime* rt) {
  auto sq = stage_grad_norm_sq(state, rt);
  // Pipeline stages hold disjoint layers (a tied piece is weighted 1 / its holders).
  if (rt && rt->pp.size() > 1) rt->all_reduce(rt->pp, sq, "gradient norm all-reduce (pipeline)");
  return sq.sqrt().reshape({});
}

at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  return torch::clamp_max(max_norm / (norm + 1e-6), 1.0);
}

}  // namespace nnstrain::parallel
