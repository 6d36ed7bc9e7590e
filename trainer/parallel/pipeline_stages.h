// Which layers each pipeline stage holds and which stages each pipeline rank
// runs: the PipelinePlan made from compute_config.pas_config (the user's
// layer split, or an even one), checked against the model's layer count and
// the scheduler (pipeline_schedule.h). No LibTorch.
#pragma once

#include <cstdint>
#include <vector>

#include "base/config/trainer_args.h"
#include "trainer/parallel/plan.h"

namespace nnstrain::parallel {

// `layers` over `stages` as evenly as they go, the remainder one each to the
// middle stages first (the first stage also embeds, the last runs the head and
// the loss), then the first. A stand-in for the cost model's balance.
std::vector<int> even_layer_split(int64_t layers, int stages);

// The plan's pipeline from the config: stages (pipeline_nstages, or auto: pp
// for gpipe, 1f1b and zb1p, 2 x pp for 1f1b_interleaved and zbv), micro-batches
// (pipeline_nmicros, or the step's grad_accumulation_steps), layers per stage
// (pipeline_layers, or even_layer_split). Throws config::ConfigError naming the
// keys when the split or the schedule cannot work.
PipelinePlan pipeline_plan(const config::PipelineArgs& args, int64_t grad_accumulation_steps, int64_t layers);

// Blocks [begin, end) of each stage, in stage order.
struct StageBlocks {
  int64_t begin = 0, end = 0;
};
std::vector<StageBlocks> stage_blocks(const PipelinePlan& p);

}  // namespace nnstrain::parallel
