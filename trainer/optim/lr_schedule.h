// Learning-rate schedules as pure functions of the step (or epoch): nothing to
// checkpoint beyond the step itself.
#pragma once

#include <cstdint>

#include "base/config/trainer_args.h"

namespace nnstrain::optim {

// lr for 0-based iteration `it` (a step, or an epoch when interval is epoch).
// constant: warmup then base; linear: warmup then linear to min_lr at decay_steps;
// cosine: nanoGPT's get_lr (linear warmup, cosine to min_lr at decay_steps, then min_lr).
double learning_rate(const config::LrSchedulerArgs& s, double base_lr, int64_t it, int64_t total);

}  // namespace nnstrain::optim
