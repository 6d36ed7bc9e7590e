#include "trainer/pipeline/config_check.h"

#include "trainer/pipeline/schedule.h"

namespace nnstrain::parallel::pipeline {

void check_config_schedule(const config::ArgMap& pas, const config::PipelineArgs& q, int micros) {
  const int stages = q.nstages > 0         ? q.nstages
                     : !q.layers.empty() ? static_cast<int>(q.layers.size())
                                         : default_stages(q.scheduler, q.pp_size);
  try {
    make_schedule(q.scheduler, q.pp_size, stages, micros);
  } catch (const ScheduleError& e) {
    pas.fail("pipeline_scheduler", e.what());
  }
}

}  // namespace nnstrain::parallel::pipeline
