// Data parallelism's communication, with ZeRO's: what of the gradient
// reduction (and ZeRO's gathers) the backward does not hide.
#include <algorithm>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

// Reads compute_term's split of the step into forward and backward (Interim,
// e.compute_s; under pp the schedule's compute).
void dp_comm_term(const Setting& x, Interim& s, PlanEstimate& e) {
  const Compute& cm = s.compute;
  const double d = reduce_group(x.c);  // parameters are replicated over cp: reduced over dp x cp
  if (d <= 1) return;
  const auto& dev = x.req.device;
  // The dp group (ranks r, r + tp cp pp, ...) leaves the node once the world does.
  const double bw = link_bw(dev, double(x.c.tp) * x.c.cp * x.c.pp * x.c.dp);
  const double p_local = x.st.elements, z = x.st.z, micro_steps = x.micro_steps;
  const double grad_bytes = p_local * x.pb.grad;
  const double alpha = dev.collective_latency_s;
  const double cap = x.a.compute_config.reducer_bucket_cap_mb * 1024 * 1024;
  const double buckets = double(x.st.buckets);
  const double backward = e.compute_s / micro_steps * (2 * cm.flops_token / 3 + cm.recompute_flops) /
                          (cm.flops_token + cm.recompute_flops);
  const double forward = e.compute_s / micro_steps - backward;
  const double groups = d / z;
  // The reduced chunk's all-reduce across ZeRO groups (hybrid sharding).
  const double cross = groups > 1 ? 2 * (groups - 1) / groups * grad_bytes / z / bw : 0.0;
  if (x.c.zero_stage == 3 && z > 1) {
    // Per micro-batch: every unit gathered for forward and again for
    // backward, its gradient reduce-scattered as its backward ends; each
    // overlaps the compute it feeds except the first unit's gather and the
    // last unit's reduce-scatter.
    const double units = x.Lr + 2;
    const double gather = units * alpha + (z - 1) / z * p_local * x.pb.param / bw;
    const double scatter = units * alpha * (groups > 1 ? 2 : 1) + (z - 1) / z * grad_bytes / bw + cross;
    if (x.c.pp > 1) {
      // Under pp every unit is gathered once per step, issued at its start
      // (the first unit waited for, the rest behind the first forward); the
      // gradients reduce-scatter after each micro-batch's backward, the
      // shard's all-reduce across ZeRO groups once at the step's end.
      const double rs = scatter - cross;
      const double contention =
          kOverlapContention * (std::min(gather, forward) + micro_steps * std::min(rs, backward));
      e.dp_comm_s = gather / units + std::max(0.0, gather - forward) +
                    micro_steps * (rs / units + std::max(0.0, rs - backward)) + cross + contention;
      e.contention_s += contention;
      return;
    }
    const double per_micro = gather / units + std::max(0.0, gather - forward) +
                             std::max(0.0, gather + scatter - backward) + scatter / units;
    const double contention =
        micro_steps * kOverlapContention * (std::min(gather, forward) + std::min(gather + scatter, backward));
    e.dp_comm_s = micro_steps * per_micro + contention;
    e.contention_s += contention;
    return;
  }
  double overlappable;  // launched bucket by bucket during the last micro-batch's backward
  double after = 0;     // after the optimizer step
  // Expert parallelism: the expert buckets reduce (and shard) over the
  // dp x cp / ep ranks holding the same experts (st.ez under ZeRO), the rest
  // over dp x cp; the same links (the edp group spans dp x cp).
  const double ep = std::max(1, x.c.ep);
  const double p_expert = ep > 1 ? x.st.expert_elements : 0.0, p_dense = p_local - p_expert;
  const double de = d / ep, ez = x.st.ez;
  if (x.c.zero_stage) {
    // Reduce-scatter in the ZeRO group, all-reduce of the chunk across groups,
    // all-gather of the updated parameters.
    overlappable = buckets * alpha * (groups > 1 ? 2 : 1) + (z - 1) / z * p_dense * x.pb.grad / bw +
                   (ez - 1) / ez * p_expert * x.pb.grad / bw + cross;
    after = buckets * alpha + ((z - 1) / z * p_dense + (ez - 1) / ez * p_expert) * x.pb.param / bw;
  } else {
    overlappable = buckets * alpha + 2 * ((d - 1) / d * p_dense + (de - 1) / de * p_expert) * x.pb.grad / bw;
  }
  const double last_bucket = overlappable * std::min(1.0, cap / grad_bytes);
  // ZeRO-2 has no buffer to accumulate whole gradients in: it reduce-scatters every micro-batch.
  const double rounds = x.c.zero_stage == 2 ? micro_steps : 1;
  const double contention = rounds * kOverlapContention * std::min(overlappable - last_bucket, backward);
  e.dp_comm_s = rounds * (last_bucket + std::max(0.0, overlappable - last_bucket - backward)) + after + contention;
  e.contention_s += contention;
}

}  // namespace nnstrain::parallel::cost
