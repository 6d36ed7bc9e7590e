// What the planner's cost model (trainer/plan/cost/optimizer.cpp) asks of an
// optimizer: per parameter, the state it keeps and the work its step does on
// whole matrices. The optimizer knows its arithmetic; the cost model knows the
// plan (shards, owners, links, the device) and prices it. Each registered
// optimizer names its function in registry.cpp (OptimizerEntry::cost).
#pragma once

#include <string>
#include <vector>

#include "base/config/trainer_args.h"

namespace nnstrain::optim {

// A parameter as the cost model sees it (global shape, whether it lies inside
// a transformer block: the parameter-group rule's input).
struct CostParam {
  std::string name;
  std::vector<int64_t> shape;
  bool in_block = false;
};

struct StepCost {
  // Per parameter, in the given order: state tensors per element, each in the
  // moments' dtype (docs/precision.md): AdamW 2 (exp_avg, exp_avg_sq), Muon's
  // matrices 1 (momentum_buffer).
  std::vector<int> state_tensors;
  // Per parameter: FLOPs per step on each whole [rows, cols] matrix of it (the
  // last two dims; the leading ones count matrices, one per expert), done by
  // one owner rank after a gather and followed by a scatter (Muon's
  // MatrixExchange); 0: element-wise only.
  std::vector<double> matrix_flops;
  bool bf16 = false;  // the matrix work and its exchange in bf16 (else fp32)
  std::string what;   // the matrix work, for `nnstrain plan`: "Newton-Schulz (5 steps, bf16)"
};

// AdamW: two moments per element, no matrix work.
StepCost adamw_step_cost(const config::OptimizerArgs& o, const std::vector<CostParam>& params, bool cuda);
}  // namespace nnstrain::optim
