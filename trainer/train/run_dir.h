// The run folder (`run_dir`, docs/observability.md): what the run was next to
// what it logged. Rank 0 writes config.yaml (the resolved configuration),
// plan.json and run.json (world size, device, where the checkpoints are);
// every rank logs to logs/rank<R>.log; the sinks write metrics.jsonl and
// tensorboard/ there by default.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"

namespace nnstrain::train {

// logs/rank<R>.log under run_dir.
std::string rank_log_path(const std::string& run_dir, int rank);

struct RunInfo {
  int world_size = 1;
  std::string device;
  std::string resumed_from;  // checkpoint folder, "" for a fresh run
  int64_t start_step = 0;
  int64_t tokens_per_step = 0;  // global batch x sequence length: the report's tokens axis
};

// config.yaml, plan.json, run.json (rank 0 only).
void write_run_files(const config::TrainerArgs& args, const nlohmann::json& plan, const RunInfo& info);

}  // namespace nnstrain::train
