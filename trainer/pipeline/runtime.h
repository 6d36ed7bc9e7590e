// Pipeline parallelism at run time (docs/parallelism.md, "Pipeline
// parallelism"). Each pipeline rank holds its stages' pieces of the model
// (CausalLM::hold_only: the first stage the embedding, the last the final norm,
// the head and the loss, the rest on meta) and runs its row of the lowered
// schedule (pipeline_schedule.h), identical on every rank:
//   F  receive the activation (or embed the tokens), run the stage's blocks,
//      and send the output on (the last stage: the loss, scaled by 1/nmicros);
//   B  receive the output's gradient, backward, send the input's gradient back;
//   I  the backward, sent back at once, but for the linears' weight gradients:
//      each leaves its input and output gradient (models/common/weight_grad.h);
//   W  those weight gradients only (dW = dY^T X per linear), no chain re-run.
// Transfers go over the pipeline group in coalesced groups the lowering
// places (pipeline::lower) so that they hold under NCCL's point-to-point rules
// (no tags, first in first out per rank pair, a send blocked until its receive
// is posted unless both are in flight together); a stage's neighbour on the
// same rank (V schedules, virtual stages) gets its tensors handed over
// directly. A group is posted at its place in the row and waited on before the
// action that consumes one of its receives (pipeline::group_waits), which also
// completes, and drops the sent tensors of, every group before it; the last
// ones wait for the step's end. A failed or timed-out wait prints this rank's
// action grid with the action waited on marked.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trainer/pipeline/schedule.h"
#include "trainer/pipeline/stages.h"
#include "trainer/plan/plan.h"
#include "trainer/state/training_state.h"

namespace nnstrain::models {
class CausalLM;
}
namespace nnstrain::dist {
class Runtime;
}
namespace nnstrain::data {
struct Batch;
}

namespace nnstrain::parallel {

class GradientReducer;

// The pipeline rank of a global rank under the layout [TP, CP, PP, DP].
int pipeline_rank_of(int rank, int tp, int cp, int pp);

// The dry run of `plan`'s transfers under NCCL's point-to-point rules
// (pipeline::check_backend_rules): the training step's lists (with the tied
// embedding's exchange when `tied`, and post-validation's prefixes when
// `post_validation`) and evaluation's. Throws pipeline::BackendRuleError.
void check_transfers(const PipelinePlan& plan, bool tied, bool post_validation);

// Makes `model` hold only what pipeline rank `pp_rank`'s stages need; call
// before materialising it.
void hold_stages(models::CausalLM& model, const PipelinePlan& plan, int pp_rank);

// Under pp > 1: each shard's replicas are the ranks whose stages hold it (a
// tied embedding: the first and the last stage's), and a piece held by several
// pipeline ranks counts once in the norm. `shards` from tensor_parallel_shards.
void pipeline_replicas(std::vector<ParamShard>& shards, models::CausalLM& model, const PipelinePlan& plan,
                       dist::Runtime& rt, int world);

// ZeRO 2 and 3 under pp: TrainingStateOptions::units for the parameters this
// rank holds (after hold_stages), so that no bucket spans two stages and a
// tied parameter (the head's use of the embedding) is a bucket of its own,
// chunked alike on the first and the last stage's ranks. ZeRO-3: a unit per
// block as parameter_units; ZeRO-2: one per stage, the bucket cap cutting it.
std::vector<int> pipeline_units(const models::CausalLM& model, const PipelinePlan& plan, int pp_rank, int zero_stage);

class PipelineExecutor {
 public:
  struct Options {
    c10::Device device = c10::Device(c10::kCPU);
    c10::ScalarType activation_dtype = c10::ScalarType::Float;  // the compute dtype
    int64_t hidden = 0;                                         // the blocks' width
    int64_t sequence_divisor = 1;  // activation tokens: the batch's (under cp its slice) / this (SP: tp)
    bool split_backward = true;    // I and W as two passes (false: I runs the whole backward, W nothing)
    bool post_validation = false;  // pas_config.pipeline_post_validation: start_step may run the prefix
  };
  // `state`: this rank's training state (the tied parameters' gradients are
  // summed between the first and last stage from it). `reducer`: under ZeRO 2
  // and 3 it follows the schedule (grad_reducer.h): each stage's backward of a
  // micro-batch reduce-scatters that stage's buckets; ZeRO-3 gathers every
  // unit of this rank's stages once per step, issued at the step's start and
  // waited for before the stage's first F, and frees it after the last action
  // of the step that uses it (its stage's last B or W), so a stage's whole
  // parameters live through the step's compute.
  PipelineExecutor(models::CausalLM& model, const PipelinePlan& plan, dist::Runtime& rt, TrainingState& state,
                   GradientReducer& reducer, const Options& opts);
  ~PipelineExecutor();

  // Forward and backward of one step's nmicros micro-batches, as the schedule
  // orders them. The loss is token-weighted as the trainer's own loop weighs
  // it: micro-batch j's mean times `weights[j]` (its share of the step's
  // counted targets over dp x cp; the reducer sums over those ranks).
  // `loss_scale` (undefined: none) multiplies what backward starts from (the
  // fp16 loss scaler), `poison` makes the loss non-finite (test switch).
  // `phase(backward)` is told when the work turns from forward to backward and
  // back. The step is run in parts, for optimizer post-validation
  // (docs/parallelism.md): start_step sets it up and, with `prefix`, runs this
  // rank's leading forwards (pipeline::post_validation_prefix) while the
  // previous step's optimizer step is still being validated; redo_prefix drops
  // what they made (activations, loss, their sends, all delivered by then) and
  // runs them again on the weights a rollback restored; finish_step runs the
  // rest, sums the tied gradients and returns this rank's share of the step's
  // loss on the rank holding the last stage, 0 elsewhere. `micro_batches` must
  // outlive the step.
  void start_step(const std::vector<data::Batch>& micro_batches, const at::Tensor& weights,
                  const at::Tensor& loss_scale, bool poison, const std::function<void(bool backward)>& phase,
                  bool prefix);
  void redo_prefix();
  at::Tensor finish_step();
  size_t prefix_length() const;  // actions of this rank's lowered row the prefix holds

  // Forward only, stage after stage (evaluation): the batch's loss on the
  // rank holding the last stage, 0 elsewhere.
  at::Tensor eval_loss(const data::Batch& batch);
  // The same forward with `head` in place of the loss: it gets the last
  // block's output on the last stage and its result is returned on the rank
  // holding that stage (undefined elsewhere; the caller brings it to the
  // other ranks). Downstream-task evaluation (trainer/eval/): a few numbers a
  // request instead of the logits.
  at::Tensor eval_forward(const data::Batch& batch, const std::function<at::Tensor(const at::Tensor& hidden)>& head);
  // Called on the last stage before each micro-batch's head loss, with that
  // micro-batch (preference alignment: its pairs' reference log-probabilities).
  void set_before_head(std::function<void(const data::Batch&)> f);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nnstrain::parallel
