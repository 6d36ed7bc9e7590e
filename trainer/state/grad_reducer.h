// Gradient reduction over the ranks a parameter is replicated on, dp x cp
// (Runtime::dp_cp; the data-parallel group at cp 1), for a TrainingState. Each
// bucket's reduction is launched from an autograd hook the moment its last
// gradient is accumulated, so communication overlaps the rest of backward.
// The reduction is a sum, not an average: each rank's loss is already weighted
// by its share of the step's targets over dp x cp (trainer.cpp), so no rank's
// 16-bit gradient is scaled up by the replica count before it (docs/precision.md).
//
// By ZeRO stage (training_state.h):
//   0  each bucket all-reduced in place;
//   1  each bucket reduce-scattered over the ZeRO group into this rank's chunk;
//      after the optimizer step the updated chunks are all-gathered back
//      (gather_params);
//   2  as 1, but out of a bucket buffer that lives only until its
//      reduce-scatter is done (at most kBucketsInFlight at once), the chunk
//      added into the rank's gradient shard;
//   3  as 2, each unit's bucket as soon as its backward ends, after which the
//      unit's gathered parameters are freed; parameters are gathered by unit
//      (ParameterUnits) rather than after the step.
// With zero_ngroups > 1 the shard is then all-reduced across ZeRO groups (HSDP).
//
// Offload (training_state.h): on a step's last micro-step each offloaded
// bucket's reduced gradient is handed to the host while backward goes on
// (TrainingState::gradient_final): stages 2 and 3 as its reduce-scatter
// completes, stages 0 and 1 when a later bucket's launch finds its reduction
// done; what is left, and everything under HSDP (whose cross-group all-reduce
// comes after backward), in finish_gradients.
//
// Gradient accumulation: stages 0 and 1 accumulate whole gradients locally and
// communicate only on the final micro-step; stages 2 and 3 keep no whole
// gradient between micro-steps, so they reduce-scatter on every micro-step
// (the cross-group all-reduce still happens once).
//
// Pipeline parallelism, stages 2 and 3 (follow_schedule): the executor's
// actions say when, not begin_micro_step. Each backward of one stage for one
// micro-batch (begin_backward .. end_backward) reduce-scatters that stage's
// buckets as their gradients come in, as a micro-step does, so gradient
// memory stays ZeRO-2's (a few bucket buffers, never a whole gradient) at the
// price of nmicros reduce-scatters per step. Under stage 3 a unit is
// gathered and freed where the executor says (once per step, not per
// micro-batch: gather_buckets, free_buckets), and the block hooks are off.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <optional>
#include <vector>

#include "trainer/dist/process_groups.h"
#include "trainer/state/param_units.h"
#include "trainer/state/training_state.h"

namespace torch::autograd {
struct Node;
}

namespace nnstrain::parallel {

class GradientReducer {
 public:
  static constexpr size_t kBucketsInFlight = 2;

  // Installs the gradient hooks on the state's parameters. rt may be null (one
  // process). ZeRO-3: blocks (the model's count) and the gather prefetch depth.
  GradientReducer(TrainingState& state, dist::Runtime* rt, int blocks = 0, int prefetch = 1);
  ~GradientReducer();

  // Before each micro-step's forward: whether it is the last of the step.
  void begin_micro_step(bool last);
  // After the last backward: waits for every bucket; the gradients are then
  // summed over dp x cp (ZeRO: this rank's chunk of them).
  void finish_gradients();
  // After the optimizer step (or a checkpoint load), stages 1 and 2: every
  // rank's updated chunks all-gathered into the parameters.
  void gather_params();

  // Pipeline parallelism (stages 2, 3; see the top): before the first step.
  void follow_schedule();
  bool follows_schedule() const { return scheduled_; }
  // One stage's backward of one micro-batch, which fills `buckets` (layout
  // order): the reductions still in flight are completed first (their
  // buffers are about to be written), and the buckets reduce as they fill.
  void begin_backward(const std::vector<size_t>& buckets);
  // The rest of those buckets launched (a bucket no gradient reached too).
  void end_backward();
  // Every reduction completed, into this rank's shard (the step's schedule is done).
  void complete_reductions();
  // Stage 3: buckets' units all-gathered (wait: and waited for), and freed.
  void gather_buckets(const std::vector<size_t>& buckets, bool wait);
  void free_buckets(const std::vector<size_t>& buckets);

