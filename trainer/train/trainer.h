// `nnstrain train`: start-up (startup.h: model, agreed plan, data, process
// groups, training state, resume), then the loop (trainer.cpp: step, evaluate,
// save, progress), with LibTorch errors turned into one line.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "base/config/trainer_args.h"
#include "trainer/dist/dist_env.h"

namespace nnstrain::train {

// A LibTorch error while training, as one line naming the rank and step; `detail`
// keeps LibTorch's full message with its backtrace (printed under --debug).
struct StepError : std::runtime_error {
  StepError(const std::string& line, std::string detail) : std::runtime_error(line), detail(std::move(detail)) {}
  std::string detail;
};

// `torch_error` (a c10::Error) raised on `rank` during `step` (0: before training).
StepError step_error(const std::exception& torch_error, int rank, int64_t step);

struct RunOptions {
  std::string resume;  // "" = fresh (unless checkpoint.resume_from), "last", or a checkpoint folder
};

// Trains to the end; returns the process exit status.
int run(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts);

}  // namespace nnstrain::train
