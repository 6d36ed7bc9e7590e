// Expert parallelism's communication: the MoE layers' all-to-alls.
#include <algorithm>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel {

double moe_imbalance(const PlanRequest& req) {
  const double v = req.moe_imbalance > 0 ? req.moe_imbalance : req.args ? req.args->compute_config.moe_imbalance : 1.25;
  return std::max(1.0, v);
}

AllToAll all_to_all_layer(const PlanRequest& req, const ModelFacts& f, const Candidate& c) {
  return cost::a2a_layer(cost::setting(req, f, c, {}));
}

namespace cost {

// Expert parallelism, one MoE layer of one micro-batch (AllToAll). Each
// all-to-all: the busiest rank receives imb x the mean, from each other member
// of its ep group 1/ep of its tokens' k rows of h; rows from the members on
// its node over NVLink, the others' over its NIC, at once. The ep group: ep
// consecutive members of dp x cp (cp innermost), so it spans nodes once
// ep x tp x cp (with pp between dp members) outgrows a node. Not overlapped:
// the dispatcher waits for each before the experts (or attention) go on.
AllToAll a2a_layer(const Setting& x) {
  AllToAll r;
  if (x.c.ep <= 1 || x.moe <= 0) return r;
  const auto& dev = x.req.device;
  const int ep = x.c.ep, cp = std::max(1, x.c.cp), per_node = std::max(1, dev.ranks_per_node);
  auto member = [&](int e) { return int64_t(x.c.tp) * ((e % cp) + int64_t(cp) * x.c.pp * (e / cp)); };
  int on_node = 0;  // members of rank 0's group on rank 0's node
  for (int e = 0; e < ep; ++e) on_node += member(e) < per_node;
  r.cross_node = on_node < ep;
  const double rows = x.imb * x.tokens * x.rep * x.topk * x.h * x.pb.act;  // all it receives, itself included
  r.bytes = rows * (ep - 1) / ep;
  const double alpha = dev.collective_latency_s;
  const double one = alpha + std::max(rows * (on_node - 1) / ep / dev.intra_node_bw,
                                      rows * (ep - on_node) / ep / dev.inter_node_bw);
  r.forward_s = alpha + 2 * one;  // the counts exchange (a few bytes: its latency), dispatch, combine
  r.backward_s = 2 * one;
  return r;
}

// Every MoE layer's all-to-alls per micro-batch, once more in forward for
// each recomputed MoE layer (the first k layers hold k x moe of them).
void ep_comm_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto r = a2a_layer(x);
  e.a2a_layer_s = r.forward_s + r.backward_s;
  e.a2a_cross_node = r.cross_node;
  e.moe_imbalance = x.moe > 0 ? moe_imbalance(x.req) : 0.0;  // the allowance (applied at ep > 1)
  e.ep_comm_s = x.micro_steps * (x.moe_layers * e.a2a_layer_s + x.k * x.moe * r.forward_s);
}

}  // namespace cost
}  // namespace nnstrain::parallel
