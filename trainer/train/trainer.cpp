#include "trainer/train/trainer.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "data/loader.h"
#include "trainer/align/alignment.h"
#include "base/config/arg_map.h"
#include "trainer/checkpoint/async_save.h"
#include "trainer/checkpoint/rng_state.h"
#include "trainer/dist/progress_board.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/lora/converter.h"
#include "models/common/context_attention.h"
#include "trainer/state/clip.h"
#include "trainer/offload/nvme_tier.h"
#include "base/log.h"
#include "models/common/cp_document_layout.h"
#include "trainer/train/active_record.h"
#include "trainer/train/cpu_memory.h"
#include "trainer/train/fault_tolerance.h"
#include "trainer/train/memory_snapshot.h"
#include "trainer/train/metrics.h"
#include "trainer/train/profiler.h"
#include "trainer/train/run_dir.h"
#include "trainer/train/startup.h"
#include "trainer/train/step_graph.h"
#include "trainer/train/step_timer.h"
#include "trainer/train/stop_decision.h"
#include "trainer/train/tensorboard.h"
#include "trainer/eval/in_training.h"

namespace fs = std::filesystem;

namespace nnstrain::train {

namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<int64_t> g_running_step{0};  // the step in progress (0: before training), for error messages
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

std::string fmt(double v, int prec = 4) {
  std::ostringstream o;
  o.precision(prec);
  o << std::fixed << v;
  return o.str();
}

// Test-only switches, VARIABLE=STEP[:RANK] (all ranks without RANK):
// NNSTRAIN_TEST_NONFINITE_AT makes the loss (and so every gradient) of that step
// non-finite; NNSTRAIN_TEST_TORCH_ERROR_AT raises a LibTorch error in it.
bool test_switch_hits(const std::string& at, int64_t step, int rank) {
  if (at.empty()) return false;
  const auto colon = at.find(':');
  if (std::stoll(at.substr(0, colon)) != step) return false;
  return colon == std::string::npos || std::stoi(at.substr(colon + 1)) == rank;
}
std::string test_switch(const char* name) {
  const char* e = std::getenv(name);
  return e ? e : "";
}
// NNSTRAIN_TEST_NONFINITE_DATA_AT=DATA_STEP[:RANK]: the same at the step that reads
// that data step (a rewind that skips it does not meet it again);
// NNSTRAIN_TEST_NONFINITE_ONCE=STEP[:RANK]: the first run of that step only (a
// transient fault: a rerun of the step is finite).
bool inject_nonfinite(int64_t step, int64_t data_step, int rank) {
  static const std::string at = test_switch("NNSTRAIN_TEST_NONFINITE_AT");
  static const std::string data_at = test_switch("NNSTRAIN_TEST_NONFINITE_DATA_AT");
  static const std::string once = test_switch("NNSTRAIN_TEST_NONFINITE_ONCE");
  static bool fired_once = false;
  if (!fired_once && test_switch_hits(once, step, rank)) return fired_once = true;
  return test_switch_hits(at, step, rank) || test_switch_hits(data_at, data_step, rank);
}
bool inject_torch_error(int64_t step, int rank) {
  static const std::string at = test_switch("NNSTRAIN_TEST_TORCH_ERROR_AT");
  return test_switch_hits(at, step, rank);
}
// NNSTRAIN_TEST_KILL_AT=STEP[:RANK]: SIGKILL at the start of that step, in a
// launch's first attempt only (NNSTRAIN_RESTART_COUNT unset): a restart runs on.
// NNSTRAIN_TEST_SLOW_RANK=RANK:MS: that rank's every forward starts MS later (a straggler).
void inject_kill(int64_t step, int rank) {
  static const std::string at = std::getenv("NNSTRAIN_RESTART_COUNT") ? "" : test_switch("NNSTRAIN_TEST_KILL_AT");
  if (test_switch_hits(at, step, rank)) std::raise(SIGKILL);
}
// NNSTRAIN_TEST_STOP_AT=STEP:RANK: SIGSTOP at the start of that step (a rank frozen for good).
void inject_stop(int64_t step, int rank) {
  static const std::string at = test_switch("NNSTRAIN_TEST_STOP_AT");
  if (test_switch_hits(at, step, rank)) std::raise(SIGSTOP);
}
void inject_delay(int rank) {
  static const std::string at = test_switch("NNSTRAIN_TEST_SLOW_RANK");
  if (!at.empty() && std::stoi(at.substr(0, at.find(':'))) == rank)
    std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(at.substr(at.find(':') + 1))));
}
// The step in progress, for error messages and for the launcher's restart decision.
void running_step(int64_t step, int rank) {
  g_running_step.store(step);
  dist::publish_step(step);
  inject_kill(step, rank);
  inject_stop(step, rank);
}

// Context parallelism: this rank's tokens of every sequence of `b` (inputs and
// targets alike) in the plan's layout; the whole batch at cp 1. Under document
// masking the positions are cut too, the segments stay whole: every rank masks
// any block from them (models::Documents), and zigzag is the layout balanced
// for the micro-batch's documents.
data::Batch cp_slice(data::Batch b, const parallel::ContextPlan& c, int cp_rank) {
  if (c.cp == 1) return b;
  const auto layout = models::common::parse_cp_layout(c.load_balance);
  if (b.segments.defined() && layout == models::common::CpLayout::Zigzag) {
    // Packed documents: the layout balanced for this micro-batch (models/common/cp_document_layout.h).
    const auto idx = torch::tensor(models::common::cp_document_layout(b.segments, c.cp)[size_t(cp_rank)], torch::kLong);
    b.x = b.x.index_select(1, idx).contiguous();
    b.y = b.y.index_select(1, idx).contiguous();
    b.positions = b.positions.index_select(1, idx).contiguous();
    return b;
  }
  b.x = models::common::cp_shard(b.x, 1, c.cp, cp_rank, layout).contiguous();
  b.y = models::common::cp_shard(b.y, 1, c.cp, cp_rank, layout).contiguous();
  if (b.positions.defined()) b.positions = models::common::cp_shard(b.positions, 1, c.cp, cp_rank, layout).contiguous();
  return b;
}

// The targets a batch counts in the loss.
at::Tensor target_count(const data::Batch& b) { return b.y.ne(data::kIgnoreTarget).sum(); }

// A batch's contribution to a token-weighted mean: its mean loss x its count,
// 0 (not NaN, and no NaN gradient) when it counts no target.
at::Tensor loss_sum(const at::Tensor& mean, const at::Tensor& count) {
  return torch::where(count.gt(0), mean, torch::zeros_like(mean)) * count.to(mean.scalar_type());
}

// What an out-of-memory message needs, kept outside the loop's scope.
struct OomContext {
  double estimate_bytes = 0;                   // the planner's per-rank total
  std::unique_ptr<MemorySnapshots> snapshots;  // memory_snapshot: true
};

// The training loop: step, evaluate, save and the progress line, over what
// start-up (startup.h) made.
class Trainer {
 public:
  Trainer(const config::TrainerArgs& args, const dist::DistEnv& env, torch::Device device,
          std::shared_ptr<models::CausalLM> model, Agreed agreed, std::unique_ptr<dist::Runtime> rt, Trainable tr,
          Data data, int64_t start_step, const std::string& resumed_from, OomContext& oom,
          std::unique_ptr<align::Alignment> align);
  int run();

 private:
  // The loop's parts (run()).
  void begin_step(int64_t max_steps);
  void replay_step(const std::vector<data::Batch>& batches);
  void after_step(const std::optional<RunCounts>& first_counts, int64_t micro_batches);
  void evaluate_in_training(bool last);
  void make_task_eval();
  void finish(bool stopped_by_signal);
  void step(const std::vector<data::Batch>& batches);
  void optimizer_update(const at::Tensor& norm, double lr);
  void speculate();
  void validate();
  void log_progress();
  void evaluate();
  void save();
  void check_finite();
  void announce(int64_t start_step);
  void make_loader(int64_t start_step);
  void rewind(const Rewind& r);

  const config::TrainerArgs& args_;
  const int rank_, world_;
  const torch::Device device_;
  std::shared_ptr<models::CausalLM> model_;
  const parallel::Plan plan_;
  std::unique_ptr<dist::Runtime> rt_;
  Trainable tr_;
  Data data_;
  std::unique_ptr<align::Alignment> align_;  // alignment: the preference objective and its reference (else null)
  // dp_rank_: this rank's data-parallel index (which samples); cp_rank_ its
  // context-parallel index (which tokens of them).
  const int64_t micro_, global_batch_, accum_, dp_, dp_rank_, cp_rank_;
  const torch::TensorOptions fopts_;
  std::optional<double> peak_flops_;  // MFU only where the device table is meaningful (GPUs)

