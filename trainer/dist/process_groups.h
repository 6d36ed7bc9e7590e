// The distributed runtime of one training process: rendezvous through c10d's
// TCPStore, the world / data-parallel / tensor-parallel groups (tensor-parallel
// ranks innermost, so a TP group stays within a node), collectives that fail
// loudly naming the collective and the ranks that stopped answering, and a CPU
// control group for decisions every rank must agree on (stop, skip).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "trainer/dist/dist_env.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::dist {

// A collective failed or timed out; what() names it and the ranks missing.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Group {
  std::string name;                          // "world", "dp0", "tp1", ...
  std::vector<int> ranks;                    // global ranks, in group order
  int rank = 0;                              // this process's index in `ranks`
  c10::intrusive_ptr<c10d::Backend> backend; // null when size() == 1
  int size() const { return static_cast<int>(ranks.size()); }
};

struct RuntimeOptions {
  int tp = 1;                                // tensor-parallel degree (plan_ngpus)
  int zero_ngroups = 1;                      // ZeRO shards within dp / zero_ngroups ranks
  std::string backend = "auto";              // auto | nccl | gloo
  bool cuda = false;                         // tensors live on CUDA
  std::chrono::milliseconds timeout{600000};
};

class Runtime {
 public:
  Runtime(const DistEnv& env, const RuntimeOptions& opts);
  ~Runtime();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const std::string& backend_name() const { return backend_name_; }

  Group world, dp, tp;
  Group zero;        // ZeRO shard group: a slice of dp of size dp / zero_ngroups
  Group zero_cross;  // the same shard position in the other ZeRO groups
  Group control;     // CPU (Gloo) over the world, for agreement

  // Collectives. `what` names the operation in error messages. Async ones
  // return a handle; wait() turns a failure into a CollectiveError.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(Group& g, at::Tensor t, const char* what);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_async(Group& g, at::Tensor out, at::Tensor in, const char* what);
  c10::intrusive_ptr<c10d::Work> all_gather_async(Group& g, at::Tensor out, at::Tensor in, const char* what);
  void wait(const c10::intrusive_ptr<c10d::Work>& w, const Group& g, const char* what);
  void all_reduce(Group& g, at::Tensor t, const char* what);   // sum
  void all_reduce_max(Group& g, at::Tensor t, const char* what);
  void barrier(const char* what);
  // true on every rank if `flag` is true on any: the collective stop decision.
  bool any(bool flag, const char* what);

 private:
  Group make_group(const std::string& name, std::vector<int> ranks, bool cpu_only);
  [[noreturn]] void fail(const Group& g, const char* what, const std::string& cause);
  void heartbeat_loop();

  int rank_, world_;
  std::string backend_name_;
  RuntimeOptions opts_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<int64_t> seq_{0};      // collectives entered, published by the heartbeat
  std::atomic<bool> stop_{false};
  std::thread heartbeat_;
};

}  // namespace nnstrain::dist
