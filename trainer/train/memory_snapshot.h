// `memory_snapshot: true` (CUDA): the caching allocator records its history
// (every allocation and free, with C++ stacks) from before the first device
// allocation of the run; a snapshot in
// the pickle format PyTorch's memory viz reads (https://pytorch.org/memory_viz)
// is written after step `memory_snapshot_step` and, from the allocator's
// out-of-memory callback, at the moment an allocation fails.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace nnstrain::train {

class MemorySnapshots {
 public:
  // Starts recording. Throws config::ConfigError in a build without CUDA.
  MemorySnapshots(const std::string& dir, int rank);
  ~MemorySnapshots();
  // The step after which a snapshot is written (0, the default: none).
  void set_step(int64_t at_step);

  void after_step(int64_t step);
  // Where the out-of-memory snapshot went ("" if none was written).
  std::string oom_snapshot() const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the allocator's callback, which outlives this
};

}  // namespace nnstrain::train
