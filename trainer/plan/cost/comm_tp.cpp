// Tensor parallelism's communication: the layers' all-reduces.
#include <algorithm>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

// Tensor parallelism, per micro-batch: 4 all-reduces per layer (2 forward, 2
// backward), 2 more per recomputed layer, 2 for the vocab-parallel embedding
// and head; ring cost. (Under pp the schedule prices the same per stage:
// pipeline.cpp schedule_time.)
void tp_comm_term(const Setting& x, Interim&, PlanEstimate& e) {
  if (x.c.tp <= 1) return;
  const auto& dev = x.req.device;
  const int per_node = std::max(1, dev.ranks_per_node);
  const double bw = x.c.tp <= per_node ? dev.intra_node_bw : dev.inter_node_bw;
  const double n = 4 * x.L + 2 * x.k + (x.f.vocab_parallel_head ? 2 : 0);
  e.tp_comm_s = x.micro_steps * n *
                (dev.collective_latency_s + 2 * (x.t - 1) / x.t * (x.tokens * x.h * x.pb.act) / bw);
  // Sequence parallelism with MoE layers: each tp rank ran its own tokens through the
  // same (whole) experts, so their gradients are all-reduced over tp in every
  // micro-batch's backward (as the norms' are; the norms' bytes are negligible).
  if (x.sp && x.moe > 0)
    e.tp_comm_s += x.micro_steps * (x.moe_layers * dev.collective_latency_s +
                                    2 * (x.t - 1) / x.t * x.st.expert_elements * x.pb.grad / bw);
}

}  // namespace nnstrain::parallel::cost
