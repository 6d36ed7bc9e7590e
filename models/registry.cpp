#include "models/registry.h"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>

#include "models/common/init.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "models/moe/gpt_oss.h"
#include "models/moe/moe_lm.h"

namespace nnstrain::models {

namespace {

// GPT reads GPT-2's folders under nanoGPT's argument names.
ModelEntry gpt_entry() {
  auto e = gpt::registry_entry();
  e.hf_model_type = "gpt2";
  e.args_of_hf = [](const nlohmann::json& j) {
    return nlohmann::json{{"vocab_size", j.at("vocab_size")}, {"block_size", j.at("n_positions")},
                          {"n_layer", j.at("n_layer")},       {"n_head", j.at("n_head")},
                          {"n_embd", j.at("n_embd")},         {"bias", true}};
  };
  return e;
}

}  // namespace

const std::vector<ModelEntry>& registered_models() {
  // One line per model.
  static const std::vector<ModelEntry> all = [] {
    std::vector<ModelEntry> v = {
        gpt_entry(),
        llama::registry_entry(),
        llama::family_entry("qwen2"),
        llama::family_entry("qwen3"),
        llama::family_entry("mistral"),
        llama::family_entry("phi3"),
        llama::family_entry("gemma3"),
        moe::qwen3_moe_entry(),
        moe::mixtral_entry(),
        moe::gpt_oss_entry(),
        moe::deepseek_v3_entry(),
    };
    for (auto& e : v) {
      if (e.build) continue;
      e.build = [sharded = e.build_sharded](const config::ModelConfig& c) {
        common::ShardingContext meta;
        meta.options = meta.options.device(c10::kMeta);
        auto model = sharded(c, meta);
        uint64_t seed;
        {
          auto gen = at::detail::getDefaultCPUGenerator();
          std::lock_guard<std::mutex> lock(gen.mutex());
          seed = gen.get<at::CPUGeneratorImpl>()->random64();
        }
        common::materialise_fresh(*model, c10::Device(c10::kCPU), seed);
        return model;
      };
    }
    return v;
  }();
  return all;
}

const ModelEntry* find_model(const std::string& name) {
  for (const auto& m : registered_models())
    if (m.name == name) return &m;
  return nullptr;
}

const ModelEntry* find_hf_model(const std::string& model_type) {
  for (const auto& m : registered_models())
    if ((m.hf_model_type.empty() ? m.name : m.hf_model_type) == model_type && m.from_hf_config) return &m;
  return nullptr;
}

std::pair<std::string, nlohmann::json> folder_args(const std::string& dir) {
  const auto path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot be read");
  if (std::filesystem::file_size(path) > (16u << 20)) throw std::runtime_error(path + ": over 16 MiB, not a config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": not JSON: " + std::string(e.what()).substr(0, 200));
  }
  if (!j.is_object() || !j.contains("model_type") || !j.at("model_type").is_string())
    throw std::runtime_error(path + ": no \"model_type\" string");
  const auto type = j.at("model_type").get<std::string>();
  const auto* entry = find_hf_model(type);
  if (!entry) {
    std::string known;
    for (const auto& m : registered_models())
      if (m.from_hf_config) known += (known.empty() ? "" : ", ") + (m.hf_model_type.empty() ? m.name : m.hf_model_type);
    throw std::runtime_error(path + ": model_type '" + type + "' is not one nnstrain reads (" + known + ")");
  }
  std::shared_ptr<const config::ModelConfig> cfg;
  try {
    cfg = entry->from_hf_config(j);
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (what.rfind("config.json: ", 0) == 0) what = what.substr(13);
    throw std::runtime_error(path + ": " + what);
  }
  // The config as the model writes it back: its own keys, defaults filled in, validated.
  common::ShardingContext meta;
  meta.options = meta.options.device(c10::kMeta);
  auto hf = entry->build_sharded(*cfg, meta)->hf_config();
  auto args = entry->args_of_hf ? entry->args_of_hf(hf) : hf;
  for (auto it = args.begin(); it != args.end();) it = it->is_null() ? args.erase(it) : std::next(it);
  return {entry->name, args};
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& m : registered_models()) names.push_back(m.name);
  return names;
}

config::ModelCatalog model_catalog() {
  config::ModelCatalog c;
  c.names = model_names();
  c.parse = [](const std::string& type, config::ArgMap& args) { return find_model(type)->parse_args(args); };
  c.folder_args = [](const std::string& dir) {
    auto [type, args] = folder_args(dir);
    // Settings of training, not of the weights' model: model.args may change them.
    return config::ModelCatalog::Folder{type, args.dump(),
                                        {"initializer_range", "router_aux_loss_coef", "router_z_loss_coef",
                                         "capacity_factor", "bias_update_speed", "dropout", "attention_dropout"}};
  };
  return c;
}

}  // namespace nnstrain::models
