// ZeRO-3's parameter units at run time: each unit (the parameters before the
// blocks, each block's, those after) keeps only this rank's chunk between uses
// and is all-gathered, in the compute dtype, into its flat buffer when a forward
// or backward needs it (TrainingState's stage 3).
//
//   forward   begin_forward gathers the outer units, which stay gathered
//             through forward and backward; block i's unit is gathered before
//             the block runs (the next `prefetch` blocks' gathers issued ahead),
//             and freed after it;
//   backward  a node on block i's output gathers the unit again before the
//             block's backward (prefetching blocks i-1, ...); once the unit's
//             gradients are all in, the reducer reduce-scatters them and the
//             unit is freed (reduced()).
// Evaluation runs the same forward with no backward; release_all frees what is left.
// Under parameter offload a unit's chunk lives on the host and is copied to the
// device as its gather is issued (so `prefetch` units ahead of the block).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <utility>
#include <vector>

#include "models/common/block_runner.h"
#include "models/model.h"
#include "trainer/dist/process_groups.h"
#include "trainer/state/training_state.h"

namespace nnstrain::parallel {

// parameter_units (each parameter's unit) is declared in training_state.h: the planner uses it too.

// The group a bucket's ZeRO chunks are cut over: under expert parallelism an
// expert bucket's is Runtime::ezero (the ranks of my ZeRO group holding the same experts), else Runtime::zero.
dist::Group& zero_group_of(const FlatLayout::Bucket& bucket, dist::Runtime& rt);

class ParameterUnits : public models::common::BlockHooks {
 public:
  // blocks: the model's block count (units 1..blocks); rt may be null (one process).
  ParameterUnits(TrainingState& state, dist::Runtime* rt, int blocks, int prefetch);

  torch::Tensor before(size_t block, const torch::Tensor& x) override;
  torch::Tensor after(size_t block, const torch::Tensor& y) override;

  void begin_forward();
  void pre_backward(size_t block);
  // By bucket (pipeline parallelism gathers a stage's units once per step):
  // issue the all-gather (wait: and wait for it), and free.
  void gather_bucket(size_t bucket, bool wait);
  void free_bucket(size_t bucket) { free(bucket); }
  // Bucket b's gradients are reduced or on their way: its parameters are not needed again.
  void reduced(size_t bucket);
  void release_all();
  // Bytes all-gathered so far (this rank's received buffers), for the step's communication count.
  int64_t gathered_bytes() const { return gathered_bytes_; }

  // LoRA's frozen base (buffers, no gradient): each unit's frozen tensors
  // (unit as in parameter_units) become views of one byte buffer per unit that
  // exists only while gathered, like a parameter unit's, and this rank keeps
  // 1/zsize of it between uses. Gathered with the unit's parameters, freed
  // after the block's forward and once backward has left the block; never
  // reduced. Call once, before the first forward; a no-op without a ZeRO group.
  void shard_frozen(const std::vector<std::pair<int, at::Tensor>>& tensors);
  // This rank's resident bytes of the sharded frozen base, and the whole of it (0, 0: none sharded).
  int64_t frozen_held_bytes() const { return frozen_held_; }
  int64_t frozen_whole_bytes() const { return frozen_whole_; }

 private:
  void gather(int unit, bool wait);
  void free(size_t bucket);
  void gather_frozen(int unit, bool wait);
  void free_frozen(int unit);
  dist::Group& group(size_t bucket) const;  // the bucket's ZeRO group (zero_group_of)
  bool communicates(size_t bucket) const;

  struct Slot {
    c10::intrusive_ptr<c10d::Work> work;  // a gather in flight
    at::Tensor input;                     // what it reads (parameter offload: a device copy of the host chunk)
    bool ready = false;                   // gathered and waited for
  };
  TrainingState& state_;
  dist::Runtime* rt_;
  int blocks_, prefetch_;
  bool backward_ = false;
  std::vector<Slot> slots_;  // per bucket
  struct FrozenUnit {
    at::Tensor full;   // uint8, padded to a multiple of the group's size; storage only while gathered
    at::Tensor chunk;  // this rank's share, kept
    Slot slot;
  };
  std::vector<FrozenUnit> frozen_;  // per unit (empty: the base is not sharded)
  int64_t frozen_held_ = 0, frozen_whole_ = 0;
  int64_t gathered_bytes_ = 0;
};

}  // namespace nnstrain::parallel
