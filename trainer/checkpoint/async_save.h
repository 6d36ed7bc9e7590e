// Checkpoint saving for the training loop, synchronous or asynchronous
// (checkpoint.async_save). Asynchronous: the state is copied into host buffers
// kept between saves — CUDA tensors by copies enqueued on a side stream, CPU
// tensors by the background thread while training runs the next forward and
// backward, which only read the state — and the training loop calls
// state_may_change() before its optimizer step mutates the state. The background
// thread then writes and fsyncs this rank's files, the ranks agree through the
// store (never a collective on the training stream), and rank 0 publishes
// exactly as checkpoint::save does (manifest last, rename, `latest`, prune). At
// most one save is in flight: the next save(), and wait(), block until it is
// published. See docs/checkpoint.md.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trainer/checkpoint/checkpoint.h"

namespace nnstrain::checkpoint {

// The ranks' shared key-value store (c10d's TCPStore in a multi-process run).
struct SaveStore {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::string(const std::string& key)> get;  // waits for the key; throws on timeout
};

struct SaveReport {
  std::string dir;         // the published folder
  int64_t step = 0;
  uint64_t bytes = 0;      // tensor bytes this rank wrote
  double write_s = 0;      // this rank's writing and fsync
  double total_s = 0;      // from save() to published
};

class Saver {
 public:
  // `store` is needed for an asynchronous save with ctx.world_size > 1.
  // `on_published` is called (on the background thread when asynchronous) after each save.
  Saver(SaveOptions opts, SaveContext ctx, bool async, SaveStore store = {},
        std::function<void(const SaveReport&)> on_published = {});
  ~Saver();  // waits for a save in flight; a failure then is reported to stderr, not thrown
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;

  // Synchronous: checkpoint::save. Asynchronous: waits for the previous save
  // (rethrowing its failure), starts the snapshot of `tensors` (any dtype, any
  // device) and returns. `state` is rank 0's trainer state.
  void save(int64_t step, const std::vector<StateTensor>& tensors, const nlohmann::json& state,
            const nlohmann::json& rank_state);
  // Before anything writes to a tensor given to the last save(): blocks until the
  // copy of the CPU tensors is done, and orders the current CUDA stream after the
  // device-to-host copies. Cheap when there is nothing to wait for.
  void state_may_change();
  // Blocks until no save is in flight; throws CheckpointError if the last one failed.
  void wait();
  bool async() const { return async_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool async_;
};

}  // namespace nnstrain::checkpoint
