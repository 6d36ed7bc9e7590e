// The cost model's assembly: ONE table of terms (cost_terms), and the two
// estimates that iterate it, the flat one (pp 1) and the pipeline's. The
// terms themselves live in trainer/plan/cost/, a file per family
// (trainer/plan/README.md); the setting they read in cost/setting.h.
#include "trainer/plan/cost_model.h"

#include <optional>
#include <vector>

#include "trainer/plan/cost/pipeline.h"
#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel {

namespace cost {

// The terms in the order they run: each may read what the rows above it
// filled (the peak reads the state's bytes, dp the compute's split, offload
// the step's compute and communication). comm_s sums the `comm` rows' times
// in this order; step_s the times of the rows with one (the comm rows as
// comm_s, at the first one's place; under pp the Schedule rows as the
// schedule's makespan).
const std::vector<Term>& cost_terms() {
  using O = OverRanks;
  using E = PlanEstimate;
  static const std::vector<Term> t = {
      // name, what it prices, the fields it fills, over pipeline ranks, its time, comm, function
      {"state", "parameters, gradients and optimizer state between steps under ZeRO",
       "param_bytes grad_bytes optim_bytes expert_bytes", O::Worst, nullptr, false, state_term},
      {"frozen", "a frozen base's weights (LoRA) held beside the training state (ZeRO-3: this rank's chunks)",
       "frozen_bytes", O::Worst, nullptr, false, frozen_term},
      {"offload_memory", "the optimizer state (and ZeRO-3 chunks) moved to host memory or NVMe",
       "optim_bytes param_bytes host_bytes nvme_bytes", O::Worst, nullptr, false, offload_memory_term},
      {"post_validation", "optimizer post-validation's backup of what the speculative step changes",
       "optim_bytes grad_bytes", O::Worst, nullptr, false, post_validation_term},
      {"peak", "activations (tp/sp, recompute, the loss) and the sharding's transients at the step's peak",
       "activation_bytes transient_bytes total_bytes", O::Worst, nullptr, false, peak_term},
      {"compute", "the step's training FLOPs (recompute's extra forward) at the assumed efficiency",
       "compute_s", O::Schedule, &E::compute_s, false, compute_term},
      {"tp_comm", "tensor parallelism's all-reduces (and MoE expert gradients under SP)",
       "tp_comm_s", O::Schedule, &E::tp_comm_s, true, tp_comm_term},
      {"cp_comm", "context parallelism's K/V ring or gather, and the compute it slows",
       "cp_comm_s contention_s", O::Schedule, &E::cp_comm_s, true, cp_comm_term},
      {"dp_comm", "data parallelism's gradient reduction and ZeRO's gathers, what backward does not hide",
       "dp_comm_s contention_s", O::Step, &E::dp_comm_s, true, dp_comm_term},
      {"pipeline", "the pipeline's bubble and its transfers between stages (pp > 1: the schedule simulation)",
       "pp_bubble pp_comm_s", O::Schedule, &E::pp_comm_s, true, pipeline_term},
      {"ep_comm", "expert parallelism's all-to-alls",
       "ep_comm_s a2a_layer_s a2a_cross_node moe_imbalance", O::Step, &E::ep_comm_s, true, ep_comm_term},
      {"offload_time", "the host's optimizer step, the copies and the NVMe tier's disk, what is exposed",
       "host_step_s copy_s offload_s nvme_s", O::Step, &E::offload_s, false, offload_time_term},
      {"optimizer", "the optimizer's step on the device: element-wise, whole-matrix work, its exchange",
       "optim_step_s optim_elementwise_s optim_matrix_s optim_exchange_s optim_matrix_flops "
       "optim_gather_bytes optim_scatter_bytes",
       O::Slowest, &E::optim_step_s, false, optimizer_time_term},
  };
  return t;
}

namespace {

// One rank, the whole model: every term in the table's order.
PlanEstimate flat_estimate(const Setting& x) {
  PlanEstimate e;
  Interim s;
  for (const auto& term : cost_terms()) {
    term.price(x, s, e);
    if (term.comm) e.comm_s += e.*term.time;
  }
  bool comm_added = false;
  for (const auto& term : cost_terms()) {
    if (!term.time) continue;
    if (!term.comm) e.step_s += e.*term.time;
    else if (!comm_added) e.step_s += e.comm_s, comm_added = true;
  }
  return e;
}

// Pipeline parallelism: the Worst and Slowest terms priced for every
// pipeline rank (its stages' parameters, its peak moment: pipeline.cpp
// pipeline_rank_part), the busiest in memory being the estimate (its
// total_bytes; pp_rank_bytes every rank's); the Schedule terms per stage
// through the schedule simulator (schedule_time), on the worst rank's
// setting; the Step terms once on that setting. Step time: the schedule's
// makespan, then the other terms' times in the table's order.
PlanEstimate pipeline_estimate(const PlanRequest& req, const ModelFacts& f, const Candidate& c, ScheduleCache* cache) {
  ScheduleCache local;
  auto& im = *(cache ? cache : &local)->impl;
  const auto pl = pipeline_layout(req, f, c, im);
  const auto& terms = cost_terms();
  const auto optimizer = optimizer_cost(req, f);
  PlanEstimate e;
  std::optional<Setting> worst;
  std::vector<std::optional<Setting>> slowest(terms.size());
  std::vector<double> slowest_s(terms.size(), 0.0);
  std::vector<double> rank_bytes;
  for (int r = 0; r < pl.ranks; ++r) {
    const auto x = setting(req, f, c, pipeline_rank_part(req, f, c, pl, r, optimizer), &optimizer);
    PlanEstimate er;
    Interim s;
    for (const auto& term : terms)
      if (term.pipeline == OverRanks::Worst) term.price(x, s, er);
    rank_bytes.push_back(er.total_bytes);
    for (size_t i = 0; i < terms.size(); ++i) {
      if (terms[i].pipeline != OverRanks::Slowest) continue;
      PlanEstimate ot;  // every pipeline index runs it at once: the slowest counts
      terms[i].price(x, s, ot);
      if (ot.*terms[i].time > slowest_s[i]) slowest_s[i] = ot.*terms[i].time, slowest[i].emplace(x);
    }
    if (!worst || er.total_bytes > e.total_bytes) {
      e = er;
      worst.emplace(x);
    }
  }
  const Setting& x = *worst;
  e.pp_rank_bytes = rank_bytes;
  const double makespan = schedule_time(x, pl, e);
  Interim s;
  PlanEstimate scratch;  // the Schedule terms' own figures: the schedule's stand
  for (size_t i = 0; i < terms.size(); ++i) {
    const auto& term = terms[i];
    if (term.pipeline == OverRanks::Schedule) term.price(x, s, scratch);  // for what later terms read (Interim)
    else if (term.pipeline == OverRanks::Step) term.price(x, s, e);
    else if (term.pipeline == OverRanks::Slowest && slowest[i]) term.price(*slowest[i], s, e);
    if (term.comm) e.comm_s += e.*term.time;
  }
  e.step_s = makespan;
  for (const auto& term : terms)
    if (term.time && term.pipeline != OverRanks::Schedule) e.step_s += e.*term.time;
  return e;
}

}  // namespace
}  // namespace cost

PlanEstimate estimate(const PlanRequest& req, const ModelFacts& f, const Candidate& c, ScheduleCache* cache) {
  if (c.pp > 1) return cost::pipeline_estimate(req, f, c, cache);
  return cost::flat_estimate(cost::setting(req, f, c, {}));
}

PlanEstimate estimate(const PlanRequest& req, const Candidate& c) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  return estimate(req, model_facts(req), c);
}

}  // namespace nnstrain::parallel
