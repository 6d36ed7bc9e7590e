#include "trainer/train/profiler.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <filesystem>
#include <set>

#include "base/log.h"

namespace nnstrain::train {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

StepProfiler::StepProfiler(const config::ProfileArgs& args, const c10::Device& device, int rank)
    : args_(args), cuda_(device.is_cuda()), index_(device.has_index() ? device.index() : 0) {
  if (args_.enabled())
    path_ = (std::filesystem::path(args_.dir) / ("trace_rank" + std::to_string(rank) + ".json")).string();
}

StepProfiler::~StepProfiler() {
  try {
    finish();
  } catch (const std::exception& e) {
    log::error(std::string("profiler: ") + e.what());
  }
}

void StepProfiler::before_step(int64_t step_number) {
  if (!args_.enabled() || running_ || step_number < args_.from || step_number > args_.to) return;
  std::filesystem::create_directories(args_.dir);
  const ProfilerConfig config(ProfilerState::KINETO, args_.record_shapes, /*profile_memory=*/false,
                              args_.with_stack);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda_) activities.insert(ActivityType::CUDA);
  kineto::prepareProfiler(config, activities);
  synchronize();  // the previous step's kernels stay out of the window
  kineto::enableProfiler(config, activities);
  running_ = true;
  log::info("profiling steps " + std::to_string(step_number) + ".." + std::to_string(args_.to));
}

void StepProfiler::after_step(int64_t step_number) {
  if (running_ && step_number >= args_.to) finish();
}

void StepProfiler::finish() {
  if (!running_) return;
  running_ = false;
  synchronize();  // the window's last kernels finish inside it
  auto result = kineto::disableProfiler();
  result->save(path_);
  log::info("profiler trace written to " + path_ + " (open it in https://ui.perfetto.dev)");
}

void StepProfiler::synchronize() const {
  if (cuda_) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(index_);
}

}  // namespace nnstrain::train