  std::unique_ptr<JsonlSink> jsonl_;
  std::unique_ptr<TensorBoardSink> tb_;
  bool console_ = false;
  std::unique_ptr<checkpoint::Saver> saver_;
  std::unique_ptr<data::PrefetchLoader> loader_;
  StepTimer timer_;
  StepProfiler profiler_;
  MemorySnapshots* snapshots_ = nullptr;  // owned by the OomContext
  std::unique_ptr<StopDecision> stop_decision_;
  std::unique_ptr<StepGraph> graph_;  // after rt_: destroyed before its communicators (run()'s end)
  std::unique_ptr<ActiveRecord> record_;  // run_dir/active/rank<R>.json: what ran
  std::unique_ptr<eval::InTrainingEval> task_eval_;  // eval: downstream tasks on the live model
  std::unique_ptr<FaultTolerance> ft_;    // fault_tolerance: spikes, rewinds, replica checks, step times
  std::string jsonl_path_;                // rank 0's metrics.jsonl (reopened at a rewind)
  bool timed_ = false;  // this step's time split is measured (step_timer.h)

  // On the device, read only at logging steps and saves (the one host sync).
  at::Tensor loss_sum_, grad_norm_, lr_dev_;
  at::Tensor targets_;  // the last step's counted targets, all ranks (metrics' "targets")
  at::Tensor skipped_, first_bad_, step_dev_;  // non-finite steps: count, first one, step counter
  int64_t step_ = 0;
  double lr_ = 0;
  bool poison_ = false;  // NNSTRAIN_TEST_NONFINITE_AT (eager steps only)
  bool logs_ = false;    // this step measures its activations (logs progress, or is graphed)
  bool logs_step_ = false;  // this step logs progress
  int64_t activation_bytes_ = -1;  // held by the logged step's last forward (-1: not measured)
  int64_t graph_activation_bytes_ = -1;  // the same, measured when the CUDA graph was captured
  std::chrono::steady_clock::time_point interval_start_;
  int64_t interval_steps_ = 0;
  int64_t interval_comm_bytes_ = 0;  // the reducer's count at the interval's start
  int64_t graph_comm_bytes_ = 0;     // what the reducer counted while the step was captured
  int64_t replayed_comm_bytes_ = 0;  // ... times the replays since (the reducer's host code did not run)
  dist::Traffic interval_tp_;        // the tensor-parallel group's at the interval's start (training only)
  dist::Traffic interval_cp_;        // the context-parallel group's, likewise
  dist::Traffic interval_ep_;        // the expert-parallel group's (all-to-alls), likewise

  // Optimizer post-validation (pas_config.pipeline_post_validation,
  // docs/parallelism.md): an ordinary step's optimizer step is taken before
  // the global gradient norm is known, and the next step's leading forwards
  // run while its sum over the pipeline is in flight.
  struct Speculation {
    at::Tensor sq;    // this pipeline rank's norm^2, summed over the pipeline in flight
    at::Tensor stop;  // stop requests (host), summed over the world in flight
    c10::intrusive_ptr<c10d::Work> sq_work, stop_work;
    optim::Optimizer::Backup optimizer;  // what the speculative step changed, as it was
    at::Tensor grads, scale, growth;  // fp16: the gradients (the step unscaled them) and the scaler
    double lr = 0;
    std::vector<at::Tensor> rng;  // generator states before the next step's prefix (dropout)
  };
  const bool post_validation_;
  bool speculate_ = false;      // this step may end speculatively (an ordinary step)
  bool pending_ = false;        // a speculative step awaits validation
  bool stop_pending_ = false;   // the last validation carried a stop request
  Speculation spec_;
  int64_t speculated_ = 0, rolled_back_ = 0;
};

Trainer::Trainer(const config::TrainerArgs& args, const dist::DistEnv& env, torch::Device device,
                 std::shared_ptr<models::CausalLM> model, Agreed agreed, std::unique_ptr<dist::Runtime> rt,
                 Trainable tr, Data data, int64_t start_step, const std::string& resumed_from, OomContext& oom,
                 std::unique_ptr<align::Alignment> align)
    : args_(args),
      rank_(env.rank),
      world_(env.world_size),
      device_(device),
      model_(std::move(model)),
      plan_(std::move(agreed.plan)),
      rt_(std::move(rt)),
      tr_(std::move(tr)),
      data_(std::move(data)),
      micro_(args.micro_batch_size),
      global_batch_(args.global_batch_size),
      accum_(plan_.grad_accumulation_steps),
      dp_(plan_.dp),
      dp_rank_(env.rank / (plan_.tp * plan_.context.cp * plan_.pipeline.pp)),
      cp_rank_(env.rank / plan_.tp % plan_.context.cp),
      fopts_(torch::TensorOptions().device(device).dtype(torch::kFloat32)),
      timer_(device),
      profiler_(args.profile, device, env.rank),
      step_(start_step),
      post_validation_(args.compute_config.pipeline.post_validation && tr_.pipeline != nullptr) {
  align_ = std::move(align);
  if (device.is_cuda()) peak_flops_ = parallel::peak_flops_for(agreed.device, args.precision, args.compute_config.allow_tf32);

  // Logging sinks (rank 0 writes them).
  console_ = args.log.empty();
  for (const auto& s : args.log) {
    if (s.type == "console") console_ = true;
    if (s.type == "jsonl" && rank_ == 0) jsonl_ = std::make_unique<JsonlSink>(jsonl_path_ = s.path, start_step);
    if (s.type == "tensorboard" && rank_ == 0) tb_ = std::make_unique<TensorBoardSink>(s.path, start_step);
  }
  if (args.log.empty() && rank_ == 0)
    jsonl_ = std::make_unique<JsonlSink>(jsonl_path_ = (fs::path(args.run_dir) / "metrics.jsonl").string(), start_step);
  ft_ = std::make_unique<FaultTolerance>(args, rt_.get(), rank_, world_, tr_.pipeline != nullptr, device.str(),
                                         resumed_from, start_step, plan_.zero_stage);
  ft_->set_sink(jsonl_.get());
  if (tr_.pipeline) ft_->set_tied(model_->head_ties());
  ft_->set_save_wait([this] { saver_->wait(); });

  // Checkpoints: ranks agree on a save's outcome by collective (synchronous) or
  // through the store (asynchronous, off the training stream).
  checkpoint::SaveContext ctx{rank_, world_, {}, {}};
  checkpoint::SaveStore store;
  if (rt_) {
    auto* rt_ptr = rt_.get();
    ctx.barrier = [rt_ptr] { rt_ptr->barrier("checkpoint barrier"); };
    ctx.all_ok = [rt_ptr](bool ok) { return !rt_ptr->any(!ok, "checkpoint write status"); };
    auto s = rt_->store();
    store.set = [s](const std::string& k, const std::string& v) { s->set(k, std::vector<uint8_t>(v.begin(), v.end())); };
    store.get = [s](const std::string& k) {
      const auto v = s->get(k);
      return std::string(v.begin(), v.end());
    };
  }
  saver_ = std::make_unique<checkpoint::Saver>(
      checkpoint::SaveOptions{args.checkpoint.save_dir, args.checkpoint.save_type, args.checkpoint.keep_last_n_checkpoints},
      ctx, args.checkpoint.async_save, store, [](const checkpoint::SaveReport& r) {
        log::info("saved checkpoint " + r.dir + " in " + fmt(r.total_s, 2) + " s (this rank wrote " +
                  fmt(r.bytes / 1048576.0, 1) + " MiB in " + fmt(r.write_s, 2) + " s)");
      });

  make_loader(start_step);

  if (oom.snapshots) {  // recording since start-up (train_loop); the step to snapshot is known now
    oom.snapshots->set_step(args.memory_snapshot_step > 0 ? args.memory_snapshot_step : start_step + 1);
    snapshots_ = oom.snapshots.get();
  }
  stop_decision_ = std::make_unique<StopDecision>(rt_.get());

  loss_sum_ = torch::zeros({}, fopts_);
  grad_norm_ = torch::zeros({}, fopts_);
  lr_dev_ = torch::zeros({}, fopts_);
  skipped_ = torch::zeros({1}, fopts_);
  first_bad_ = torch::full({1}, -1.0, fopts_);
  step_dev_ = torch::full({1}, static_cast<double>(start_step), fopts_);

  const auto& graphs = args.compute_config.cuda_graphs;
  if (graphs != "false") {
    GraphFacts f;
    f.built_with_cuda = graphs_built();
    f.cuda = device.is_cuda();
    f.world = world_;
    f.backend = rt_ ? rt_->backend_name() : "";
    f.tp = plan_.tp;
    f.zero_stage = plan_.zero_stage;
    f.recompute = std::count(plan_.recompute.begin(), plan_.recompute.end(), true) > 0;
    f.optimizer_impl = tr_.optimizer->impl();
    f.offload = tr_.state->offloaded() || plan_.offload_params;
    f.cp = plan_.context.cp;
    f.pp = plan_.pipeline.pp;
    f.document_mask = args.dataset.document_mask();
    f.moe = model_->dims().experts > 0;
    const auto blocker = graph_blocker(f);
    if (blocker.empty())
      graph_ = std::make_unique<StepGraph>([this](const std::vector<data::Batch>& b) { step(b); }, /*warmup=*/3);
    else if (graphs == "true")  // refused, never ignored
      throw config::ConfigError("compute_config.cuda_graphs " + blocker);
    else if (device.is_cuda() && rank_ == 0)
      log::info("compute_config.cuda_graphs auto: the step runs eagerly, since a graph " + blocker);
  }
  make_task_eval();
  announce(start_step);
  nlohmann::json startup = startup_record(*model_, rt_.get(), tr_, rank_, world_);
  startup["micro_batches_per_step"] = accum_;
  record_ = std::make_unique<ActiveRecord>(args.run_dir, rank_, std::move(startup));
}

