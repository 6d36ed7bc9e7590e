#include "models/registry.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "models/common/init.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "models/moe/moe_lm.h"

namespace nnstrain::models {

const std::vector<ModelEntry>& registered_models() {
  // One line per model.
  static const std::vector<ModelEntry> all = [] {
    std::vector<ModelEntry> v = {
        gpt::registry_entry(),
        llama::registry_entry(),
        moe::qwen3_moe_entry(),
        moe::mixtral_entry(),
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

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& m : registered_models()) names.push_back(m.name);
  return names;
}

config::ModelCatalog model_catalog() {
  config::ModelCatalog c;
  c.names = model_names();
  c.parse = [](const std::string& type, config::ArgMap& args) { return find_model(type)->parse_args(args); };
  return c;
}

}  // namespace nnstrain::models
