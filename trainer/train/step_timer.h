// The step-time split: how long each part of a training step took (data wait,
// forward, backward, exposed communication, optimizer; under a replayed CUDA
// graph data and the graph as a whole). Measured only on the
// steps that are logged: on CUDA with events on the current stream, read at the
// logging step's sync; on CPU with the host clock. On other steps timing costs
// nothing and adds no sync.
//
// Every part is also a named range for LibTorch's profiler (ProfilerStep#N
// around the step; data, forward, backward, communication, optimizer inside),
// so a trace shows the same split. Outside profiling such a range is a
// thread-local check.
#pragma once

#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <memory>

namespace nnstrain::train {

class StepTimer {
 public:
  // kGraph: a replayed CUDA graph, forward to optimizer as one part.
  enum Part { kData, kForward, kBackward, kComm, kOptimizer, kGraph, kNumParts };
  // "data", "forward", ...: the profiler range names.
  static const char* name(Part p);
  // "time_data_ms", ...: the metrics record's keys.
  static const char* metric_key(Part p);

  explicit StepTimer(const c10::Device& device);
  ~StepTimer();

  // Starts step `step_number` (1-based); `timed`: this step's split is wanted.
  void begin_step(int64_t step_number, bool timed);
  // Ends the current part and starts `p` (a part may come back: micro-steps).
  void enter(Part p);
  void end_step();

  // Milliseconds per part of the last timed step (on CUDA: waits for its events).
  std::array<double, kNumParts> read();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nnstrain::train