// eval: the tasks scored on this live model under its plan. Requests are dealt
// over the data-parallel replicas (tp ranks of one replica run the same
// batches; logits() gathers the vocabulary; pp ranks run them through their
// stages), unless a forward itself talks
// over dp (ZeRO-3's gathers, MoE's all-to-alls): every rank then scores every
// request, the same forwards in the same order.
void Trainer::make_task_eval() {
  if (!args_.eval.enabled) return;
  if (plan_.context.cp > 1)
    throw config::ConfigError("eval.tasks: in-training evaluation does not run under the plan's context "
                              "parallelism; evaluate a checkpoint with nnstrain eval");
  eval::Backend be;
  be.model = model_.get();
  be.device = device_;
  be.inference_mode = false;
  be.progress = rank_ == 0;
  const bool lockstep = plan_.zero_stage == 3 || plan_.ep > 1;
  if (rt_ && !lockstep && rt_->dp.size() > 1) {
    be.dp_rank = rt_->dp.rank;
    be.dp_size = rt_->dp.size();
    auto* r = rt_.get();
    be.dp_sum = [r](at::Tensor& t) { r->all_reduce(r->dp, t, "eval scores all-reduce"); };
  }
  be.before_forward = [this] { tr_.reducer->begin_forward(); };
  be.after_forwards = [this] { tr_.reducer->release_params(); };
  if (auto* pipe = tr_.pipeline.get()) {
    // Each batch through this rank's stages (the pipeline's evaluation
    // forward); the last stage reduces the logits to a few numbers a request,
    // which reach the other pipeline ranks as zeros summed in: a broadcast
    // from the last stage, exact. Every pp rank runs the same forwards (one
    // replica's ranks are dealt the same requests) and issues this all-reduce
    // after each, in the same order (NCCL's rules).
    auto* r = rt_.get();
    auto* m = model_.get();
    be.staged_forward = [pipe, r, m](const at::Tensor& x, const eval::Backend::Reduce& reduce, const at::Tensor& like) {
      auto got = pipe->eval_forward({x, at::Tensor()}, [&](const at::Tensor& h) { return reduce(m->head_logits(h)); });
      auto t = got.defined() ? got.to(like.scalar_type()).contiguous() : torch::zeros_like(like);
      r->all_reduce(r->pp, t, "eval scores all-reduce (pipeline: from the last stage)");
      return t;
    };
  }
  // decode_logits is whole-model only, and runs the blocks outside ZeRO-3's gathering hooks
  be.kv_cache = plan_.tp == 1 && plan_.zero_stage < 3 && plan_.pipeline.pp == 1;
  be.seq_multiple = plan_.tp > 1 && args_.compute_config.sequence_parallel ? plan_.tp : 1;
  task_eval_ = std::make_unique<eval::InTrainingEval>(args_, std::move(be));
  if (rank_ == 0)
    log::info("eval: " + std::to_string(args_.eval.tasks.size()) + " tasks (" + std::to_string(task_eval_->documents()) +
              " documents) every " + std::to_string(args_.eval.every_n_train_steps) + " steps" +
              (tr_.pipeline ? "; forwards through the " + std::to_string(plan_.pipeline.pp) +
                                  " pipeline ranks' stages, the last stage's scores broadcast"
                            : ""));
}

// Batches for step s, micro-step a on this data-parallel rank: positions
// [(a * dp + dp_rank) * micro, +micro) of the global batch of data step s
// (s itself unless fault_tolerance skipped data), and of them this
// context-parallel rank's tokens.
void Trainer::make_loader(int64_t start_step) {
  loader_.reset();  // its thread stops before the new one starts
  loader_ = std::make_unique<data::PrefetchLoader>(
      [this](int64_t index) {
        const int64_t s = ft_->data_step(index / accum_), a = index % accum_;
        return cp_slice(data_.train->train_batch(s, (a * dp_ + dp_rank_) * micro_, micro_), plan_.context, cp_rank_);
      },
      start_step * accum_, args_.dataloader.prefetch, device_, args_.dataloader.pin_memory);
}

// fault_tolerance went back: every rank loads checkpoint r (as --resume does)
// and the loop continues from its step, its metrics records after it dropped.
void Trainer::rewind(const Rewind& r) {
  tr_.flush();
  saver_->wait();
  int64_t step = 0;
  resume(args_, RunOptions{r.dir}, tr_, data_, rank_, device_, &step);
  step_ = step;
  step_dev_.fill_(static_cast<double>(step));
  skipped_.zero_();
  first_bad_.fill_(-1.0);
  make_loader(step);
  stop_decision_ = std::make_unique<StopDecision>(rt_.get());
  if (jsonl_) {
    jsonl_.reset();
    jsonl_ = std::make_unique<JsonlSink>(jsonl_path_, step);
    ft_->set_sink(jsonl_.get());
  }
  ft_->rewound(r);
  interval_start_ = std::chrono::steady_clock::now();
  interval_steps_ = 0;
}

