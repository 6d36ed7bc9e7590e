#include "trainer/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "base/config/load.h"

namespace nnstrain::optim {

namespace {

// wsd after the warmup: base through the stable phase, then the decay. As the
// warmup (lr x (it + 1) / (warmup + 1)), the decay leaves out its ends: its
// i-th iteration (1-based) of D is at progress i / (D + 1), so no iteration
// repeats the base lr or trains at min_lr (torchtitan's form).
double wsd_after_warmup(const config::LrSchedulerArgs& s, double base_lr, int64_t it, int64_t total) {
  const int64_t decay = config::wsd_decay_length(s, total);
  const int64_t start = total - decay;  // the decay's first iteration
  if (it < start) return base_lr;
  const double p = std::min(1.0, static_cast<double>(it + 1 - start) / static_cast<double>(decay + 1));
  double keep = 1.0 - p;  // linear
  if (s.decay_type == "cosine") keep = 0.5 * (1.0 + std::cos(M_PI * p));
  if (s.decay_type == "1-sqrt") keep = 1.0 - std::sqrt(p);
  return s.min_lr + keep * (base_lr - s.min_lr);
}

}  // namespace

double learning_rate(const config::LrSchedulerArgs& s, double base_lr, int64_t it, int64_t total) {
  const int64_t warmup = s.warmup_steps;
  if (it < warmup) return base_lr * static_cast<double>(it + 1) / static_cast<double>(warmup + 1);
  if (s.type == "constant") return base_lr;
  if (s.type == "wsd") return wsd_after_warmup(s, base_lr, it, total);
  const int64_t decay = s.decay_steps > 0 ? s.decay_steps : total;
  if (it > decay || decay <= warmup) return s.min_lr;
  const double ratio = static_cast<double>(it - warmup) / static_cast<double>(decay - warmup);
  if (s.type == "linear") return base_lr + ratio * (s.min_lr - base_lr);
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));  // cosine
  return s.min_lr + coeff * (base_lr - s.min_lr);
}

double learning_rate_at_step(const config::LrSchedulerArgs& s, double base_lr, int64_t step, int64_t max_steps,
                             int64_t steps_per_epoch) {
  if (s.interval == "epoch") return learning_rate(s, base_lr, step / steps_per_epoch, max_steps / steps_per_epoch);
  return learning_rate(s, base_lr, step, max_steps);
}

}  // namespace nnstrain::optim
