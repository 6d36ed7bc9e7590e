// The compute term: the step's training FLOPs on this rank at
// kAssumedEfficiency of the device's peak.
#include <algorithm>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

// The FLOPs a training step runs per token: the model's count, whose
// attention term covers the whole s x s score matrix, less the masked half a
// causal kernel (flash, memory-efficient) skips.
// Routed experts run whole on every tensor-parallel rank, on all of its tokens
// (1/tp of them under SP), and the busiest expert-parallel rank runs imb x the
// mean: their FLOPs are scaled so that the terms' division by tp comes out so.
// A frozen base (LoRA) skips its weight gradients and adds the adapters' work.
double work_per_token(const Setting& x) {
  return x.f.flops_per_token(static_cast<int64_t>(x.s)) - 0.5 * x.attn_flops * x.L +
         x.expert_flops * (x.t * x.rep * x.imb - 1) - x.f.frozen_weight_grad_flops + x.f.adapter_flops;
}

// Compute: the training FLOPs per token (work_per_token), one more forward per
// recomputed layer (and per micro-batch for a preference reference), divided
// over tp, at kAssumedEfficiency of the peak.
void compute_term(const Setting& x, Interim& s, PlanEstimate& e) {
  const double peak =
      peak_flops_for(x.req.device, x.a.precision, x.a.compute_config.allow_tf32) * kAssumedEfficiency;
  Compute& cm = s.compute;
  cm.flops_token = work_per_token(x);
  const double layer_flops = std::max(0.0, cm.flops_token - 6 * x.V * x.h) / std::max(1.0, x.L);
  cm.recompute_flops = x.k * layer_flops / 3;  // one more forward (1/3 of fwd+bwd) per recomputed layer
  // A reference forward per micro-batch (alignment.reference frozen or adapters_off, trainer/align): a third.
  const auto& ref = x.a.alignment.reference;
  if (x.a.alignment.enabled && (ref == "frozen" || ref == "adapters_off")) cm.recompute_flops += cm.flops_token / 3;
  const double tokens_rank = x.micro_steps * x.tokens;  // cp ranks share a sequence's tokens
  e.compute_s = tokens_rank * (cm.flops_token + cm.recompute_flops) / x.t / peak;
}

}  // namespace nnstrain::parallel::cost