// The start-up summary (rank 0).
void Trainer::announce(int64_t start_step) {
  if (rank_ != 0) return;
  const auto held = tr_.held_bytes_per_param();
  int64_t nparams = 0;
  for (auto& p : tr_.state->params()) nparams += p.tensor.numel();
  log::info("model " + args_.model.type + ": " + std::to_string(nparams) + " parameters, device " + device_.str() +
            ", world " + std::to_string(world_) + " (dp " + std::to_string(dp_) +
            (plan_.context.cp > 1 ? ", cp " + std::to_string(plan_.context.cp) + " " + plan_.context.comm_type + " " +
                                        plan_.context.load_balance
                                  : "") +
            "), global batch " +
            std::to_string(global_batch_) + " x " + std::to_string(data_.seq_len) + " tokens, steps " +
            std::to_string(start_step) + " -> " + std::to_string(data_.max_steps) + ", optimizer " +
            tr_.optimizer->impl() + (plan_.zero_stage ? " (ZeRO-" + std::to_string(plan_.zero_stage) + ")" : "") + ", plan tp " + std::to_string(plan_.tp) +
            " x dp " + std::to_string(plan_.dp) +
            (plan_.pipeline.pp > 1 ? " x pp " + std::to_string(plan_.pipeline.pp) : std::string()) + ", recompute " +
            std::to_string(std::count(plan_.recompute.begin(), plan_.recompute.end(), true)) + " layers" +
            (rt_ ? ", backend " + rt_->backend_name() + ", " + std::to_string(tr_.reducer->bucket_count()) +
                       " buckets, " + std::to_string(tr_.reducer->reduced_bytes_per_step()) +
                       " gradient bytes reduced per step"
                 : ""));
  log::info("precision " + args_.precision + ": state bytes/param " + fmt(held.total(), 2) + " (param " +
            fmt(held.param, 2) + ", grad " + fmt(held.grad, 2) + ", master " + fmt(held.master, 2) + ", moments " +
            fmt(held.moments, 2) + ")" + (tr_.scaler ? ", dynamic loss scaling" : ""));
  const auto& st = *tr_.state;
  if (st.offloaded()) {
    const auto host = st.host_held_bytes();
    log::info("offload: optimizer state of " + std::to_string(st.host_buckets()) + " of " +
              std::to_string(st.layout().buckets.size()) + " buckets (" + std::to_string(st.host_elements()) + " of " +
              std::to_string(st.optimizer_elements()) + " elements) on the host, stepping on the CPU" +
              (st.options().offload_params ? "; ZeRO-3 parameter chunks on the host" : "") +
              (tr_.delayed_update ? "; delayed update (each step's gradients at weights one update behind)" : "") +
              "; host bytes " +
              std::to_string(int64_t(host.total())) + (device_.is_cuda() ? " pinned" : " (host buffers, not device tensors)"));
    if (auto* nvme = st.nvme())
      log::info("nvme offload: weights and moments" + std::string(st.options().nvme_params ? " and ZeRO-3 parameter chunks" : "") +
                " in " + nvme->store().folder() + " (" + std::to_string(nvme->store().file_bytes()) + " bytes, " +
                (nvme->store().direct_io() ? "O_DIRECT" : "buffered: the filesystem refuses O_DIRECT") + "), through " +
                std::to_string(nvme->slots()) + " slots of host buffer (" + std::to_string(nvme->slot_bytes()) +
                " bytes); I/O engine " + nvme->store().engine() + ": " + nvme->store().engine_why());
  }
}

// One optimizer step on this step's micro-batches, all on the device with no
// host sync: forward/backward per micro-batch (gradients reduced as buckets
// fill), unscale, non-finite check, clip, AdamW, loss scaler. With cuda_graphs
// it is recorded once and replayed (step_graph.h); the learning rate then
// comes from lr_dev_.
void Trainer::step(const std::vector<data::Batch>& batches) {
  // Post-validation: the previous step's gradients stay until it is validated
  // (a rollback redoes its optimizer step from them).
  if (!pending_) tr_.state->zero_grad();
  loss_sum_.zero_();
  // The loss is the mean over every counted target of the step: all micro-batches
  // of every dp x cp rank. Each micro-batch's mean is weighted by its share of
  // the targets and the reducer sums gradients over dp x cp, so any cut of the
  // batch (dp, cp, accumulation, pipeline) gives one process's loss, masked
  // targets included, and an all-masked micro-batch adds 0. No rank's gradient
  // is ever larger than one process's (fp16: no earlier overflow, docs/precision.md).
  // Under alignment a micro-batch weighs its pairs (the loss is the mean over the step's pairs).
  std::vector<at::Tensor> counts;
  for (const auto& b : batches) counts.push_back(align_ ? align_->count(b) : target_count(b));
  if (align_) align_->begin_step();
  auto total = torch::stack(counts).sum();
  if (rt_) rt_->all_reduce(rt_->dp_cp, total, "target count all-reduce");
  targets_ = total;
  const auto inv_total = total.clamp_min(1).to(torch::kFloat32).reciprocal();
  if (tr_.pipeline) {
    // The schedule runs every micro-batch's forward and backward; the gradients
    // are reduced over dp once they are all in (finish_gradients below).
    tr_.reducer->begin_micro_step(false);
    const bool prefix = pending_;
    if (prefix) {  // what the prefix's dropout draws, for a rerun
      spec_.rng = {at::detail::getDefaultCPUGenerator().get_state()};
      if (device_.is_cuda()) spec_.rng.push_back(at::globalContext().defaultGenerator(device_).get_state());
      if (tr_.tp_rng) spec_.rng.push_back(tr_.tp_rng->state(device_));
    }
    tr_.pipeline->start_step(batches, torch::stack(counts).to(torch::kFloat32) * inv_total,
                             tr_.scaler ? tr_.scaler->scale() : at::Tensor(), poison_,
                             [this](bool backward) {
                               timer_.enter(backward ? StepTimer::kBackward : StepTimer::kForward);
                             },
                             prefix);
    if (prefix) {
      validate();
      tr_.state->zero_grad();
    }
    loss_sum_ = tr_.pipeline->finish_step();
    tr_.reducer->begin_micro_step(true);
  }
  for (int64_t a = 0; a < accum_ && !tr_.pipeline; ++a) {
    tr_.reducer->begin_micro_step(a == accum_ - 1);
    timer_.enter(StepTimer::kForward);
    inject_delay(rank_);
    // At logging steps: what the last micro-batch's forward holds for backward.
    const bool measure = logs_ && a == accum_ - 1;
    const int64_t before = measure ? memory_in_use_bytes(device_) : 0;
    const auto& b = batches[a];
    if (align_) align_->before_forward(b);  // the reference's log-probabilities of b's pairs
    auto loss = loss_sum(model_->loss(b.x, b.y, {b.positions, b.segments}), counts[a]) * inv_total;
    if (measure) activation_bytes_ = memory_in_use_bytes(device_) - before;
    if (poison_) loss = loss * std::numeric_limits<double>::infinity();
    loss_sum_ += loss.detach().to(torch::kFloat32);
    timer_.enter(StepTimer::kBackward);
    (tr_.scaler ? loss * tr_.scaler->scale() : loss).backward();
  }
  torch::NoGradGuard no_grad;
  saver_->state_may_change();  // an asynchronous save may still be copying the state
  timer_.enter(StepTimer::kComm);
  tr_.reducer->finish_gradients();
  tr_.moe->after_step(tr_.pipeline ? tr_.pipeline_plan.nmicros : accum_);  // MoE: the load summed over dp x cp, DeepSeek's selection biases updated
  timer_.enter(StepTimer::kOptimizer);
  tr_.before_norm();  // delayed update: the previous host step lands on the device now
  if (speculate_ && !stop_pending_) return speculate();
  optimizer_update(parallel::global_grad_norm(*tr_.state, rt_.get()), lr_);  // the norm identical on every rank
}

// From the global gradient norm on: unscale and clip, AdamW (skipped whole
// where the norm is not finite), the loss scaler, the counters.
void Trainer::optimizer_update(const at::Tensor& norm, double lr) {
  grad_norm_ = norm;
  auto found_inf = torch::isfinite(grad_norm_).logical_not().to(torch::kFloat32).reshape({1});
  at::Tensor coef;
  if (tr_.scaler) {
    const auto inv_scale = tr_.scaler->scale().reciprocal().reshape({});
    grad_norm_ = grad_norm_ * inv_scale;
    coef = inv_scale;
  }
  if (args_.optimizer.clip_gnorm > 0) {
    auto clip = parallel::clip_coefficient(grad_norm_, args_.optimizer.clip_gnorm);
    coef = coef.defined() ? coef * clip : clip;
  }
  if (coef.defined()) tr_.state->scale_gradients(coef);
  // Skipped whole where found_inf; ZeRO-1/2's gather of the updated chunks is inside.
  tr_.optimizer_step(lr, found_inf, graph_ ? lr_dev_ : at::Tensor());
  if (tr_.scaler) tr_.scaler->update(found_inf);
  step_dev_.add_(1);
  first_bad_.copy_(torch::where(found_inf.gt(0) & first_bad_.lt(0), step_dev_, first_bad_));
  skipped_.add_(found_inf);
}

