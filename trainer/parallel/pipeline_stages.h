// Which layers each pipeline stage holds and which stages each pipeline rank
// runs: the PipelinePlan made from compute_config.pas_config, checked against
// the model's layer count and the scheduler (pipeline_schedule.h) on every rank
// before the plan is agreed. The split itself, when the user gives none, is the
// planner's (cost_model.h stage_split). No LibTorch.
#pragma once

#include <cstdint>
#include <vector>

#include "base/config/trainer_args.h"
#include "trainer/parallel/plan.h"

namespace nnstrain::parallel {

// The plan's pipeline from the config: stages (pipeline_nstages, or auto: pp
// for gpipe, 1f1b and zb1p, 2 x pp for 1f1b_interleaved and zbv), micro-batches
// (pipeline_nmicros, or the step's grad_accumulation_steps), layers per stage
// (pipeline_layers, or empty: the planner's balance). Throws config::ConfigError naming the
// keys when the split or the schedule cannot work.
PipelinePlan pipeline_plan(const config::PipelineArgs& args, int64_t grad_accumulation_steps, int64_t layers);

// Blocks [begin, end) of each stage, in stage order.
struct StageBlocks {
  int64_t begin = 0, end = 0;
};
std::vector<StageBlocks> stage_blocks(const PipelinePlan& p);

}  // namespace nnstrain::parallel
