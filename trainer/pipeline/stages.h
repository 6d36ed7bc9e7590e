// Which layers each pipeline stage holds and which stages each pipeline rank
// runs: the PipelinePlan made from compute_config.pas_config, checked against
// the model's layer count and the scheduler (pipeline_schedule.h) on every rank
// before the plan is agreed. The split itself, when the user gives none, is the
// planner's (cost_model.h stage_split; fastest_split below for schedules with
// several stages per rank). No LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/config/trainer_args.h"
#include "trainer/pipeline/schedule.h"
#include "trainer/plan/plan.h"

namespace nnstrain::parallel {

// The plan's pipeline from the config: stages (pipeline_nstages, or auto: pp
// for gpipe, 1f1b and zb1p, 2 x pp for 1f1b_interleaved and zbv), micro-batches
// (pipeline_nmicros, or the step's grad_accumulation_steps), layers per stage
// (pipeline_layers, or empty: the planner's balance). Throws config::ConfigError naming the
// keys when the split or the schedule cannot work.
PipelinePlan pipeline_plan(const config::PipelineArgs& args, int64_t grad_accumulation_steps, int64_t layers);

// `layers` dealt one at a time to whichever part (stage or rank) it leaves
// cheapest, a part costing its layers plus fixed[part] (other work, in
// layers), ties to the earlier; each part starts with least[part]. With equal
// layers this makes the most expensive part the cheapest it can be.
std::vector<int> deal_layers(int64_t layers, const std::vector<double>& fixed, std::vector<int> least);

// The split of the layers of `start` (the per-stage balance) over the stages
// of `scheduler`'s schedule whose simulated step (pipeline::simulate) is the
// shortest, a stage of n layers costing n + extra[stage] for each of F, I and W
// (B: twice). When a rank holds several stages (1f1b_interleaved, zbv) what
// counts is what each rank holds and the schedule's critical path, not the
// largest stage: the candidates are `start`, the per-rank balance (the layers
// dealt to the ranks by the total of their stages, then within each rank over
// its stages), and from the faster of the two every move of one layer from
// one stage to another, the best move per round while one shortens the step
// (on small pipelines this finds what an exhaustive search finds). Every
// stage keeps at least one layer and at most start's largest (a stage's
// activations and the recompute counts the planner tries grow with it); the
// counts keep their sum. The step is simulated at up to 2 micro-batches per
// stage (the steady state), each further one adding the busiest rank's work.
// Ties keep the earlier candidate, so `start` stays unless another is faster;
// one stage per rank returns `start`. Deterministic: every rank computes the
// same split.
std::vector<int> fastest_split(const std::string& scheduler, int ranks, int stages, int micros,
                               const std::vector<int>& start, const std::vector<double>& extra);

// Blocks [begin, end) of each stage, in stage order.
struct StageBlocks {
  int64_t begin = 0, end = 0;
};
std::vector<StageBlocks> stage_blocks(const PipelinePlan& p);

}  // namespace nnstrain::parallel