// Post-validation, at the end of an ordinary step: the sum of the norm over
// the pipeline (and of stop requests over the world) leaves asynchronously,
// on groups the next step's transfers do not use; the optimizer's state is
// backed up and the step taken as optimizer_update takes it when the norm is
// finite and not clipped: then the coefficient is the loss scaler's 1 / scale
// (clip 1.0 multiplies by exactly one), found_inf is 0, and the scaler grows.
void Trainer::speculate() {
  auto& s = spec_;
  s.sq = parallel::stage_grad_norm_sq(*tr_.state, rt_.get());
  s.sq_work = rt_->all_reduce_async(rt_->pp_validation, s.sq, "gradient norm all-reduce (pipeline, post-validation)");
  s.stop = torch::full({1}, g_stop_signal.load() != 0 ? 1.0f : 0.0f);
  s.stop_work = rt_->all_reduce_async(rt_->control, s.stop, "stop request (post-validation)");
  tr_.optimizer->back_up(s.optimizer);
  const auto no_inf = torch::zeros({1}, fopts_);
  if (tr_.scaler) {
    auto& g = tr_.state->reduced_grads();
    if (!s.grads.defined()) s.grads = torch::empty_like(g);
    s.grads.copy_(g);
    s.scale = tr_.scaler->scale().clone();
    s.growth = tr_.scaler->growth_tracker().clone();
    tr_.state->scale_gradients(tr_.scaler->scale().reciprocal().reshape({}));
  }
  s.lr = lr_;
  tr_.optimizer_step(lr_, no_inf, at::Tensor());
  if (tr_.scaler) tr_.scaler->update(no_inf);
  pending_ = true;
  ++speculated_;
}

// Post-validation, after the next step's prefix: the speculative step stands
// if the norm is finite and the clip coefficient exactly 1 (every rank sees
// the same sum, so all decide alike); otherwise every rank restores the state,
// takes the step as the synchronous path does, and reruns the prefix from the
// same generator states on the weights that stand.
void Trainer::validate() {
  auto& s = spec_;
  rt_->wait(s.sq_work, rt_->pp_validation, "gradient norm all-reduce (pipeline, post-validation)");
  rt_->wait(s.stop_work, rt_->control, "stop request (post-validation)");
  pending_ = false;
  stop_pending_ = s.stop.item<float>() > 0;
  const auto norm = s.sq.sqrt().reshape({});
  // Unscaled by the scale the step was taken with (s.scale: the scaler has grown since).
  const auto unscaled = tr_.scaler ? norm * s.scale.reciprocal().reshape({}) : norm;
  // The host decides on a rollback: one read of the device per validated step
  // (the norm and the clip coefficient together; float to double is exact).
  const bool clip = args_.optimizer.clip_gnorm > 0;
  const auto coef = clip ? parallel::clip_coefficient(unscaled, args_.optimizer.clip_gnorm).reshape({}) : norm;
  const auto read = torch::stack({norm.to(torch::kFloat64), coef.to(torch::kFloat64)}).cpu();
  const bool finite = std::isfinite(read[0].item<double>());
  const bool clipped = finite && clip && static_cast<float>(read[1].item<double>()) != 1.0f;
  if (finite && !clipped) {
    grad_norm_ = unscaled;
    step_dev_.add_(1);  // the counters as optimizer_update leaves them with found_inf 0
    return;
  }
  ++rolled_back_;
  log::info("step " + std::to_string(step_) + ": optimizer post-validation rolled back (" +
            (finite ? "the gradient norm was clipped" : "the gradient norm was not finite") +
            "): the step redone as without speculation, the next step's " +
            std::to_string(tr_.pipeline->prefix_length()) + " leading actions rerun");
  saver_->state_may_change();
  tr_.optimizer->restore(s.optimizer);
  if (tr_.scaler) {
    tr_.state->reduced_grads().copy_(s.grads);
    tr_.scaler->scale().copy_(s.scale);
    tr_.scaler->growth_tracker().copy_(s.growth);
  }
  optimizer_update(norm, s.lr);
  at::Generator cpu = at::detail::getDefaultCPUGenerator();  // a handle to the default one
  cpu.set_state(s.rng[0]);
  size_t i = 1;
  if (device_.is_cuda()) {
    at::Generator gen = at::globalContext().defaultGenerator(device_);
    gen.set_state(s.rng[i++]);
  }
  if (tr_.tp_rng) tr_.tp_rng->set_state(device_, s.rng[i++]);
  tr_.pipeline->redo_prefix();
}

// Without a loss scaler a non-finite step stops the run at the next logging
// step or save, naming the step (the update itself was skipped on the device).
void Trainer::check_finite() {
  if (tr_.scaler || ft_->handles_nonfinite()) return;
  const double bad = first_bad_.item<double>();
  if (bad >= 0)
    throw std::runtime_error("step " + std::to_string(static_cast<int64_t>(bad)) +
                             ": non-finite loss or gradient norm; the update was skipped and training stops (" +
                             args_.precision + " has no loss scaler); the last checkpoint saved is intact");
}

void Trainer::log_progress() {
  // The logged step's peak tensor bytes, the most any rank held (read before the
  // logging itself allocates).
  // A replayed CUDA graph allocates nothing: its step holds what its capture held.
  const bool replayed = graph_ && graph_->captured();
  std::vector<int64_t> step_peak{replayed ? graph_->capture_peak_bytes() : step_peak_bytes(device_)};
  // Under pp also each pipeline rank's (the most its tp/cp/dp ranks held), in
  // the same max: this rank fills its own slot, the others stay -1.
  const int pp = plan_.pipeline.pp;
  if (pp > 1) {
    step_peak.resize(1 + pp, -1);
    step_peak[1 + rt_->pp.rank] = step_peak[0];
  }
  static_assert(StepTimer::kNumParts == 6, "fault_tolerance reads the step-time split");
  ft_->add_step_times(step_peak, timed_ ? timer_.read() : std::array<double, 6>{}, timed_);  // every rank's step times ride on this maximum
  if (rt_) rt_->host_max(step_peak, "peak tensor bytes");
  if (rt_) {
    if (tr_.pipeline) rt_->all_reduce(rt_->pp, loss_sum_, "loss all-reduce (pipeline: from the last stage)");
    rt_->all_reduce(rt_->dp_cp, loss_sum_, "loss all-reduce");  // each rank's share of the mean
  }
  const double loss = loss_sum_.item<double>();  // the one host sync, at logging steps
  const double gn = grad_norm_.item<double>();
  const auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - interval_start_).count();
  const double ms_per_step = 1000.0 * secs / interval_steps_;
  // A preference sample is a pair: two rows (chosen, rejected) of seq_len tokens, or one packed row.
  const bool two_rows = align_ && !args_.dataset.preference_train.pack;
  const double tokens_per_s = interval_steps_ * global_batch_ * data_.seq_len * (two_rows ? 2 : 1) / secs;
  nlohmann::json rec = {{"step", step_}, {"loss", loss}, {"lr", lr_}, {"grad_norm", gn},
                        {"tokens_per_s", tokens_per_s}, {"ms_per_step", ms_per_step},
                        {"peak_mem_mb", peak_memory_bytes(device_) / 1048576.0},
                        {"skipped_steps", static_cast<int64_t>(skipped_.item<double>())}};
  for (const auto& [name, lr] : tr_.optimizer->other_learning_rates(lr_)) rec[name] = lr;
  ft_->read_step_times(step_peak, rec, step_);
  if (tr_.scaler) rec["loss_scale"] = tr_.scaler->scale().item<double>();
  if (targets_.defined()) rec["targets"] = targets_.item<int64_t>();
  if (step_peak[0] >= 0) rec["peak_tensor_mb"] = step_peak[0] / 1048576.0;
  if (step_peak[0] >= 0 && pp > 1) {
    std::vector<double> per_rank;
    for (int r = 0; r < pp; ++r) per_rank.push_back(step_peak[1 + r] / 1048576.0);
    rec["peak_tensor_mb_per_pp_rank"] = per_rank;
  }
  if (replayed) {
    activation_bytes_ = graph_activation_bytes_;
    rec["graph_pool_mb"] = graph_->pool_bytes() / 1048576.0;
  }
  if (activation_bytes_ >= 0) rec["activation_mb"] = activation_bytes_ / 1048576.0;
  if (rt_) {
    const int64_t comm = tr_.reducer->communicated_bytes() + replayed_comm_bytes_;
    rec["dp_comm_mb_per_step"] = double(comm - interval_comm_bytes_) / interval_steps_ / 1048576.0;
    interval_comm_bytes_ = comm;
  }
  // What tensor (and sequence) and context parallelism sent per training step,
  // counted at the collectives, so a plan that silently ran without them shows zeros.
  auto traffic = [&](const std::string& name, const dist::Traffic& now, dist::Traffic& since) {
    const auto t = now - since;
    const double n = double(interval_steps_);
    rec[name + "_comm_mb_per_step"] = double(t.bytes) / n / 1048576.0;
    rec[name + "_collectives_per_step"] = {{"all_reduce", double(t.all_reduce) / n},
                                           {"all_gather", double(t.all_gather) / n},
                                           {"reduce_scatter", double(t.reduce_scatter) / n},
                                           {"send_recv", double(t.send_recv) / n},
                                           {"all_to_all", double(t.all_to_all) / n}};
    since = now;
  };
  if (rt_ && plan_.tp > 1) traffic("tp", rt_->tp.traffic, interval_tp_);
  if (rt_ && plan_.context.cp > 1) traffic("cp", rt_->cp.traffic, interval_cp_);  // ring steps or K/V gathers
  if (rt_ && plan_.ep > 1) traffic("ep", rt_->ep.traffic, interval_ep_);  // tokens to their experts and back
  tr_.moe->report(rec);  // balancing loss, imbalance and dropped tokens per MoE layer
  if (align_) align_->report(rec);  // TRL's rewards/*, logps/*, logits/* over every dp x cp rank
  activation_bytes_ = -1;
  check_finite();
  std::string line = "step " + std::to_string(step_) + "/" + std::to_string(data_.max_steps) + ": loss " + fmt(loss) +
                     ", lr " + fmt(lr_, 6) + ", grad norm " + fmt(gn, 3) + ", " + fmt(tokens_per_s, 0) + " tok/s, " +
                     fmt(ms_per_step, 1) + " ms/step";
  if (peak_flops_) {
    // `mfu` counts causal attention's masked half as work, `mfu_unmasked` not (metrics.h).
    const auto mfu = model_flops_utilization(model_->flops_per_token(data_.seq_len), model_->flops_per_token(0),
                                             tokens_per_s, *peak_flops_ * world_);
    rec["mfu"] = mfu.counted;
    rec["mfu_unmasked"] = mfu.unmasked;
    line += ", mfu " + fmt(100 * rec["mfu"].get<double>(), 1) + "% (unmasked " +
            fmt(100 * rec["mfu_unmasked"].get<double>(), 1) + "%)";
  }
  line += ", peak mem " + fmt(rec["peak_mem_mb"].get<double>(), 0) + " MB";
  if (tr_.scaler)
    line += ", loss scale " + fmt(rec["loss_scale"].get<double>(), 0) + ", skipped " +
            std::to_string(rec["skipped_steps"].get<int64_t>());
  if (timed_) {
    // A replayed CUDA graph is timed whole (its parts ran at capture); the steps
    // up to its capture are not timed.
    const auto split = timer_.read();
    line += ", time";
    for (int p = 0; p < StepTimer::kNumParts; ++p) {
      if ((p == StepTimer::kGraph) != (graph_ != nullptr) && p != StepTimer::kData) continue;
      rec[StepTimer::metric_key(StepTimer::Part(p))] = split[p];
      line += std::string(p ? " / " : " ") + StepTimer::name(StepTimer::Part(p)) + " " + fmt(split[p], 1);
    }
    line += " ms";
  }
  if (rank_ == 0) {
    if (console_) log::info(line);
    if (jsonl_) jsonl_->write(rec);
    if (tb_) tb_->write(rec);
  }
  interval_start_ = std::chrono::steady_clock::now();
  interval_steps_ = 0;
}

