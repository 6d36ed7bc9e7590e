#include "trainer/state/clip.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <functional>

#include <map>
#include <string>

#include "trainer/dist/process_groups.h"
#include "trainer/state/training_state.h"

namespace nnstrain::parallel {

namespace {

// Each tensor's sum of squares: fp32 from CUDA's foreach norm; fp64 on the CPU,
// read where it lies with fp64 partial sums per block (converting the gradients
// to fp64 first, as the foreach norm with a dtype does, cost moe_mini ~8% of its step).
at::Tensor sums_of_squares(const std::vector<at::Tensor>& grads) {
  if (grads.front().is_cuda()) return torch::stack(at::_foreach_norm(grads, 2, torch::kFloat32)).pow(2);
  auto out = torch::empty({static_cast<int64_t>(grads.size())}, torch::kFloat64);
  auto* o = out.data_ptr<double>();
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto g = grads[i].contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "sums_of_squares", [&] {
      const scalar_t* p = g.data_ptr<scalar_t>();
      o[i] = at::parallel_reduce(
          int64_t{0}, g.numel(), int64_t{32768}, 0.0,
          [&](int64_t b, int64_t e, double s) {
            double a[8] = {};  // independent sums: the adds pipeline (and vectorise)
            int64_t j = b;
            for (; j + 8 <= e; j += 8)
              for (int k = 0; k < 8; ++k) a[k] += double(p[j + k]) * double(p[j + k]);
            for (; j < e; ++j) s += double(p[j]) * double(p[j]);
            return s + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
          },
          std::plus<double>());
    });
  }
  return out;
}

}  // namespace

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
  // segments are summed where they are, in segment order, then brought together.
  std::map<std::string, std::vector<int64_t>> by_device;
  for (size_t i = 0; i < grads.size(); ++i) by_device[grads[i].device().str()].push_back(static_cast<int64_t>(i));
  at::Tensor squares;
  if (by_device.size() == 1) {
    squares = sums_of_squares(grads);
  } else {
    // One copy per device group, not one per segment.
    squares = torch::empty({static_cast<int64_t>(grads.size())}, torch::TensorOptions().device(dev).dtype(acc));
    for (const auto& [name, idx] : by_device) {
      std::vector<at::Tensor> g;
      for (auto i : idx) g.push_back(grads[i]);
      squares.index_copy_(0, torch::tensor(idx).to(dev), sums_of_squares(g).to(dev, acc));
    }
  }
  auto weighted = squares * state.norm_weights().to(acc);
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
