// Tensor parallelism, Megatron style, applied from a model's split declaration:
// column-parallel linears (QKV by heads, MLP up), row-parallel linears (attention
// output, MLP down), a vocab-parallel embedding and a vocab-parallel
// cross-entropy that never gathers the full logits. Communication happens in
// custom autograd functions; the model's code is untouched.
#pragma once

#include <vector>

#include "trainer/dist/process_groups.h"
#include "trainer/parallel/training_state.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::parallel {

struct TpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Replaces each split parameter by this rank's piece and installs the
// communicating forwards. rt may be null only when the world is one process.
// Returns every parameter as this rank holds it, with its ShardSpec; the
// replicas of a piece are the ranks at the same tensor-parallel position.
std::vector<ParamShard> apply_tensor_parallel(models::CausalLM& model, dist::Runtime* rt, int world_size);

// Refuses, with the numbers, a degree the model's declaration cannot split into.
void check_tensor_parallel(const models::CausalLM& model, int tp);

}  // namespace nnstrain::parallel