void Trainer::evaluate() {
  if (!data_.val || args_.max_val_steps <= 0) return;
  tr_.flush();  // delayed update: evaluate the weights of every step so far
  torch::NoGradGuard no_grad;
  model_->eval();
  // Token-weighted as training: [sum of losses, targets] over every batch and dp x cp rank.
  auto sum = torch::zeros({2}, fopts_);
  // A stop request (preemption) cuts a long evaluation short: the ranks agree
  // about once a second, as between training steps, and all leave together.
  StopDecision stop(rt_.get());
  int64_t done = 0;
  if (align_) align_->begin_eval();  // the validation pairs' reference, their metrics apart from the step's
  for (; done < args_.max_val_steps; ++done) {
    auto b = cp_slice(data_.val->val_batch(done, dp_rank_ * micro_, micro_), plan_.context, cp_rank_);
    tr_.reducer->begin_forward();  // ZeRO-3: the parameters outside the blocks
    const auto docs = b.segments.defined() ? models::Documents{b.positions.to(device_), b.segments.to(device_)}
                                           : models::Documents{};
    if (align_) {
      b.x = b.x.to(device_), b.y = b.y.to(device_), b.pair_index = b.pair_index.to(device_);
      if (!tr_.pipeline) align_->before_forward(b);  // under pp the last stage's head asks for it
    }
    const auto count = (align_ ? align_->count(b) : target_count(b)).to(device_);
    at::Tensor mean;
    if (tr_.pipeline) {
      mean = tr_.pipeline->eval_loss({b.x.to(device_), b.y.to(device_), docs.positions, docs.segments, b.pair_index});
      rt_->all_reduce(rt_->pp, mean, "validation loss all-reduce (pipeline: from the last stage)");
    } else {
      mean = model_->loss(b.x.to(device_), b.y.to(device_), docs).detach().to(torch::kFloat32);
    }
    sum += torch::stack({loss_sum(mean, count), count.to(torch::kFloat32)});
    if (done + 1 < args_.max_val_steps && stop.after_step(done + 1, g_stop_signal.load() != 0, false)) {
      ++done;
      break;
    }
  }
  tr_.reducer->release_params();
  model_->train();
  if (done < args_.max_val_steps) {
    nlohmann::json dropped;
    if (align_) align_->end_eval(dropped);  // every rank leaves together (the stop decision is agreed)
    if (rank_ == 0)
      log::warn("step " + std::to_string(step_) + ": validation cut short by a stop request after " +
                std::to_string(done) + " of " + std::to_string(args_.max_val_steps) + " batches; no val loss recorded");
    return;
  }
  if (rt_) rt_->all_reduce(rt_->dp_cp, sum, "validation loss all-reduce");
  const double val_loss = sum[0].item<double>() / std::max(1.0, sum[1].item<double>());
  nlohmann::json rec = {{"step", step_}, {"val_loss", val_loss}};
  if (align_) align_->end_eval(rec);  // val_rewards/*, ... over every rank (a collective: before rank 0 alone goes on)
  if (rank_ != 0) return;
  log::info("step " + std::to_string(step_) + ": val loss " + fmt(val_loss));
  if (jsonl_) jsonl_->write(rec);
  if (tb_) tb_->write(rec);
}

void Trainer::save() {
  if (args_.checkpoint.save_dir.empty()) return;
  tr_.flush();  // delayed update: a checkpoint holds every update up to its step
  check_finite();
  auto tensors = tr_.state_tensors();
  for (auto& t : tr_.rng_state_tensors(rank_, device_)) tensors.push_back(std::move(t));
  nlohmann::json state = {
      {"step", step_},
      {"epoch", step_ * global_batch_ / std::max<int64_t>(1, data_.train->samples_per_epoch())},
      {"consumed_samples", step_ * global_batch_},
      {"data_cursor", {{"next_step", step_}, {"seed", args_.seed}, {"global_batch", global_batch_}}},
      {"optimizer", {{"type", args_.optimizer.type}, {"step_count", tr_.optimizer->step_count()}}},
      // lr: what the last step trained with; a resume under a changed schedule compares with it.
      {"lr_scheduler", {{"type", args_.lr_scheduler.type}, {"last_step", step_ - 1}, {"lr", lr_}}},
      {"plan", plan_},
      {"model_type", args_.model.type},
      {"config", args_.resolved_yaml}};
  ft_->annotate(state);  // data_cursor.skipped
  auto* nvme = tr_.state->nvme();
  if (!nvme) {
    saver_->save(step_, tensors, state, nlohmann::json::object());
    return;
  }
  // The NVMe tier: the weights and moments are read from the files through a
  // mapping as the writer goes; what the saver holds is measured, not assumed.
  const auto rss = [](const char* key) {  // kB in /proc/self/status, as MiB
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key))) / 1024.0;
    return 0.0;
  };
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM restarts from the resident set now
  const double resident0 = rss("VmRSS:");
  const int64_t tensors0 = cpu_tensor_bytes().in_use;
  reset_cpu_window_peak();
  saver_->save(step_, tensors, state, nlohmann::json::object());
  const double peak = rss("VmHWM:"), file_pages = rss("RssFile:");
  const int64_t tensor_peak = cpu_tensor_bytes().window_peak - tensors0;
  tensors.clear();
  nvme->unmap_after_checkpoint();
  log::info("checkpoint of step " + std::to_string(step_) + " streamed " + std::to_string(nvme->file_bytes()) +
            " bytes of optimizer state from the NVMe files; the saver's peak host memory: tensors +" +
            std::to_string(tensor_peak) + " bytes, resident " + fmt(peak, 1) + " MiB (" + fmt(resident0, 1) +
            " MiB before the save, " + fmt(file_pages, 1) + " MiB of file pages mapped at its end, which the kernel can drop)");
}

