#include "models/common/parallel_rng.h"

#include <ATen/Context.h>

#include <mutex>

#include "base/hash.h"

namespace nnstrain::models::common {

using base::splitmix64;

uint64_t parallel_rng_seed(uint64_t seed, int64_t dp_rank, int64_t tp_rank) {
  // Megatron offsets its tensor-parallel seed by 2718 + tp rank; mixed here so
  // neighbouring seeds of different runs do not share streams.
  return splitmix64(seed + 2718) ^ splitmix64((static_cast<uint64_t>(dp_rank) << 32) + static_cast<uint64_t>(tp_rank));
}

at::Tensor ParallelRng::state(const c10::Device& device) {
  auto it = states_.find(device.str());
  if (it != states_.end()) return it->second;
  // A fresh state of this device's generator type: seed the default one, read
  // its state, put the default one back.
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const auto saved = gen.get_state();
  gen.set_current_seed(seed_);
  auto fresh = gen.get_state();
  gen.set_state(saved);
  return states_[device.str()] = fresh;
}

ParallelRng::Fork::Fork(ParallelRng* rng, const c10::Device& device) : rng_(rng), device_(device) {
  const auto own = rng_->state(device_);
  auto gen = at::globalContext().defaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  saved_ = gen.get_state();
  gen.set_state(own);
}

ParallelRng::Fork::~Fork() {
  if (!rng_) return;
  auto gen = at::globalContext().defaultGenerator(device_);
  std::lock_guard<std::mutex> lock(gen.mutex());
  rng_->states_[device_.str()] = gen.get_state();
  gen.set_state(saved_);
}

}  // namespace nnstrain::models::common
