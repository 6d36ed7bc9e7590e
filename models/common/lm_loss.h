// Memory-lean LM loss: the head and cross-entropy over token chunks, with the
// chunk's logits recomputed in backward, so [tokens x vocab] never exists whole.
#pragma once

#include <torch/torch.h>

namespace nnstrain::models::common {

// hidden [N, C], weight [V, C], targets [N] -> mean cross-entropy over N, equal
// (loss and gradients) to cross_entropy(linear(hidden, weight), targets).
// Targets equal to ignore_index count neither in the sum nor in the mean, as in
// F::cross_entropy (all ignored -> NaN, as there). Logits are computed in the
// dtype autocast (if on) or the inputs give, and reduced in fp32 (fp64 for fp64
// inputs); the loss is fp32 (fp64 for fp64 inputs). Only the per-token
// logsumexp is kept for backward: O(N) extra memory instead of O(N x V).
torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t chunk_size,
                                           int64_t ignore_index = -100);

}  // namespace nnstrain::models::common
