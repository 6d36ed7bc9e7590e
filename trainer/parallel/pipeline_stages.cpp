#include "trainer/parallel/pipeline_stages.h"

#include <numeric>
#include <string>

#include "base/config/arg_map.h"
#include "trainer/parallel/pipeline_schedule.h"

namespace nnstrain::parallel {

PipelinePlan pipeline_plan(const config::PipelineArgs& a, int64_t grad_accumulation_steps, int64_t layers) {
  const std::string key = "compute_config.pas_config.";
  PipelinePlan p;
  p.pp = a.pp_size;
  p.scheduler = a.scheduler;
  p.post_validation = a.post_validation;
  p.nmicros = a.nmicros > 0 ? a.nmicros : grad_accumulation_steps;
  p.stages = a.nstages > 0                ? a.nstages
             : !a.layers.empty()          ? static_cast<int>(a.layers.size())
                                          : pipeline::default_stages(a.scheduler, a.pp_size);
  if (!a.layers.empty()) {
    const int64_t sum = std::accumulate(a.layers.begin(), a.layers.end(), int64_t{0});
    if (sum != layers)
      throw config::ConfigError(key + "pipeline_layers: the stages hold " + std::to_string(sum) +
                                " layers but the model has " + std::to_string(layers));
    p.stage_layers = a.layers;
  } else {
    if (layers < p.stages)
      throw config::ConfigError(key + "pipeline_nstages: " + std::to_string(p.stages) + " stages (pp_size " +
                                std::to_string(p.pp) + ", pipeline_scheduler " + p.scheduler + ") but the model has only " +
                                std::to_string(layers) + " layers; every stage needs at least one");
    // Left empty: the planner balances the layers (cost_model.h stage_split).
  }
  try {
    pipeline::make_schedule(p.scheduler, p.pp, p.stages, static_cast<int>(p.nmicros));
  } catch (const pipeline::ScheduleError& e) {
    throw config::ConfigError(key + "pipeline_scheduler: " + e.what());
  }
  return p;
}

std::vector<StageBlocks> stage_blocks(const PipelinePlan& p) {
  std::vector<StageBlocks> out;
  int64_t at = 0;
  for (int n : p.stage_layers) {
    out.push_back({at, at + n});
    at += n;
  }
  return out;
}

}  // namespace nnstrain::parallel
