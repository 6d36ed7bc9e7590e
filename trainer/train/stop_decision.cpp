#include "trainer/train/stop_decision.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "trainer/dist/process_groups.h"

namespace nnstrain::train {

int64_t agreement_interval(double step_s, double every_s) {
  if (!(step_s > 0)) return 1;
  return std::clamp<int64_t>(static_cast<int64_t>(std::floor(every_s / step_s)), 1, 1000);
}

StopDecision::StopDecision(dist::Runtime* rt, double every_s)
    : rt_(rt), every_s_(every_s), last_time_(std::chrono::steady_clock::now()) {}

bool StopDecision::after_step(int64_t step, bool requested, bool forced) {
  if (!rt_) return requested;
  if (!forced && next_ >= 0 && step < next_) return false;
  // Each rank proposes an interval from its own pace; the shortest wins, so
  // every rank computes the same next agreement step. One host all-reduce
  // (max) carries both: [stop requested anywhere, -interval].
  const auto now = std::chrono::steady_clock::now();
  const double step_s = std::chrono::duration<double>(now - last_time_).count() /
                        static_cast<double>(std::max<int64_t>(1, step - last_step_));
  std::vector<int64_t> v{requested ? 1 : 0, -agreement_interval(step_s, every_s_)};
  rt_->host_max(v, "stop decision");
  next_ = step - v[1];
  last_step_ = step;
  last_time_ = now;
  return v[0] != 0;
}

}  // namespace nnstrain::train
