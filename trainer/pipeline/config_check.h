// What the config loader asks of the pipeline schedule
// (config::ModuleChecks::pipeline_schedule): the loader lives in base/, which
// knows no scheduler, so this check lives here beside make_schedule.
// No LibTorch: in nnstrain_base, as pipeline_schedule.cpp.
#pragma once

#include "base/config/load.h"

namespace nnstrain::parallel::pipeline {

// Can pipeline_scheduler run pp_size ranks, the stages (pipeline_nstages, the
// length of pipeline_layers, or the scheduler's default) and `micros`
// micro-batches? Fails on `pas` at pipeline_scheduler with make_schedule's reason.
void check_config_schedule(const config::ArgMap& pas, const config::PipelineArgs& pipeline, int micros);

}  // namespace nnstrain::parallel::pipeline
