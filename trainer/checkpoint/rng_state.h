// The random number generators' state as checkpoint tensors, per rank: the CPU
// generator and, when the rank trains on CUDA, every visible CUDA device's
// generator. Restoring them makes dropout continue exactly where it stopped.
#pragma once

#include <c10/core/Device.h>

#include <vector>

#include "trainer/checkpoint/checkpoint.h"

namespace nnstrain::checkpoint {

// "rng/cpu/rank<r>", and "rng/cuda<i>/rank<r>" for each CUDA device i when
// `device` is CUDA; uint8 tensors replicated nowhere else (replica_ranks {r}).
std::vector<StateTensor> rng_state_tensors(int rank, c10::Device device);

// Sets every generator whose state `ck` holds for `rank`. Generators it lacks
// (an older checkpoint with only the CPU state, or one saved on CPU resumed on
// CUDA) keep their seeded state; returns the names restored.
std::vector<std::string> restore_rng_state(const Checkpoint& ck, int rank, c10::Device device);

}  // namespace nnstrain::checkpoint
