// The random number generators' state as checkpoint tensors, per rank: the CPU
// generator and, when the rank trains on CUDA, every visible CUDA device's
// generator. Restoring them makes dropout continue exactly where it stopped.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

#include "trainer/checkpoint/checkpoint.h"

namespace nnstrain::checkpoint {

// A generator state kept outside LibTorch's default generators (the
// model-parallel RNG of tensor-parallel sharded regions), as "rng/<name>/rank<r>".
struct ExtraRngState {
  std::string name;
  at::Tensor state;  // uint8, as Generator::get_state gives it
};

// "rng/cpu/rank<r>", and "rng/cuda<i>/rank<r>" for each CUDA device i when
// `device` is CUDA, then the extra ones; uint8 tensors replicated nowhere else
// (replica_ranks {r}).
std::vector<StateTensor> rng_state_tensors(int rank, c10::Device device, const std::vector<ExtraRngState>& extra = {});

// Sets every generator whose state `ck` holds for `rank`, and replaces the
// state of each entry of `extra` that `ck` holds. Generators it lacks (an older
// checkpoint with only the CPU state, or one saved on CPU resumed on CUDA, or
// without a tensor-parallel state) keep their seeded state; returns the names restored.
std::vector<std::string> restore_rng_state(const Checkpoint& ck, int rank, c10::Device device,
                                           std::vector<ExtraRngState>* extra = nullptr);

}  // namespace nnstrain::checkpoint
