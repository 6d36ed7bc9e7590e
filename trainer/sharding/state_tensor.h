// A local piece of a global tensor and which piece it is: what the training
// state hands to checkpoints and what checkpoints load into.
#pragma once

#include <ATen/core/Tensor.h>

#include "trainer/sharding/shard_spec.h"

namespace nnstrain::sharding {

struct StateTensor {
  ShardSpec spec;
  at::Tensor tensor;  // the local piece, numel() == spec.numel()
};

}  // namespace nnstrain::sharding
