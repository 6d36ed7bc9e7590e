// How a model runs its transformer blocks: each through run_block, which
// recomputes the block when the plan says so and lets the trainer act at the
// block's boundaries (ZeRO-3 gathers the block's parameters before it runs and
// frees them after) without the model knowing why.
#pragma once

#include <torch/torch.h>

#include <functional>

#include "models/common/parallel_rng.h"

namespace nnstrain::models::common {

// What the trainer does around block i. before() runs ahead of the block's
// forward (also the recomputed one), after() on its output; each returns the
// tensor the model goes on with (the same values: a hook may attach autograd
// nodes, e.g. to act before the block's backward).
struct BlockHooks {
  virtual ~BlockHooks() = default;
  virtual torch::Tensor before(size_t block, const torch::Tensor& x) = 0;
  virtual torch::Tensor after(size_t block, const torch::Tensor& y) = 0;
};

// y = fn(x) for block i: recomputed in backward when `recompute` (recompute.h),
// between the hooks' before and after when `hooks` is set.
torch::Tensor run_block(size_t i, const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x,
                        bool recompute, BlockHooks* hooks, ParallelRng* rng);

}  // namespace nnstrain::models::common
