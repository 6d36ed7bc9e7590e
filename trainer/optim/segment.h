// What an optimizer updates: a parameter tensor (or, under ZeRO, a flat slice
// of one) with its gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace nnstrain::optim {

struct Segment {
  std::string name;        // parameter name (state is checkpointed under it)
  at::Tensor param;        // updated in place
  at::Tensor grad;         // read
  double weight_decay = 0; // per group: 0 for biases and norms
  int64_t offset = 0;      // flat offset of this segment within the parameter's local piece
  // Optional zeroed buffers for the state (shaped as param), e.g. in host
  // memory under offload: AdamW's two moments; an optimizer with one state
  // tensor (Muon's momentum) uses exp_avg. By default the optimizer allocates beside param.
  at::Tensor exp_avg, exp_avg_sq;
};

// The gradient in the parameter's dtype: with compute_config.reduce_dtype bf16
// under a mixed precision, fp32 masters meet bf16 gradients, which no optimizer
// kernel takes. The upcast is a transient of the gradient's size.
inline at::Tensor grad_as_param(const Segment& s) {
  return s.grad.scalar_type() == s.param.scalar_type() ? s.grad : s.grad.to(s.param.scalar_type());
}

}  // namespace nnstrain::optim
