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

config::ModelCatalog model_catalog() {
  config::ModelCatalog c;
  c.names = model_names();
  c.parse = [](const std::string& type, config::ArgMap& args) { return find_model(type)->parse_args(args); };
  return c;
}

}  // namespace nnstrain::models
