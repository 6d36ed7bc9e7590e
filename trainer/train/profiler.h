// `profile: {steps: [from, to], dir: ...}`: records steps from..to (inclusive,
// 1-based as logged) with LibTorch's built-in (Kineto) profiler, CPU and, on a
// CUDA device, CUDA activities, and writes one Chrome-trace JSON per rank that
// Perfetto and chrome://tracing open. The step and its parts are named ranges
// (StepTimer), so the trace shows data, forward, backward, communication and
// optimizer.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "base/config/trainer_args.h"

namespace nnstrain::train {

class StepProfiler {
 public:
  StepProfiler(const config::ProfileArgs& args, const c10::Device& device, int rank);
  ~StepProfiler();  // a run that ends inside the window still writes its trace

  void before_step(int64_t step_number);
  void after_step(int64_t step_number);

  // The trace this rank writes: <dir>/trace_rank<R>.json.
  const std::string& path() const { return path_; }

 private:
  void finish();

  config::ProfileArgs args_;
  bool cuda_;
  std::string path_;
  bool running_ = false;
};

}  // namespace nnstrain::train
