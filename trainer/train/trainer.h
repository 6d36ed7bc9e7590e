// The training loop: builds the model from the registry, applies the plan,
// streams data, steps the optimizer, evaluates, logs and checkpoints.
#pragma once

#include <string>

#include "trainer/config/trainer_args.h"
#include "trainer/dist/dist_env.h"

namespace nnstrain::train {

struct RunOptions {
  std::string resume;  // "" = fresh (unless checkpoint.resume_from), "last", or a checkpoint folder
};

// Trains to the end; returns the process exit status.
int run(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts);

}  // namespace nnstrain::train
