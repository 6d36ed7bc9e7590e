// `profile: {steps: [from, to], dir: ...}`: records steps from..to (inclusive,
// 1-based as logged) with LibTorch's built-in (Kineto) profiler, CPU and, on a
// CUDA device, CUDA activities, and writes one Chrome-trace JSON per rank that
// Perfetto and chrome://tracing open. The step and its parts are named ranges
// (StepTimer), so the trace shows data, forward, backward, communication and
// optimizer. On CUDA the device is synchronised at the window's two edges, so
// the trace holds the window's kernels and no others (they run asynchronously:
// the last step's would still be in flight when the profiler stops).
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
  void synchronize() const;  // CUDA: every queued kernel done

  config::ProfileArgs args_;
  bool cuda_;
  c10::DeviceIndex index_ = 0;
  std::string path_;
  bool running_ = false;
};

}  // namespace nnstrain::train
