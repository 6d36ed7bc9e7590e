// The model registry: the trainer builds models by name and never names one.
// Adding a model = one folder under models/ plus one line in registry.cpp.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "base/config/trainer_args.h"

namespace nnstrain::models::common {
struct ShardingContext;
}

namespace nnstrain::models {

class CausalLM;

struct ModelEntry {
  std::string name;
  // model.args -> a validated, model-specific config (errors via ArgMap name the key and line).
  std::function<std::shared_ptr<const config::ModelConfig>(config::ArgMap&)> parse_args;
  // The whole model (tp 1) on the CPU, freshly initialised from a seed drawn
  // from the current torch CPU generator. Filled in by the registry.
  std::function<std::shared_ptr<CausalLM>(const config::ModelConfig&)> build;
  // This rank's piece of the model for a sharding context, parameters on
  // ctx.options (on meta: not yet materialised, models/common/init.h).
  std::function<std::shared_ptr<CausalLM>(const config::ModelConfig&, const common::ShardingContext&)> build_sharded;
  // A Hugging Face config.json -> our config (for model.init_from); null if unsupported.
  std::function<std::shared_ptr<const config::ModelConfig>(const nlohmann::json&)> from_hf_config;
  // config.json's model_type for this model (empty: its name).
  std::string hf_model_type;
  // The model's hf_config() -> its model.args (empty: the same keys; GPT's differ).
  std::function<nlohmann::json(const nlohmann::json&)> args_of_hf;
};

const std::vector<ModelEntry>& registered_models();
const ModelEntry* find_model(const std::string& name);   // nullptr if unknown
// The model that reads config.json's `model_type` (nullptr if none).
const ModelEntry* find_hf_model(const std::string& model_type);
// A Hugging Face folder's model type and its model.args (JSON), from DIR/config.json
// validated by the model's from_hf_config: what model.init_from alone builds.
// Throws std::runtime_error naming the file and the key it cannot take.
std::pair<std::string, nlohmann::json> folder_args(const std::string& dir);
std::vector<std::string> model_names();
// The registry as the config loader sees it (names + model.args parsers).
config::ModelCatalog model_catalog();

}  // namespace nnstrain::models
