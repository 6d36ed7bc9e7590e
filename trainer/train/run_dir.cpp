#include "trainer/train/run_dir.h"

#include <filesystem>

#include "trainer/checkpoint/checkpoint.h"

namespace fs = std::filesystem;

namespace nnstrain::train {

std::string rank_log_path(const std::string& run_dir, int rank) {
  return (fs::path(run_dir) / "logs" / ("rank" + std::to_string(rank) + ".log")).string();
}

void write_run_files(const config::TrainerArgs& args, const nlohmann::json& plan, const RunInfo& info) {
  const fs::path dir(args.run_dir);
  fs::create_directories(dir);
  checkpoint::write_file_durable((dir / "config.yaml").string(), args.resolved_yaml);
  checkpoint::write_file_durable((dir / "plan.json").string(), plan.dump(2) + "\n");
  nlohmann::json run = {
      {"config_file", args.config_file},
      {"world_size", info.world_size},
      {"device", info.device},
      {"checkpoint_dir", args.checkpoint.save_dir.empty() ? "" : fs::absolute(args.checkpoint.save_dir).string()},
      {"resumed_from", info.resumed_from},
      {"start_step", info.start_step},
      {"tokens_per_step", info.tokens_per_step}};
  checkpoint::write_file_durable((dir / "run.json").string(), run.dump(2) + "\n");
}

}  // namespace nnstrain::train
