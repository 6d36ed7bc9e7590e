// A loss over whole sequences in place of the LM head's mean cross-entropy
// (preference alignment, trainer/align/). The head, whatever its split, hands
// the objective each position's target log-likelihood and the logits' mean over
// the vocabulary; the objective reduces them per sequence (sums over a row's
// counted targets) and returns the micro-batch's loss. Models never see it: the
// trainer sets it on the model's ParallelLmHead (as LoRA converts linears).
#pragma once

#include <ATen/core/Tensor.h>

namespace nnstrain::models::common {

// Per position of the head's batch, [B, T], fp32 (fp64 for fp64 models).
struct TokenScores {
  at::Tensor nll;          // -log p(target): differentiable, 0 where the target is ignored
  at::Tensor mean_logits;  // the position's logits averaged over the vocabulary (detached, a metric)
  at::Tensor counted;      // bool: the target counts
};

class SequenceObjective {
 public:
  virtual ~SequenceObjective() = default;
  virtual at::Tensor loss(const TokenScores& scores) = 0;
};

}  // namespace nnstrain::models::common
