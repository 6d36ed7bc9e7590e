#include "trainer/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace nnstrain::optim {

double learning_rate(const config::LrSchedulerArgs& s, double base_lr, int64_t it, int64_t total) {
  const int64_t warmup = s.warmup_steps;
  const int64_t decay = s.decay_steps > 0 ? s.decay_steps : total;
  if (it < warmup) return base_lr * static_cast<double>(it + 1) / static_cast<double>(warmup + 1);
  if (s.type == "constant") return base_lr;
  if (it > decay || decay <= warmup) return s.min_lr;
  const double ratio = static_cast<double>(it - warmup) / static_cast<double>(decay - warmup);
  if (s.type == "linear") return base_lr + ratio * (s.min_lr - base_lr);
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));  // cosine
  return s.min_lr + coeff * (base_lr - s.min_lr);
}

}  // namespace nnstrain::optim
