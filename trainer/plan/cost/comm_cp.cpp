// Context parallelism's communication: K and V round the ring (or gathered),
// per layer, and the compute the hidden transfers slow.
#include <algorithm>
#include <cmath>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

CpLayer cp_layer(const Setting& x) {
  CpLayer r;
  if (x.cp <= 1) return r;
  const auto& dev = x.req.device;
  const double bw = x.t * x.cp <= std::max(1, dev.ranks_per_node) ? dev.intra_node_bw : dev.inter_node_bw;
  const double alpha = dev.collective_latency_s;
  const double kv_heads_local = std::ceil(x.kv / x.t), head_dim = x.h / x.heads;
  // Latent attention's expanded K and its V (padded to K's width) travel, not the compression.
  const double kv_width = x.f.dims.attn_qk > 0 ? 2.0 * std::ceil(x.heads / x.t) * double(x.f.dims.attn_qk) / x.heads
                                              : 2 * kv_heads_local * head_dim;
  const double kv = x.tokens * kv_width * x.pb.act;  // this rank's K and V
  const double dkv = kv / x.pb.act * 4;                                    // their fp32 gradients
  const double peak =
      peak_flops_for(dev, x.a.precision, x.a.compute_config.allow_tf32) * kAssumedEfficiency;
  // This rank's queries against the sequence, causal: half the blocks' pairs are masked.
  const double attn_forward = x.tokens * 0.5 * x.attn_flops / 3 / x.t / peak;
  if (x.c.cp_comm == "all_gather") {
    const double gather = alpha + (x.cp - 1) / x.cp * x.cp * kv / bw;
    r.forward_s = gather;
    r.backward_s = gather + alpha + (x.cp - 1) / x.cp * x.cp * dkv / bw;
    r.kv_backward = x.cp * (kv + dkv);
  } else {
    const double block = attn_forward / x.cp, steps = x.cp - 1;
    const double send_f = alpha + kv / bw, send_b = alpha + (kv + dkv) / bw;
    r.forward_contention_s = steps * kOverlapContention * std::min(send_f, block);
    r.backward_contention_s = steps * kOverlapContention * std::min(send_b, 2 * block);
    r.forward_s = steps * std::max(0.0, send_f - block) + r.forward_contention_s;
    r.backward_s = steps * std::max(0.0, send_b - 2 * block) + r.backward_contention_s;
    r.kv_backward = 2 * (kv + dkv);  // the block computing and the next one arriving
  }
  return r;
}

// Context parallelism: every layer's ring (or gather) per micro-batch, once
// more in forward for each recomputed layer.
void cp_comm_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto r = cp_layer(x);
  e.cp_comm_s = x.micro_steps * (x.L * (r.forward_s + r.backward_s) + x.k * r.forward_s);
  e.contention_s += x.micro_steps * (x.L * (r.forward_contention_s + r.backward_contention_s) +
                                     x.k * r.forward_contention_s);
}

}  // namespace nnstrain::parallel::cost