// The loop, one step per turn; each concern lives in the function it calls.
int Trainer::run() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
  const int64_t max_steps = data_.max_steps;
  bool stopped_by_signal = false;
  interval_start_ = std::chrono::steady_clock::now();
  while (step_ < max_steps) {
    begin_step(max_steps);
    std::vector<data::Batch> batches;
    for (int64_t a = 0; a < accum_; ++a) batches.push_back(loader_->next());
    // This process's first step completes the record with what ran in it.
    const bool first = !record_->has("first_step");
    const auto counts = first ? RunCounts::now(rt_.get()) : RunCounts{};
    if (graph_) replay_step(batches);
    else {
      poison_ = inject_nonfinite(step_ + 1, ft_->data_step(step_), rank_);
      TORCH_CHECK(!inject_torch_error(step_ + 1, rank_), "injected error (NNSTRAIN_TEST_TORCH_ERROR_AT)");
      step(batches);
    }
    timer_.end_step();
    ++step_;
    ++interval_steps_;
    after_step(first ? std::optional<RunCounts>(counts) : std::nullopt, static_cast<int64_t>(batches.size()));
    if (auto back = ft_->after_step(step_, loss_sum_, grad_norm_, tr_.state->params())) { rewind(*back); continue; }

    const bool last = step_ == max_steps;
    if (logs_step_) log_progress();
    evaluate_in_training(last);
    const bool periodic = args_.checkpoint.every_n_train_steps > 0 && step_ % args_.checkpoint.every_n_train_steps == 0;
    // Every rank stops at the same step if any was asked to (SLURM/PBS preemption).
    // Post-validation: a speculative step's requests travel with its norm and
    // stop the run after the next step (synchronous then), with no barrier here.
    const bool stop = pending_          ? false
                      : stop_pending_   ? true
                                        : stop_decision_->after_step(step_, g_stop_signal.load() != 0, periodic || last);
    if (stop) {
      log::warn("stop requested (SIGTERM/SIGUSR1): saving and stopping at step " + std::to_string(step_));
      stopped_by_signal = true;
    }
    if (periodic || (last && args_.checkpoint.save_on_end) || stop) save();
    if (stop) break;
  }
  finish(stopped_by_signal);
  return 0;
}

// What the coming step does: its learning rate, whether it logs, may
// speculate, is timed.
void Trainer::begin_step(int64_t max_steps) {
  running_step(step_ + 1, rank_);
  lr_ = optim::learning_rate_at_step(args_.lr_scheduler, args_.optimizer.lr, step_, max_steps, data_.steps_per_epoch);
  profiler_.before_step(step_ + 1);
  const int64_t every = args_.log_progress_every_n_train_steps;
  const bool logs = (step_ + 1) % every == 0 || step_ + 1 == max_steps;
  logs_step_ = logs_ = logs;
  // Post-validation speculates at ordinary steps only: not where the step is
  // logged, evaluated or saved, nor the last (their state must stand).
  speculate_ = post_validation_ && !logs && step_ + 1 < max_steps &&
               !(args_.val_every_n_train_steps > 0 && (step_ + 1) % args_.val_every_n_train_steps == 0) &&
               !(task_eval_ && task_eval_->due(step_ + 1, false)) &&
               !(args_.checkpoint.every_n_train_steps > 0 && (step_ + 1) % args_.checkpoint.every_n_train_steps == 0);
  if (logs) reset_step_peak(device_);  // peak_tensor_mb: what this step holds at most
  // A step being captured records no timing events (they would join the graph);
  // a replayed one is timed as data, then the graph as a whole.
  const bool replay = graph_ && graph_->captured();
  timed_ = logs && (!graph_ || replay);
  timer_.begin_step(step_ + 1, timed_);
}

// compute_config.cuda_graphs: the step captured once, replayed from then on.
void Trainer::replay_step(const std::vector<data::Batch>& batches) {
  const bool replay = graph_->captured();
  lr_dev_.fill_(lr_);
  saver_->state_may_change();  // host side: a replayed step does not run step()'s call
  logs_ = true;  // eager and captured steps measure their activations (reading counters only)
  if (replay) timer_.enter(StepTimer::kGraph);
  const int64_t comm = tr_.reducer->communicated_bytes();
  graph_->run(batches);
  if (!replay && graph_->captured()) {
    graph_activation_bytes_ = activation_bytes_;
    graph_comm_bytes_ = tr_.reducer->communicated_bytes() - comm;
    log::info("compute_config.cuda_graphs: step " + std::to_string(step_ + 1) + " captured" +
              (rt_ ? " with its " + rt_->backend_name() + " collectives" : std::string()) +
              ", replayed from here on (graph pool " + fmt(graph_->pool_bytes() / 1048576.0, 1) + " MB)");
  }
  // A replay runs the captured collectives without the host code that counts them.
  if (replay) replayed_comm_bytes_ += graph_comm_bytes_;
  if (rt_ && graph_->captured()) rt_->watch_replay("CUDA graph replay of the training step");
}

// After a step: the run's record (first step), the NVMe tier's traffic, the
// profiler's and memory snapshots' windows.
void Trainer::after_step(const std::optional<RunCounts>& first_counts, int64_t micro_batches) {
  if (first_counts) {
    auto ran = RunCounts::now(rt_.get()).since(*first_counts);
    ran["step"] = step_;
    ran["micro_batches"] = micro_batches;
    const auto reduced = tr_.reducer->reduced_dtype();
    ran["reduce_dtype"] = reduced ? nlohmann::json(dtype_label(*reduced)) : nlohmann::json(nullptr);
    ran["lora_frozen"] = lora::frozen_state(*model_);  // after backward and the update: no frozen tensor has a gradient
    if (align_) ran["alignment"] = align_->describe();  // its objective's and reference's forwards so far
    record_->complete("first_step", std::move(ran));
  }
  if (auto* nvme = tr_.state->nvme()) {  // what the NVMe tier moved this step (its files were used)
    const auto io = nvme->take_counters();
    log::info("nvme offload: step " + std::to_string(step_) + " read " + std::to_string(io.bytes_read) + " bytes in " +
              std::to_string(io.reads) + " chunks, wrote " + std::to_string(io.bytes_written) + " bytes in " +
              std::to_string(io.writes) + " chunks (" + nvme->store().engine() + ")");
  }
  profiler_.after_step(step_);
  if (snapshots_) snapshots_->after_step(step_);
}

// Evaluation between steps: its traffic kept out of the per-step figures, and
// the first one recorded.
void Trainer::evaluate_in_training(bool last) {
  const bool val = args_.val_every_n_train_steps > 0 && (step_ % args_.val_every_n_train_steps == 0 || last);
  const bool tasks = task_eval_ && task_eval_->due(step_, last);
  if (!val && !tasks) return;
  const auto before = rt_ ? rt_->tp.traffic : dist::Traffic{}, before_cp = rt_ ? rt_->cp.traffic : dist::Traffic{},
             before_ep = rt_ ? rt_->ep.traffic : dist::Traffic{};
  const bool first_eval = data_.val && args_.max_val_steps > 0 && !record_->has("first_evaluation");
  const auto counts = first_eval ? RunCounts::now(rt_.get()) : RunCounts{};
  if (val) evaluate();
  if (val && first_eval) {
    auto ran = RunCounts::now(rt_.get()).since(counts);
    ran["step"] = step_;
    record_->complete("first_evaluation", std::move(ran));
  }
  if (tasks) {
    tr_.flush();  // delayed update: score the weights of every step so far
    const auto rec = task_eval_->run(step_);
    if (rank_ == 0) {
      std::string line = "step " + std::to_string(step_) + ": eval";
      for (const auto& [k, v] : rec.items())
        if (k != "step" && k != "eval_seconds") line += " " + k.substr(5) + " " + fmt(v.get<double>());
      log::info(line + " (" + fmt(rec["eval_seconds"].get<double>(), 2) + " s)");
      if (jsonl_) jsonl_->write(rec);
      if (tb_) tb_->write(rec);
    }
  }
  if (rt_) {  // the per-step tp and cp figures count training only
    interval_tp_ += rt_->tp.traffic - before;
    interval_cp_ += rt_->cp.traffic - before_cp;
    interval_ep_ += rt_->ep.traffic - before_ep;
  }
}

