// The global gradient norm and clipping, as functions of a TrainingState after
// its gradients are reduced. All on the device: no host sync.
#pragma once

#include <ATen/core/Tensor.h>

namespace nnstrain::dist {
class Runtime;
}

namespace nnstrain::parallel {

class TrainingState;

// L2 norm of the whole model's (reduced) gradients, identical on every rank:
// ZeRO chunks are summed over the ZeRO group, tensor-parallel pieces over the
// TP group, stages over the pipeline group, and a piece every TP rank (or both
// ends of a pipeline, a tied embedding) replicates counts once. rt may be null.
at::Tensor global_grad_norm(TrainingState& state, dist::Runtime* rt);
// Its square before the sum over pipeline stages (float32 [1]): what this
// pipeline rank's tp x ZeRO group holds. global_grad_norm is the square root
// of its sum over the pipeline group; optimizer post-validation issues that
// sum asynchronously.
at::Tensor stage_grad_norm_sq(TrainingState& state, dist::Runtime* rt);

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1.
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm);

}  // namespace nnstrain::parallel
