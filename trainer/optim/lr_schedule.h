// Learning-rate schedules as pure functions of the step (or epoch): nothing to
// checkpoint beyond the step itself.
#pragma once

#include <cstdint>

#include "base/config/trainer_args.h"

namespace nnstrain::optim {

// lr for 0-based iteration `it` (a step, or an epoch when interval is epoch) of `total`.
// constant: warmup then base; linear: warmup then linear to min_lr at decay_steps;
// cosine: nanoGPT's get_lr (linear warmup, cosine to min_lr at decay_steps, then min_lr);
// wsd: warmup, base until the last decay-phase iterations, then linear, cosine or
// 1-sqrt down towards min_lr (docs/config.md, lr_scheduler).
double learning_rate(const config::LrSchedulerArgs& s, double base_lr, int64_t it, int64_t total);

// The lr of 0-based optimizer step `step` in a run of `max_steps` steps: the
// schedule at that step, or at its epoch under interval epoch.
double learning_rate_at_step(const config::LrSchedulerArgs& s, double base_lr, int64_t step, int64_t max_steps,
                             int64_t steps_per_epoch);

}  // namespace nnstrain::optim
