// When every rank agrees to stop early (SIGTERM/SIGUSR1 on any of them, as
// SLURM and PBS send before preemption). Agreeing costs a host collective on
// the CPU control group, so it is not done every step: only at agreement
// steps, spaced so that about `every_s` seconds of training pass between two
// (never fewer than one step apart), and at checkpoint and last steps. A
// signal is thus acted on within max(every_s, one step) plus the step in
// progress. No device work is involved. docs/launching.md states the latency.
#pragma once

#include <chrono>
#include <cstdint>

namespace nnstrain::dist {
class Runtime;
}

namespace nnstrain::train {

// Steps until the next agreement when a step takes `step_s` seconds: about
// every_s seconds' worth, at least 1, at most 1000.
int64_t agreement_interval(double step_s, double every_s);

class StopDecision {
 public:
  static constexpr double kEverySeconds = 1.0;

  // rt: null for a single process, which decides alone at every step for free.
  explicit StopDecision(dist::Runtime* rt, double every_s = kEverySeconds);

  // Called by every rank after each step; `requested`: this rank was signalled;
  // `forced`: agree at this step whatever the interval (checkpoint, last step).
  // Returns true on every rank at the same step once any rank was signalled.
  bool after_step(int64_t step, bool requested, bool forced);

 private:
  dist::Runtime* rt_;
  double every_s_;
  int64_t next_ = -1;  // step of the next agreement; -1: the first step
  int64_t last_step_ = 0;
  std::chrono::steady_clock::time_point last_time_;
};

}  // namespace nnstrain::train
