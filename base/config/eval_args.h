// eval: downstream tasks scored on the live model during training
// (docs/eval.md, trainer/eval/in_training.h); `enabled` when the section is present.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nnstrain::config {

struct EvalArgs {
  bool enabled = false;
  std::vector<std::string> tasks;  // task YAMLs (lm-evaluation-harness's keys over JSON lines)
  int64_t every_n_train_steps = 0;  // and at the last step
  int64_t limit = 0;                // the first N documents of each task (0: all)
  int64_t batch_size = 8;           // requests per forward
  std::string tokenizer;            // default: model.init_from's, else the meta.json beside dataset's train path
};

}  // namespace nnstrain::config
