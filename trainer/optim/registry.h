// The optimizer registry: the trainer builds optimizers by name (optimizer.type)
// and never names one. Adding an optimizer = one folder under trainer/optim/
// plus one line in registry.cpp.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "base/config/trainer_args.h"
#include "trainer/optim/comm.h"
#include "trainer/optim/optimizer.h"
#include "trainer/optim/step_cost.h"
#include "trainer/sharding/shard_spec.h"

namespace nnstrain::optim {

// What an optimizer is built from.
struct OptimizerContext {
  const config::OptimizerArgs* args = nullptr;
  std::vector<Segment> segments;
  // Per segment: the piece of its global parameter it is (TrainingState::segment_specs),
  // and whether that parameter lies inside a transformer block (parameter groups by rule).
  std::vector<sharding::ShardSpec> specs;
  // Every parameter this rank holds a piece of (segments may miss some: ZeRO
  // chunks), with whether it lies inside a transformer block (groups by rule).
  struct Param {
    std::string name;
    std::vector<int64_t> global_shape;
    bool in_block = false;
  };
  std::vector<Param> params;
  bool whole_model = true;              // this stage holds every parameter (pp 1)
  std::shared_ptr<OptimizerComm> comm;  // the ranks sharing this stage's parameters
  bool cuda = false;                    // the run computes on CUDA
};

struct OptimizerEntry {
  std::string name;
  // The `optimizer` mapping -> its config (its own keys; AdamW's for the rest
  // into o through config::read_adamw_args). Errors through ArgMap name the key.
  std::function<std::shared_ptr<const config::OptimizerConfig>(config::ArgMap& optimizer, config::OptimizerArgs& o)>
      parse;
  std::function<std::unique_ptr<Optimizer>(OptimizerContext)> build;
  // It gathers whole matrices: built with a comm over the stage (Runtime::stage).
  bool whole_matrices = false;
  // What its step costs, for the planner (step_cost.h).
  std::function<StepCost(const config::OptimizerArgs&, const std::vector<CostParam>&, bool cuda)> cost;
};

const std::vector<OptimizerEntry>& registered_optimizers();
const OptimizerEntry& optimizer_entry(const std::string& name);  // throws for an unknown name
config::OptimizerCatalog optimizer_catalog();

}  // namespace nnstrain::optim
