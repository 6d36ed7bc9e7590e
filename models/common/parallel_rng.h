// Megatron's model-parallel RNG. Dropout in tensor-parallel sharded regions
// (this rank's attention heads) must draw masks of its own on every TP rank;
// dropout in replicated regions must draw the same masks on every rank of the
// group. The default generators are seeded alike across a TP group (replicated
// regions); a ParallelRng holds a second state per device, seeded from (seed,
// dp rank, tp rank), which fork() swaps into the device's default generator
// for the length of a sharded region (kernels such as fused attention draw from
// the default generator and take none as an argument).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>

namespace nnstrain::models::common {

class ParallelRng {
 public:
  explicit ParallelRng(uint64_t seed) : seed_(seed) {}

  // While alive, the default generator of `device` draws from this rank's state.
  class Fork {
   public:
    Fork() = default;
    Fork(ParallelRng* rng, const c10::Device& device);
    Fork(Fork&& o) noexcept : rng_(o.rng_), device_(o.device_), saved_(std::move(o.saved_)) { o.rng_ = nullptr; }
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;
    Fork& operator=(Fork&&) = delete;
    ~Fork();

   private:
    ParallelRng* rng_ = nullptr;
    c10::Device device_{c10::kCPU};
    at::Tensor saved_;
  };
  Fork fork(const c10::Device& device) { return Fork(this, device); }

  // The states by device name ("cpu", "cuda:0"): for checkpoints and recompute.
  const std::map<std::string, at::Tensor>& states() const { return states_; }
  void set_states(const std::map<std::string, at::Tensor>& s) { states_ = s; }
  // The state of `device` (created from the seed on first use).
  at::Tensor state(const c10::Device& device);
  void set_state(const c10::Device& device, const at::Tensor& state) { states_[device.str()] = state.clone(); }

 private:
  uint64_t seed_;
  std::map<std::string, at::Tensor> states_;
};

// The seed of a rank's sharded-region generator: distinct per (dp rank, tp rank).
uint64_t parallel_rng_seed(uint64_t seed, int64_t dp_rank, int64_t tp_rank);

}  // namespace nnstrain::models::common
