// RMSNorm's fused CPU form (kernels.h's rms_norm under auto on the CPU): one
// pass over each row forward, one backward, rows spread over the intra-op
// threads. ATen's _fused_rms_norm is a composite on the CPU (five ops and their
// backward nodes per norm); this is what made the norms ~10% of moe_mini's step.
#pragma once

#include <ATen/core/Tensor.h>

namespace nnstrain::models::common::kernels {

// Whether rms_norm_cpu takes these operands: CPU, x and weight of one floating
// dtype (fp32, fp64, bf16, fp16), weight [x.size(-1)].
bool rms_norm_cpu_fits(const at::Tensor& x, const at::Tensor& weight);

// weight * x / sqrt(mean(x^2) + eps) over the last dimension, accumulated in fp32
// (fp64 for fp64), the result in x's dtype; differentiable in x and weight.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace nnstrain::models::common::kernels