  // ZeRO-3: what the model calls around its blocks (null below stage 3, and
  // under follow_schedule), and the forward-only path (evaluation): gather
  // before, release after.
  std::shared_ptr<models::common::BlockHooks> block_hooks() const {
    return scheduled_ ? nullptr : units_;
  }
  void begin_forward();
  void release_params();
  // ZeRO-3 (block hooks, not under follow_schedule): LoRA's frozen base sharded
  // with the units (ParameterUnits::shard_frozen); false where it stays whole.
  bool shard_frozen(const std::vector<std::pair<int, at::Tensor>>& tensors) {
    if (!units_ || scheduled_) return false;
    units_->shard_frozen(tensors);
    return units_->frozen_whole_bytes() > 0;
  }
  int64_t frozen_held_bytes() const { return units_ ? units_->frozen_held_bytes() : 0; }
  int64_t frozen_whole_bytes() const { return units_ ? units_->frozen_whole_bytes() : 0; }

  int64_t bucket_count() const { return static_cast<int64_t>(state_.layout().buckets.size()); }
  // Bytes each reduction round sends into its collectives (buffer bytes).
  int64_t reduced_bytes_per_step() const;
  // Bytes this rank has put into (reductions) or received from (gathers)
  // collectives so far, for the per-step communication figure.
  int64_t communicated_bytes() const;
  // Offload: how many offloaded buckets' gradients left for the host while the
  // last step's backward was still running (the rest left after it).
  int64_t offloaded_in_backward() const { return offloaded_in_backward_; }
  // The dtype of the gradients last put into a reduction collective: the
  // reduction as it ran (compute_config.reduce_dtype), for the run's record
  // (trainer/train/active_record.h). Empty until one ran (one process has none).
  std::optional<c10::ScalarType> reduced_dtype() const { return reduced_dtype_; }

 private:
  struct Progress {  // per bucket, during one reducing backward
    int pending = 0;
    bool ready = false, launched = false;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor chunk;  // stages 2, 3: the reduce-scatter's output, added into the shard when done
  };
  void on_grad_ready(size_t param_index);
  void complete_in_flight();     // stages 2, 3
  void launch_ready_in_order();
  void launch(size_t bucket);
  void complete(size_t bucket);  // stages 2, 3
  void drain();                  // every bucket launched and completed
  void hand_over_offloaded();    // offloaded buckets' gradients sent to the host, and waited for
  void poll_offloaded();         // stages 0, 1: those whose reduction completed sent now
  void send_offloaded(size_t b); // bucket b's reduced gradient to the host (if offloaded)
  // Whether the dp, ZeRO and cross-ZeRO groups have anyone to talk to.
  bool dp_live() const { return rt_ && rt_->dp_cp.backend; }
  bool zero_live() const { return rt_ && rt_->zero.backend; }
  bool cross_live() const { return rt_ && rt_->zero_cross.backend; }
  // The group bucket b is reduced over (stage 0) or sharded over (ZeRO): an
  // expert bucket's under expert parallelism is Runtime::edp.
  dist::Group& group_of(size_t bucket) const;

  TrainingState& state_;
  dist::Runtime* rt_;
  int dp_ = 1;
  int stage_ = 0;
  bool reducing_ = false;  // this micro-step's backward reduces
  bool last_ = false;      // this micro-step is the step's last
  bool in_backward_ = false;
  int64_t offloaded_in_backward_ = 0;
  std::vector<Progress> progress_;
  std::vector<size_t> order_;  // the buckets this backward launches, in launch order
  size_t next_launch_ = 0;     // into order_
  bool scheduled_ = false;     // follow_schedule
  std::vector<size_t> in_flight_;  // stages 2, 3: launched, not completed, in order
  bool accumulated_ = false;       // stages 2, 3: a micro-step of this step already reduced into the shard
  std::shared_ptr<ParameterUnits> units_;
  int64_t sent_bytes_ = 0;
  std::optional<c10::ScalarType> reduced_dtype_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
};

}  // namespace nnstrain::parallel
