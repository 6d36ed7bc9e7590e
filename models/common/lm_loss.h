// Memory-lean LM losses: the head and cross-entropy over token chunks, so
// [tokens x vocab] never exists whole. Chunked: the chunk's logits recomputed
// in backward. Fused: the gradients made in forward, chunk by chunk.
#pragma once

#include <torch/torch.h>

#include "models/common/sharding.h"

namespace nnstrain::models::common {

// Forwards of each kind of loss since the process started, counted in the
// losses' forwards below (and in the one-rank plain head's cross-entropy,
// count_plain_loss_forward): the run's record of which loss actually ran
// (trainer/train/active_record.h); the kinds agree to fp32 rounding, so the
// losses alone cannot tell them apart.
struct LossForwards {
  int64_t plain = 0, chunked = 0, fused = 0;
};
LossForwards loss_forwards();
void count_plain_loss_forward();

// hidden [N, C], weight [V, C], targets [N] -> mean cross-entropy over N, equal
// (loss and gradients) to cross_entropy(linear(hidden, weight), targets).
// Targets equal to ignore_index count neither in the sum nor in the mean, as in
// F::cross_entropy (all ignored -> a NaN loss and zero gradients, as there, so a
// caller weighting micro-batches by their token counts can give an all-masked
// one weight 0). Logits are computed in the
// dtype autocast (if on) or the inputs give, and reduced in fp32 (fp64 for fp64
// inputs); the loss is fp32 (fp64 for fp64 inputs). Only the per-token
// logsumexp is kept for backward: O(N) extra memory instead of O(N x V).
// softcap > 0: the logits are c tanh(logits / c) first (Gemma's
// final_logit_softcapping), recomputed so in backward; the same for every form below.
torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t chunk_size,
                                           int64_t ignore_index = -100, double softcap = 0);

// The same loss over a vocabulary split across the tensor-parallel group. This
// rank holds the rows [vocab_start, vocab_start + held) of the head weight (rows
// past `held` are padding and never reach the loss); only per-token statistics
// cross ranks (max, sum of exponentials, target logit). ignore_index as above.
// logits: [N, rows] local logits of hidden against the local weight.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_start, int64_t held, int64_t ignore_index,
                                           const c10::intrusive_ptr<TpComm>& comm);
// The same per token: [N] negative log-likelihoods (fp32, fp64 for fp64 logits;
// 0 where ignored), each token's gradient its own (a loss over whole sequences,
// models/common/sequence_objective.h).
torch::Tensor vocab_parallel_token_nll(const torch::Tensor& logits, const torch::Tensor& targets,
                                       int64_t vocab_start, int64_t held, int64_t ignore_index,
                                       const c10::intrusive_ptr<TpComm>& comm);
// Chunked over tokens as chunked_linear_cross_entropy: hidden [N, C] (already
// replicated onto the group; its gradient here is this rank's partial sum),
// weight [rows, C] local.
torch::Tensor chunked_vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                   const torch::Tensor& targets, int64_t vocab_start, int64_t held,
                                                   int64_t chunk_size, int64_t ignore_index,
                                                   const c10::intrusive_ptr<TpComm>& comm, double softcap = 0);

// The fused linear + cross-entropy: the same loss (and gradients) as
// chunked_linear_cross_entropy, dtype rules included, but the gradients of
// hidden and weight are computed during forward, chunk by chunk, and kept in
// fp32 (fp64 for fp64 inputs) until backward, which only scales them by the
// incoming gradient: the head costs three matmuls, not the chunked loss's four.
// Memory: one chunk's logits plus the two gradients ([N, C] and [V, C] fp32)
// from forward on. Gradients are made only for inputs that require them while
// grad mode is on (a no_grad forward, e.g. a recompute's first pass, makes
// none). One backward per forward (no retain_graph).
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& targets, int64_t chunk_size,
                                         int64_t ignore_index = -100, double softcap = 0);
// Over a vocabulary split across the tensor-parallel group, as
// chunked_vocab_parallel_cross_entropy (hidden's gradient is this rank's partial).
torch::Tensor fused_vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                 const torch::Tensor& targets, int64_t vocab_start, int64_t held,
                                                 int64_t chunk_size, int64_t ignore_index,
                                                 const c10::intrusive_ptr<TpComm>& comm, double softcap = 0);

}  // namespace nnstrain::models::common
