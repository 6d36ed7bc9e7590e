// The built-in planner's search: a pure function from (config, model
// declaration, world size, device) to a Plan. It enumerates candidates
// (tensor-parallel degree, ZeRO stage 0-3, activation recompute of the first
// k layers, offload tiers), asks the cost model (cost_model.h) for each one's
// per-rank memory and step time, and chooses. For each (tp, recompute) it
// takes the least ZeRO stage that fits the memory budget; at the smallest tp
// without recompute that is the plan, else the fastest of them. Deterministic:
// ties go to the smaller tp, then less recompute. Offload tiers (optimizer,
// then also parameters) are searched only when no candidate without them fits.
// For an MoE model under autodist (no expert_parallel_size in the config) each
// expert-parallel size dividing dp x cp is a split of its own, chosen by speed
// at the first (tp, recompute) point that fits.
#pragma once

#include <string>
#include <vector>

#include "trainer/plan/cost_model.h"
#include "trainer/plan/plan.h"

namespace nnstrain::parallel {

// A candidate the planner did not take, and why.
struct Rejected {
  std::string candidate;  // e.g. "tp=2 dp=4 zero=0 recompute=3/12"
  std::string reason;     // with the numbers
  // Structured for tests and --json: kind is infeasible | memory (over the
  // budget) | sharding (fits, but a lower ZeRO stage fits at the same tp and
  // recompute) | order (fits, but the plan needed neither more tp nor more
  // recompute) | slower (fits, but the plan is faster).
  std::string kind;
  Candidate cand;
  double memory_bytes = 0, step_s = 0;  // its estimate (0 when infeasible)
};

// The plan for req. Throws PlanError with the numbers. rejected, if given,
// receives every candidate that was considered and not chosen, in search order.
Plan make_plan(const PlanRequest& req, std::vector<Rejected>* rejected = nullptr);
// The same from the model's facts (req.model unused): for models described
// rather than built (tests, docs/plans).
Plan make_plan(const PlanRequest& req, const ModelFacts& f, std::vector<Rejected>* rejected = nullptr);

// Rejected candidates, consecutive recompute counts with the same verdict
// folded into one line. One line per entry, ending in a newline.
std::string describe_rejected(const std::vector<Rejected>& rejected, int layers);

}  // namespace nnstrain::parallel
