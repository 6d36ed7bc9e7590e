#include "models/registry.h"

#include "models/gpt/gpt.h"
#include "models/llama/llama.h"

namespace nnstrain::models {

const std::vector<ModelEntry>& registered_models() {
  // One line per model.
  static const std::vector<ModelEntry> all = {
      gpt::registry_entry(),
      llama::registry_entry(),
  };
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

}  // namespace nnstrain::models
