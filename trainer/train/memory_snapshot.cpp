#include "trainer/train/memory_snapshot.h"

#include <filesystem>
#include <fstream>
#include <mutex>

#include "base/config/arg_map.h"
#include "base/log.h"

#ifdef NNSTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace nnstrain::train {

struct MemorySnapshots::State {
  std::string dir;
  int rank = 0;
  int64_t at_step = 0;
  std::mutex mu;
  std::string oom_path;

  std::string path(const std::string& what) const {
    return (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + "_" + what + ".pickle")).string();
  }
  // Writes the allocator's snapshot (torch.cuda.memory._snapshot()'s pickle) to `file`.
  void dump(const std::string& file) const {
#ifdef NNSTRAIN_CUDA
    const std::string bytes = torch::cuda::_memory_snapshot_pickled();
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write memory snapshot " + file);
#endif
  }
};

MemorySnapshots::MemorySnapshots(const std::string& dir, int rank) : state_(std::make_shared<State>()) {
#ifndef NNSTRAIN_CUDA
  throw config::ConfigError("memory_snapshot: true needs nnstrain built with CUDA (NNSTRAIN_WITH_CUDA=ON)");
#else
  state_->dir = dir;
  state_->rank = rank;
  std::filesystem::create_directories(dir);
  // Allocations and frees with their C++ stacks, the last 100k kept (as PyTorch's docs suggest).
  // (Typed arguments: a bare "all" would pick the older overload that takes a bool.)
  const std::optional<std::string> all = "all";
  torch::cuda::_record_memory_history(all, all, std::string("all"), size_t{100000});
  std::weak_ptr<State> weak = state_;
  c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
      [weak](int64_t device, size_t allocated, size_t total, size_t free) {
        auto s = weak.lock();
        if (!s) return;
        std::lock_guard<std::mutex> lock(s->mu);
        if (!s->oom_path.empty()) return;  // the first failure is the one to look at
        s->oom_path = s->path("oom");
        try {
          s->dump(s->oom_path);
        } catch (const std::exception& e) {
          log::error(e.what());
          s->oom_path.clear();
        }
      });
#endif
}

MemorySnapshots::~MemorySnapshots() {
#ifdef NNSTRAIN_CUDA
  try {
    torch::cuda::_record_memory_history(std::optional<std::string>());  // stop recording
  } catch (...) {
  }
#endif
}

void MemorySnapshots::set_step(int64_t at_step) { state_->at_step = at_step; }

void MemorySnapshots::after_step(int64_t step) {
  if (step != state_->at_step) return;
  const auto file = state_->path("step" + std::to_string(step));
  state_->dump(file);
  log::info("memory snapshot written to " + file + " (open it in https://pytorch.org/memory_viz)");
}

std::string MemorySnapshots::oom_snapshot() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->oom_path;
}

}  // namespace nnstrain::train
