// Muon's keys (optimizer.type: muon): optimizer.args for the matrices Muon
// takes, optimizer.adamw_args for the rest (AdamW's keys). Defaults are
// torch.optim.Muon's. docs/config.md "optimizer" lists them.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "base/config/arg_map.h"
#include "base/config/trainer_args.h"
#include "trainer/optim/step_cost.h"

namespace nnstrain::optim::muon {

struct MuonConfig : config::OptimizerConfig {
  double lr = 1e-3;
  double weight_decay = 0.1;       // decoupled: param *= 1 - lr * weight_decay
  double momentum = 0.95;
  bool nesterov = true;
  std::array<double, 3> ns_coefficients{3.4445, -4.7750, 2.0315};  // Newton-Schulz (a, b, c)
  int ns_steps = 5;
  double eps = 1e-7;
  std::string adjust_lr_fn = "original";  // original: sqrt(max(1, A/B)); match_rms_adamw: 0.2 sqrt(max(A, B))
  std::string ns_dtype = "auto";          // auto: bf16 on CUDA (as PyTorch), fp32 on CPU; bf16; fp32
  // Parameter-name globs (* any run of characters) Muon takes; empty: the
  // rule, every matrix inside the blocks (embeddings, head, norms, biases to AdamW).
  std::vector<std::string> params;
  std::string params_where;  // "optimizer.args.params (line N)", for errors found at build
};

std::shared_ptr<const config::OptimizerConfig> parse(config::ArgMap& optimizer, config::OptimizerArgs& o);

// `name` matches glob `pattern` (only * is special).
bool glob_match(const std::string& pattern, const std::string& name);

// Whether Muon takes a parameter (of 2 or more dims): a glob of `params`
// matches its name, or, without globs, it lies inside a transformer block.
bool takes(const MuonConfig& c, const std::string& name, bool in_block);

// What its step costs (the planner's, step_cost.h): the matrices it takes one
// momentum each and newton_schulz_flops per matrix; the rest AdamW's.
StepCost step_cost(const config::OptimizerArgs& o, const std::vector<CostParam>& params, bool cuda);

}  // namespace nnstrain::optim::muon
