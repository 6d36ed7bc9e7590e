#include "trainer/optim/registry.h"

#include <stdexcept>

#include "trainer/optim/adamw.h"
#include "trainer/optim/muon/muon.h"

namespace nnstrain::optim {

const std::vector<OptimizerEntry>& registered_optimizers() {
  // One entry per optimizer.
  static const std::vector<OptimizerEntry> all = {
      {"adamw", nullptr,  // its keys are the loader's own (optimizer.args)
       [](OptimizerContext c) -> std::unique_ptr<Optimizer> {
         return std::make_unique<AdamW>(std::move(c.segments), *c.args);
       },
       false, adamw_step_cost},
      {"muon", muon::parse,
       [](OptimizerContext c) -> std::unique_ptr<Optimizer> { return std::make_unique<muon::Muon>(std::move(c)); },
       true, muon::step_cost},
  };
  return all;
}

const OptimizerEntry& optimizer_entry(const std::string& name) {
  for (const auto& e : registered_optimizers())
    if (e.name == name) return e;
  throw std::invalid_argument("unknown optimizer '" + name + "'");
}

config::OptimizerCatalog optimizer_catalog() {
  config::OptimizerCatalog c;
  for (const auto& e : registered_optimizers()) c.names.push_back(e.name);
  c.parse = [](const std::string& type, config::ArgMap& optimizer, config::OptimizerArgs& o) {
    return optimizer_entry(type).parse(optimizer, o);
  };
  return c;
}

}  // namespace nnstrain::optim
