// The shape facts of a model that the planner's cost model needs (FLOPs,
// activation memory), apart from models/model.h so the cost model's header
// needs no LibTorch.
#pragma once

#include <cstdint>

namespace nnstrain::models {

struct ModelDims {
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, max_seq = 0;
  bool tied_embeddings = true;
};

}  // namespace nnstrain::models
