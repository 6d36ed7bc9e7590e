// Start-up: the steps that take a config to a running Trainer, in order:
//   start_rank -> describe_model (on meta) -> decide_plan (agreed by every rank)
//   -> open_data -> connect (process groups) -> materialise_model (this rank's
//   shards) -> make_trainable (training state, optimizer) -> resume
// (train_loop in trainer.cpp runs them). Each is a function of what came before.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/token_bin.h"
#include "models/common/parallel_rng.h"
#include "trainer/train/moe_monitor.h"
#include "models/model.h"
#include "trainer/checkpoint/checkpoint.h"
#include "base/config/trainer_args.h"
#include "trainer/dist/dist_env.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/optimizer.h"
#include "trainer/optim/precision.h"
#include "trainer/state/grad_reducer.h"
#include "trainer/pipeline/runtime.h"
#include "trainer/plan/plan.h"
#include "trainer/plan/planner.h"
#include "trainer/state/training_state.h"
#include "trainer/train/trainer.h"

namespace nnstrain::train {

// What a run trains and checkpoints: the training state (weights, fp32 masters
// under *-mixed), its gradient reducer, AdamW and the loss scaler.
struct Trainable {
  std::unique_ptr<parallel::TrainingState> state;
  std::unique_ptr<parallel::GradientReducer> reducer;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::optional<optim::LossScaler> scaler;
  std::shared_ptr<models::common::ParallelRng> tp_rng;  // sharded-region dropout (tp > 1)
  int world = 1;
  // Delayed update (compute_config.offload.delayed_update): the host step
  // runs in the background until the next step's backward is done.
  bool delayed_update = false;
  std::future<void> pending_update;
  // Pipeline parallelism (pp > 1): runs each step's forward and backward,
  // built with pipeline_plan (schedule, stages, micro-batches).
  std::unique_ptr<parallel::PipelineExecutor> pipeline;
  parallel::PipelinePlan pipeline_plan;
  // Mixture-of-Experts layers' statistics and selection biases (a no-op for dense models).
  std::unique_ptr<MoeMonitor> moe;
  std::vector<int> moe_holders;  // the ranks holding this rank's layers (its pipeline stage's)

  // Everything a checkpoint holds of it, as ShardSpec'd pieces.
  std::vector<sharding::StateTensor> state_tensors();
  // The compute copy from what the optimizer updated (or a checkpoint loaded):
  // masters cast, ZeRO chunks gathered.
  void after_optimizer_step();
  // One AdamW step and after_optimizer_step; under offload the host's buckets
  // one at a time, each copied back while the next steps.
  void optimizer_step(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device);
  // After a checkpoint load: the offloaded host weights and the compute copy agree with what was loaded.
  void after_load();
  // After backward, before the gradient norm (delayed update): the previous
  // step's host update finished and on the device, this step's gradients
  // where the optimizer reads them. A no-op otherwise.
  void before_norm();
  // Delayed update: the pending host step finished and on the device (before
  // a save, an evaluation, the end); a no-op when nothing is pending.
  void flush();
  // Bytes this rank holds, by part, measured from its tensors' storage (a
  // ZeRO-3 unit counts only while gathered), in all and per parameter element.
  parallel::StateBytes held_bytes();
  parallel::StateBytes held_bytes_per_param();
  // Every random generator's state (the default ones and tp_rng), for checkpoints.
  std::vector<sharding::StateTensor> rng_state_tensors(int rank, const torch::Device& device);
  void restore_rng_state(const checkpoint::Checkpoint& ck, int rank, const torch::Device& device);
};

// This rank's log files and device (bound before any CUDA work).
torch::Device start_rank(const config::TrainerArgs& args, const dist::DistEnv& env);

// The whole model on the meta device (shapes, no storage): what the planner splits.
std::shared_ptr<models::CausalLM> describe_model(const config::TrainerArgs& args);

// The plan (tensor-parallel degree, ZeRO, recompute per layer), agreed by every
// rank at the rendezvous store before any collective (plan_agreement.h).
struct Agreed {
  parallel::Plan plan;
  parallel::DeviceSpec device;            // what the cost model assumed (MFU's peak)
  c10::intrusive_ptr<c10d::Store> store;  // null for one process
};
Agreed decide_plan(const config::TrainerArgs& args, const dist::DistEnv& env, const models::CausalLM& model,
                   const torch::Device& device, std::chrono::milliseconds timeout);

// The token files or indexed datasets, checked against the model (and sequence
// parallelism's split over tp ranks), and the run's length in steps.
struct Data {
  std::unique_ptr<data::Dataset> train, val;
  int64_t seq_len = 0, steps_per_epoch = 1, max_steps = 0;
};
Data open_data(const config::TrainerArgs& args, const models::CausalLM& model, const parallel::Plan& plan);

// Process groups for the plan (null for one process, except under ZeRO-2/3).
std::unique_ptr<dist::Runtime> connect(const config::TrainerArgs& args, const dist::DistEnv& env, const Agreed& a,
                                       const torch::Device& device, std::chrono::milliseconds timeout);

// This rank's piece of the model, built on meta and materialised on the
// device: Hugging Face weights (only its slices read), or the fresh
// initialisation, slice for slice that of one process with the same seed.
// Under tp > 1 the vocabulary (`vocab`, the whole model's) is padded as
// model.make_vocab_size_divisible_by says, and sharded regions get their own RNG.
// Under ZeRO-3 the parameters are materialised one at a time, each leaving only
// this rank's chunks (initial_chunks) and no storage of its own.
struct LocalModel {
  std::shared_ptr<models::CausalLM> model;
  std::shared_ptr<models::common::ParallelRng> tp_rng;  // null at tp 1
  at::Tensor initial_chunks;                            // ZeRO-3 only
};
LocalModel materialise_model(const config::TrainerArgs& args, const parallel::Plan& plan, dist::Runtime* rt,
                             const torch::Device& device, int64_t vocab);

// The model set up for training (the plan's recompute, the loss), and the
// training state over this rank's pieces in the precision's dtypes.
Trainable make_trainable(const config::TrainerArgs& args, const parallel::Plan& plan, const LocalModel& local,
                         dist::Runtime* rt, const dist::DistEnv& env, const torch::Device& device);

// Loads the checkpoint --resume (or checkpoint.resume_from) names into the
// state; returns its folder ("" for a fresh start) and sets *step. A changed
// lr schedule is checked against the lr the checkpoint's last step used (`data`
// gives the run's length): a WSD decay that would have begun before the
// checkpoint's step is refused, another jump in the lr warned about.
std::string resume(const config::TrainerArgs& args, const RunOptions& opts, Trainable& tr, const Data& data, int rank,
                   const torch::Device& device, int64_t* step);

}  // namespace nnstrain::train
