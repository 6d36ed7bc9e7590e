// The eval: section in the training loop (docs/eval.md): the tasks loaded and
// the tokenizer found when the run starts (bad files exit 2 before step 1),
// then scored every eval.every_n_train_steps on the live sharded model the
// trainer hands over as a Backend (no checkpoint round trip). Scores come back
// as one metrics record: {"step", "eval_<task>/<metric>", "eval_seconds"}.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"
#include "trainer/eval/evaluator.h"

namespace nnstrain::eval {

class InTrainingEval {
 public:
  // Throws config::ConfigError naming the key, file and line.
  InTrainingEval(const config::TrainerArgs& args, Backend be);
  bool due(int64_t step, bool last) const {
    return (every_ > 0 && step % every_ == 0) || last;
  }
  // Every rank calls it (collectives); the record is rank 0's to write.
  nlohmann::json run(int64_t step);
  int64_t documents() const;

 private:
  std::vector<Task> tasks_;
  std::unique_ptr<TextCodec> codec_;
  Backend be_;
  EvalOptions opts_;
  int64_t every_ = 0;
  bool warned_truncation_ = false;
};

}  // namespace nnstrain::eval
