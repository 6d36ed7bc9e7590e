// Activation checkpointing: run a block without keeping its activations and
// recompute them during backward.
#pragma once

#include <torch/torch.h>

#include <functional>

#include "models/common/parallel_rng.h"

namespace nnstrain::models::common {

// y = fn(x), keeping only x for backward. Backward re-runs fn on x with grad
// enabled, the forward's RNG state (CPU, and CUDA when x is on CUDA: dropout
// masks repeat) and autocast state, then backpropagates through it: x gets its
// gradient and fn's parameters accumulate theirs. Parameters get gradients even
// when x needs none. Without grad mode this is a plain fn(x).
// fn must depend on nothing but x and its parameters (captured tensors it reads
// are read again in backward), and must be callable again until backward ran.
// With `rng`, its sharded-region state (model-parallel RNG) is replayed too.
torch::Tensor recompute(std::function<torch::Tensor(const torch::Tensor&)> fn, const torch::Tensor& x,
                        ParallelRng* rng = nullptr);

// True on this thread while backward re-runs a block's forward (so what a
// forward counts, e.g. MoE layers' statistics, is counted once per micro-batch).
bool recomputing();

}  // namespace nnstrain::models::common