// The run's end: the last save published, scratch files removed, what this
// rank held and moved reported, communicators finalised.
void Trainer::finish(bool stopped_by_signal) {
  tr_.flush();
  saver_->wait();  // the last save is published before the run ends
  if (auto* nvme = tr_.state->nvme()) {  // a clean exit: the scratch files go (a crash leaves them, with a note)
    nvme->store().close();
    log::info("nvme offload: removed " + nvme->store().folder());
  }
  // What this rank keeps between steps (the ZeRO stages' 1/N is checked against it).
  const auto held = tr_.held_bytes();
  int64_t elements = 0;  // this rank's parameter elements before ZeRO (after tensor parallelism)
  for (auto& p : tr_.state->params()) elements += p.tensor.numel();
  log::info("held between steps: parameters " + std::to_string(int64_t(held.param)) + ", gradients " +
            std::to_string(int64_t(held.grad)) + ", masters " + std::to_string(int64_t(held.master)) +
            ", optimizer moments " + std::to_string(int64_t(held.moments)) + " bytes, for " +
            std::to_string(elements) + " parameter elements");
  if (rt_ && plan_.zero_stage > 0) {  // this rank's ZeRO traffic, counted at the collectives (test_pipeline_zero)
    const auto& t = rt_->zero.traffic;
    log::info("ZeRO group collectives by the end of step " + std::to_string(step_) + ": " +
              std::to_string(t.all_gather) + " all-gathers, " + std::to_string(t.reduce_scatter) +
              " reduce-scatters, " + std::to_string(t.all_reduce) + " all-reduces over " +
              std::to_string(tr_.reducer->bucket_count()) + " buckets");
  }
  if (tr_.state->offloaded()) {
    const auto host = tr_.state->host_held_bytes();
    log::info("held on the host between steps (offload): weights " + std::to_string(int64_t(host.master)) +
              ", gradients " + std::to_string(int64_t(host.grad)) + ", optimizer moments " +
              std::to_string(int64_t(host.moments)) + ", parameters and staging " + std::to_string(int64_t(host.param)) +
              " bytes; in the last step " + std::to_string(tr_.reducer->offloaded_in_backward()) + " of " +
              std::to_string(tr_.state->host_buckets()) + " offloaded buckets' gradients left during backward");
  }
  if (post_validation_)
    log::info("optimizer post-validation: " + std::to_string(speculated_) + " steps taken speculatively, " +
              std::to_string(rolled_back_) + " rolled back");
  if (rank_ == 0) log::info(stopped_by_signal ? "stopped early on request" : "training done");
  // A graph that captured NCCL collectives holds their communicators: destroying
  // (or aborting) one first waits for the graph forever (pytorch/pytorch#115388).
  graph_.reset();
  if (rt_) rt_->shutdown();  // a clean exit: NCCL communicators finalised, not aborted
}

int train_loop(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts, OomContext& oom) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(args.compute_config.collective_timeout_s * 1000));
  const torch::Device device = start_rank(args, env);
  if (args.memory_snapshot) {
    // Recording starts before the first device allocation, so an out-of-memory
    // at start-up (state that does not fit, the most common one) is recorded too.
    if (!device.is_cuda())
      throw config::ConfigError("memory_snapshot: true needs a CUDA device, but this run uses " + device.str() +
                                " (on CPU metrics.jsonl records peak_tensor_mb, the step's peak tensor bytes)");
    oom.snapshots = std::make_unique<MemorySnapshots>((fs::path(args.run_dir) / "memory").string(), env.rank);
  }
  const auto whole = describe_model(args);
  auto agreed = decide_plan(args, env, *whole, device, timeout);
  oom.estimate_bytes = agreed.plan.estimate.total_bytes;
  auto data = open_data(args, *whole, agreed.plan);
  auto rt = connect(args, env, agreed, device, timeout);
  auto local = materialise_model(args, agreed.plan, rt.get(), device, whole->vocab_size());
  auto tr = make_trainable(args, agreed.plan, local, rt.get(), env, device);
  local.initial_chunks = at::Tensor();  // the state holds what it needs of them (offload: on the host)
  int64_t start_step = 0;
  // A restart (nnstrain launch --max-restarts, the job scripts): the latest checkpoint if any, else the run's source.
  const auto resumed_from = resume(args, RunOptions{restart_source(args, opts.resume)}, tr, data, env.rank, device, &start_step);
  // Into every rank's log file: what start-up (build, split, state, resume) cost in host memory.
  log::info("rank " + std::to_string(env.rank) + ": start-up peak host RSS " +
            fmt(peak_host_rss_bytes() / 1048576.0, 1) + " MiB, tensors in use " +
            fmt(memory_in_use_bytes(device) / 1048576.0, 1) + " MiB");
  if (env.rank == 0)
    write_run_files(args, agreed.plan,
                    {env.world_size, device.str(), resumed_from, start_step, args.global_batch_size * data.seq_len});
  std::unique_ptr<align::Alignment> align;
  if (args.alignment.enabled) {
    align::AlignmentContext a;
    a.args = &args;
    a.plan = &agreed.plan;
    a.rt = rt.get();
    a.device = device;
    a.rank = env.rank;
    a.dp = agreed.plan.dp;
    a.dp_rank = env.rank / (agreed.plan.tp * agreed.plan.context.cp * agreed.plan.pipeline.pp);
    a.micro_batch = args.micro_batch_size;
    a.start_step = start_step;
    a.build_reference = [&] { return materialise_model(args, agreed.plan, rt.get(), device, whole->vocab_size()).model; };
    const auto context = agreed.plan.context;
    const int cp_rank = env.rank / agreed.plan.tp % agreed.plan.context.cp;
    a.slice = [context, cp_rank](data::Batch b) { return cp_slice(std::move(b), context, cp_rank); };
    if (auto* pipe = tr.pipeline.get()) a.pipeline_forward = [pipe](const data::Batch& b) { pipe->eval_loss(b); };
    auto* reducer = tr.reducer.get();
    a.begin_forward = [reducer] { reducer->begin_forward(); };
    a.end_forward = [reducer] { reducer->release_params(); };
    align = std::make_unique<align::Alignment>(a, local.model, *data.train);
    align->prepare(*data.train, data.val.get());  // precomputed: the reference pass, before the first step
    if (tr.pipeline) tr.pipeline->set_before_head([a = align.get()](const data::Batch& b) { a->before_forward(b); });
  }
  Trainer trainer(args, env, device, std::move(local.model), std::move(agreed), std::move(rt), std::move(tr),
                  std::move(data), start_step, resumed_from, oom, std::move(align));
  return trainer.run();
}

}  // namespace

int run(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts) {
  install_cpu_tensor_counter();  // before any tensor: CPU peaks count every storage
  OomContext oom;
  try {
    return train_loop(args, env, opts, oom);
  } catch (const c10::OutOfMemoryError& e) {
    // A planner that underestimated, or a budget set too high: say both numbers and where to look.
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    std::string msg = "rank " + std::to_string(env.rank) + ": out of memory: " + what + "; the planner estimated " +
                      fmt(oom.estimate_bytes / 1073741824.0, 2) + " GiB per rank (nnstrain plan shows the parts)";
    const std::string snap = oom.snapshots ? oom.snapshots->oom_snapshot() : "";
    msg += snap.empty() ? (oom.snapshots ? "; no memory snapshot could be written"
                                         : "; set memory_snapshot: true to record where the memory went")
                        : "; memory snapshot " + snap + " (open it in https://pytorch.org/memory_viz)";
    log::error(msg);
    return 1;
  } catch (const c10::Error& e) {
    throw step_error(e, env.rank, g_running_step.load());
  }
}

StepError step_error(const std::exception& torch_error, int rank, int64_t step) {
  // LibTorch's message carries a C++ backtrace: one line for the user, the whole for --debug.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&torch_error);
  std::string msg = c10_error ? c10_error->what_without_backtrace() : torch_error.what();
  msg = msg.substr(0, msg.find('\n'));
  return StepError("rank " + std::to_string(rank) + ": " +
                       (step > 0 ? "step " + std::to_string(step) : std::string("before training")) + ": " + msg,
                   torch_error.what());
}

}  // namespace nnstrain::train
