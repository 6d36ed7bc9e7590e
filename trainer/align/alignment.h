// Preference alignment in the training loop (alignment:, docs/alignment.md):
// the objective on the policy's LM head (trainer/align/preference_loss), the
// reference's log-probabilities for each micro-batch (a frozen copy, a table
// precomputed before the first step, or the LoRA base with adapters off), and
// TRL's metrics. Trainer::step calls it around each micro-batch; the model
// never knows (models/common/sequence_objective.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"
#include "data/dataset.h"

namespace nnstrain::models {
class CausalLM;
}
namespace nnstrain::dist {
class Runtime;
}
namespace nnstrain::parallel {
struct Plan;
}

namespace nnstrain::align {

class PreferenceObjective;

// What the alignment needs from the run around it.
struct AlignmentContext {
  const config::TrainerArgs* args = nullptr;
  const parallel::Plan* plan = nullptr;
  dist::Runtime* rt = nullptr;  // null: one process
  c10::Device device = c10::Device(c10::kCPU);
  int rank = 0, dp = 1, dp_rank = 0;
  int64_t micro_batch = 1, start_step = 0;
  // A fresh copy of the starting model split as the policy (reference: frozen).
  std::function<std::shared_ptr<models::CausalLM>()> build_reference;
  // This rank's tokens of a batch (context parallelism: its slice of every row).
  std::function<data::Batch(data::Batch)> slice;
  // Pipeline parallelism: a forward of the whole model stage after stage (the
  // pipeline's evaluation pass; the head runs on the last stage's ranks only).
  std::function<void(const data::Batch&)> pipeline_forward;
  // ZeRO-3's forward-only bracket (gather the parameters outside the blocks, release after).
  std::function<void()> begin_forward, end_forward;
};

class Alignment {
 public:
  // Refuses (ConfigError, exit 2) what the run cannot serve: a plan the
  // objective does not run under, a reference mode the model or plan lacks.
  Alignment(const AlignmentContext& ctx, std::shared_ptr<models::CausalLM> policy, const data::Dataset& train);
  ~Alignment();

  // Before the first step (precomputed): the reference pass over every pair of
  // the training set (and of the validation set, if any), or the stored tables
  // read back. Every rank calls it.
  void prepare(const data::Dataset& train, const data::Dataset* val);
  // What a micro-batch weighs in the step's mean: its pairs.
  at::Tensor count(const data::Batch& b) const;
  void begin_step();
  // The reference's log-probabilities of b's pairs, for the policy forward that follows.
  void before_forward(const data::Batch& b);
  // TRL's metrics of the step just taken (over every dp x cp rank) into rec.
  void report(nlohmann::json& rec);
  // Validation: between begin_eval and end_eval the batches are the validation
  // set's (its table, under precomputed) and their metrics go to end_eval's
  // record as val_rewards/chosen, ... (TRL's eval_ metrics), the step's kept apart.
  void begin_eval();
  void end_eval(nlohmann::json& rec);
  // For the run record and the log: loss type and reference mode.
  nlohmann::json describe() const;

 private:
  at::Tensor reference_sums(const data::Batch& b);
  at::Tensor reference_table(const data::Dataset& ds, const std::string& path_override, std::string* path);
  nlohmann::json metrics_record(const at::Tensor& sums, const std::string& prefix);

  AlignmentContext ctx_;
  config::AlignmentArgs a_;
  std::shared_ptr<models::CausalLM> policy_, frozen_;
  std::shared_ptr<PreferenceObjective> objective_, collector_;
  at::Tensor table_, val_table_;  // precomputed: [pairs, 2] (chosen, rejected) on the device
  std::string table_path_, val_table_path_;
  bool in_eval_ = false;
  at::Tensor step_metrics_;  // the step's, kept while validation runs
};

}  // namespace nnstrain::align
