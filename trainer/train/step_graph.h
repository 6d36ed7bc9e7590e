// CUDA graphs for the training step (compute_config.cuda_graphs): the whole step
// (forward and backward of every micro-batch, gradient finish, norm, unscale,
// clip, AdamW, loss scaler) is recorded once and replayed, so a step costs one
// graph launch instead of hundreds of kernel launches. Its inputs are static: the
// batches are copied into buffers the graph reads, the learning rate into a
// device scalar; everything else the step touches lives in tensors that persist
// across steps. The first `warmup` steps run eagerly on a side stream (as
// PyTorch's whole-network capture requires: lazy initialisation, cuBLAS
// workspaces, autograd's device threads), the next is captured and replayed.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "data/token_bin.h"

namespace nnstrain::train {

class StepGraph {
 public:
  using Body = std::function<void(const std::vector<data::Batch>& batches)>;
  // Throws when this nnstrain was built without CUDA.
  StepGraph(Body body, int warmup);
  ~StepGraph();
  // One step on these batches (device tensors of the same shapes every step).
  void run(const std::vector<data::Batch>& batches);
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nnstrain::train
