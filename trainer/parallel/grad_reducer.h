// Gradient reduction over the data-parallel group, for a TrainingState. Each
// bucket's reduction is launched from an autograd hook the moment its last
// gradient is accumulated, so communication overlaps the rest of backward, and
// only on the final micro-step of gradient accumulation (the others accumulate
// locally: nothing is sent).
//
// Two strategies, by the state's layout: without ZeRO a bucket is all-reduced in
// place; with ZeRO-1 it is reduce-scattered over the ZeRO group into this rank's
// chunk (then all-reduced across ZeRO groups when zero_ngroups > 1), and after
// the optimizer step the updated chunks are all-gathered back (gather_params).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <vector>

#include "trainer/dist/process_groups.h"
#include "trainer/parallel/training_state.h"

namespace torch::autograd {
struct Node;
}

namespace nnstrain::parallel {

class GradientReducer {
 public:
  // Installs the gradient hooks on the state's parameters. rt may be null (one process).
  GradientReducer(TrainingState& state, dist::Runtime* rt);
  ~GradientReducer();

  // Before each micro-step's backward: reduce gradients this time or not.
  void begin_micro_step(bool sync);
  // After the last backward: waits for every bucket; the reduced gradients are
  // then averaged over dp (ZeRO: this rank's chunk of them).
  void finish_gradients();
  // After the optimizer step (or a checkpoint load): under ZeRO every rank's
  // updated chunks all-gathered into the compute copy; otherwise nothing.
  void gather_params();

  int64_t bucket_count() const { return static_cast<int64_t>(state_.layout().buckets.size()); }
  // Bytes each step sends into reductions (buffer bytes per collective).
  int64_t reduced_bytes_per_step() const;

 private:
  struct Progress {  // per bucket, during one synchronising backward
    int pending = 0;
    bool ready = false;
    c10::intrusive_ptr<c10d::Work> work;
  };
  void on_grad_ready(size_t param_index);
  void launch_ready_in_order();
  void launch(size_t bucket);

  TrainingState& state_;
  dist::Runtime* rt_;
  int dp_ = 1;
  bool zero_ = false;
  bool sync_ = false;
  std::vector<Progress> progress_;
  size_t next_launch_ = 0;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
};

}  // namespace nnstrain::parallel
