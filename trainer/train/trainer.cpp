#include "trainer/train/trainer.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <limits>
#include <sstream>

#include "data/loader.h"
#include "data/token_bin.h"
#include "models/common/init.h"
#include "models/common/parallel_rng.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/async_save.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/hf.h"
#include "trainer/checkpoint/rng_state.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/dist/device.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/adamw.h"
#include "trainer/parallel/data_parallel.h"
#include "trainer/parallel/planner.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/optim/precision.h"
#include "trainer/train/log.h"
#include "trainer/train/memory_snapshot.h"
#include "trainer/train/metrics.h"
#include "trainer/train/profiler.h"
#include "trainer/train/run_dir.h"
#include "trainer/train/step_graph.h"
#include "trainer/train/step_timer.h"
#include "trainer/train/stop_decision.h"
#include "trainer/train/tensorboard.h"

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

// A tensor every rank holds whole and identical (loss-scaler state).
checkpoint::StateTensor replicated(const std::string& name, const at::Tensor& t, int world) {
  auto spec = checkpoint::ShardSpec::full(name, checkpoint::dtype_name(checkpoint::to_dtype(t.scalar_type())),
                                          t.sizes().vec());
  for (int r = 0; r < world; ++r) spec.replica_ranks.push_back(r);
  return {spec, t};
}

// The run's state that checkpoints hold, as ShardSpec'd pieces: the weights
// (fp32 masters under *-mixed), AdamW's moments, the loss scaler's state.
struct Trainable {
  std::unique_ptr<parallel::DataParallel> dp;
  std::unique_ptr<optim::AdamW> optimizer;
  std::optional<optim::LossScaler> scaler;
  int world = 1;

  std::vector<checkpoint::StateTensor> state_tensors() {
    auto out = dp->weight_state();
    const auto m = dp->segment_specs("optim/exp_avg/"), v = dp->segment_specs("optim/exp_avg_sq/");
    for (size_t i = 0; i < m.size(); ++i) {
      out.push_back({m[i], optimizer->exp_avg(i)});
      out.push_back({v[i], optimizer->exp_avg_sq(i)});
    }
    if (scaler) {
      out.push_back(replicated("amp/scale", scaler->scale(), world));
      out.push_back(replicated("amp/growth_tracker", scaler->growth_tracker(), world));
    }
    return out;
  }

  // Bytes per parameter element this rank holds, by part, measured from its tensors.
  parallel::StateBytes held_bytes_per_param() {
    int64_t n = 0;
    for (const auto& p : dp->params()) n += p.tensor.numel();
    auto b = dp->held_bytes();
    for (size_t i = 0; i < optimizer->segments().size(); ++i)
      b.moments += double(optimizer->exp_avg(i).nbytes() + optimizer->exp_avg_sq(i).nbytes());
    const double per = 1.0 / double(std::max<int64_t>(1, n));
    return {b.param * per, b.grad * per, b.master * per, b.moments * per};
  }
};

// A test-only switch: NNSTRAIN_TEST_NONFINITE_AT=STEP[:RANK] makes the loss (and
// so every gradient) of that step non-finite on that rank (all ranks without RANK).
bool inject_nonfinite(int64_t step, int rank) {
  static const std::string at = [] {
    const char* e = std::getenv("NNSTRAIN_TEST_NONFINITE_AT");
    return std::string(e ? e : "");
  }();
  if (at.empty()) return false;
  const auto colon = at.find(':');
  if (std::stoll(at.substr(0, colon)) != step) return false;
  return colon == std::string::npos || std::stoi(at.substr(colon + 1)) == rank;
}

// What an out-of-memory message needs, kept outside the loop's scope.
struct OomContext {
  double estimate_bytes = 0;                   // the planner's per-rank total
  std::unique_ptr<MemorySnapshots> snapshots;  // memory_snapshot: true
};

int train_loop(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts, OomContext& oom) {
  log::init(env.rank, env.world_size);
  fs::create_directories(fs::path(args.run_dir) / "logs");
  log::add_file(rank_log_path(args.run_dir, env.rank));
  const torch::Device device = dist::bind_device(args.compute_config.device, env);  // before any CUDA work
  dist::set_allow_tf32(args.compute_config.allow_tf32);
  // CUDA graphs: the run works on a non-default stream from here on (step_graph.h).
  if (args.compute_config.cuda_graphs && device.is_cuda()) use_capture_stream(device);
  const int world = env.world_size, rank = env.rank;
  const int64_t micro = args.micro_batch_size, global_batch = args.global_batch_size;

  // The whole model on meta (shapes, no storage): what the planner splits.
  const auto* entry = models::find_model(args.model.type);
  auto model = entry->build_sharded(*args.model.args, parallel::sharding_context(nullptr));
  models::RuntimeOptions ro;
  ro.chunked_loss = args.model.loss == "chunked";
  ro.loss_chunk_size = args.model.loss_chunk_size;

  // The plan: tensor-parallel degree, ZeRO, recompute per layer (planner.h).
  parallel::PlanRequest preq;
  preq.args = &args;
  preq.model = model.get();
  preq.world_size = world;
  preq.device = parallel::device_spec(device.is_cuda() ? "auto" : "cpu");
  preq.memory_budget_bytes = args.compute_config.memory_budget_gb * 1073741824.0;
  const auto plan = parallel::make_plan(preq);
  oom.estimate_bytes = plan.estimate.total_bytes;
  const int64_t dp = plan.dp, dp_rank = rank / plan.tp, accum = plan.grad_accumulation_steps;
  ro.recompute_layers = plan.recompute;
  // Dropout streams differ between data-parallel replicas and agree within a
  // tensor-parallel group, so replicated regions draw the same masks there.
  torch::manual_seed(args.seed + 1000003ULL * static_cast<uint64_t>(dp_rank));

  // Data.
  data::TokenBinDataset train_ds(args.dataset.train_args, args.seed);
  std::optional<data::TokenBinDataset> val_ds;
  if (args.dataset.val_args) val_ds.emplace(*args.dataset.val_args, args.seed);
  data::check_token_ids(train_ds.file(), model->vocab_size(), "dataset.train_args.path");
  if (val_ds) data::check_token_ids(val_ds->file(), model->vocab_size(), "dataset.val_args.path");
  const int64_t seq_len = train_ds.seq_len();
  if (seq_len > model->max_seq_len())
    throw config::ConfigError("dataset.train_args.seq_len " + std::to_string(seq_len) +
                              " exceeds the model's maximum sequence length " + std::to_string(model->max_seq_len()));
  // One epoch = samples_per_epoch samples (docs/data.md), in whole steps.
  const int64_t steps_per_epoch = std::max<int64_t>(1, train_ds.samples_per_epoch() / global_batch);
  const int64_t max_steps = args.max_train_steps > 0 ? args.max_train_steps : args.max_epochs * steps_per_epoch;

  // Process groups (none for one process).
  std::unique_ptr<dist::Runtime> rt;
  if (world > 1) {
    dist::RuntimeOptions ropts;
    ropts.tp = plan.tp;
    ropts.zero_ngroups = plan.zero ? plan.zero_ngroups : 1;
    ropts.backend = args.compute_config.backend;
    ropts.cuda = device.is_cuda();
    ropts.timeout = std::chrono::milliseconds(static_cast<int64_t>(args.compute_config.collective_timeout_s * 1000));
    rt = std::make_unique<dist::Runtime>(env, ropts);
  }

  // Tensor-parallel split (if any), then data-parallel flat buffers in the
  // precision's dtypes (the model was built in fp32: masters start from it exactly).
  const auto prec = optim::precision_setup(args.precision, args.compute_config.reduce_dtype);
  Trainable tr;
  std::shared_ptr<models::common::ParallelRng> tp_rng;  // sharded-region dropout (tp > 1), in checkpoints
  tr.world = world;
  {
    // This rank's piece of the model, built on meta and materialised on the
    // device: Hugging Face weights (only its slices read), or the fresh
    // initialisation, slice for slice that of one process with the same seed.
    const auto ctx = parallel::sharding_context(rt.get(), args.model.make_vocab_size_divisible_by, args.seed,
                                                args.compute_config.sequence_parallel);
    tp_rng = ctx.rng;
    for (const auto* ds : {&train_ds, val_ds ? &*val_ds : nullptr})
      if (ds && ctx.sp() && ds->seq_len() % ctx.tp != 0)
        throw config::ConfigError("compute_config.sequence_parallel: the sequence of " +
                                  std::to_string(ds->seq_len()) + " tokens (dataset." +
                                  (ds == &train_ds ? "train" : "val") + "_args.seq_len) is not divisible by tp " +
                                  std::to_string(ctx.tp) + "; set it to false or change seq_len");
    const int64_t vocab = model->vocab_size(), padded = ctx.padded_vocab(vocab);
    if (ctx.tp > 1 && padded / ctx.tp * (ctx.tp - 1) >= vocab)
      throw config::ConfigError("model.make_vocab_size_divisible_by " +
                                std::to_string(args.model.make_vocab_size_divisible_by) + ": padding the vocabulary of " +
                                std::to_string(vocab) + " to " + std::to_string(padded) + " leaves tensor-parallel rank " +
                                std::to_string(ctx.tp - 1) + " no rows; lower it");
    model = entry->build_sharded(*args.model.args, ctx);
    if (!args.model.init_from.empty()) {
      const auto r = checkpoint::load_hf_weights(*model, args.model.init_from, device);
      log::info("initialised weights from " + args.model.init_from + " (this rank read " +
                fmt(r.bytes_read / 1048576.0, 1) + " of " + fmt(r.bytes_needed / 1048576.0, 1) + " MiB)");
    } else {
      models::common::materialise_fresh(*model, device, args.seed);
    }
    model->set_runtime_options(ro);
    model->train();
    auto shards = parallel::tensor_parallel_shards(*model, rt.get(), world);
    parallel::DataParallelOptions dpo;
    dpo.bucket_cap_mb = args.compute_config.reducer_bucket_cap_mb;
    dpo.zero = plan.zero;
    dpo.weight_decay = args.optimizer.weight_decay;
    dpo.param_dtype = prec.param;
    dpo.grad_dtype = prec.grad;
    dpo.master_weights = prec.master_weights;
    tr.dp = std::make_unique<parallel::DataParallel>(std::move(shards), rt.get(), dpo);
  }
  tr.optimizer = std::make_unique<optim::AdamW>(tr.dp->optimizer_segments(), args.optimizer);
  const auto fopts = torch::TensorOptions().device(device).dtype(torch::kFloat32);
  if (prec.loss_scaling) tr.scaler.emplace(args.loss_scaler, fopts);

  // Resume.
  int64_t start_step = 0;
  std::string resume = opts.resume.empty() ? args.checkpoint.resume_from : opts.resume;
  if (resume == "last") {
    if (args.checkpoint.save_dir.empty())
      throw config::ConfigError("--resume without a path needs checkpoint.save_dir");
    resume = checkpoint::latest(args.checkpoint.save_dir);
    if (resume.empty()) log::warn("no checkpoint under " + args.checkpoint.save_dir + " yet: starting fresh");
  }
  if (!resume.empty()) {
    checkpoint::Checkpoint ck(resume);
    const auto& st = ck.state();
    if (st.value("model_type", "") != args.model.type)
      throw checkpoint::CheckpointError(resume + ": checkpoint of model type '" + st.value("model_type", "") +
                                        "', but this run trains '" + args.model.type + "'");
    torch::NoGradGuard no_grad;
    for (auto& t : tr.state_tensors()) {
      // A checkpoint saved without a loss scaler (another precision) keeps the fresh scale.
      if (t.spec.name.rfind("amp/", 0) == 0 && !ck.has(t.spec.name)) continue;
      ck.load_into(t);
    }
    tr.dp->after_optimizer_step();  // the compute copy from the loaded (master) weights
    start_step = st.at("step").get<int64_t>();
    tr.optimizer->set_step_count(st.at("optimizer").at("step_count").get<int64_t>());
    std::vector<checkpoint::ExtraRngState> extra;
    if (tp_rng) extra.push_back({"tp", tp_rng->state(device)});
    checkpoint::restore_rng_state(ck, rank, device, &extra);
    if (tp_rng) tp_rng->set_state(device, extra[0].state);
    log::info("resumed from " + resume + " at step " + std::to_string(start_step));
  }
  // Into every rank's log file: what start-up (build, split, state, resume) cost in host memory.
  log::info("rank " + std::to_string(rank) + ": start-up peak host RSS " +
            fmt(peak_host_rss_bytes() / 1048576.0, 1) + " MiB");
  if (rank == 0) write_run_files(args, plan, {world, device.str(), resume, start_step, global_batch * seq_len});

  // Logging sinks.
  std::unique_ptr<JsonlSink> jsonl;
  std::unique_ptr<TensorBoardSink> tb;
  bool console = args.log.empty();
  for (const auto& s : args.log) {
    if (s.type == "console") console = true;
    if (s.type == "jsonl" && rank == 0) jsonl = std::make_unique<JsonlSink>(s.path, start_step);
    if (s.type == "tensorboard" && rank == 0) tb = std::make_unique<TensorBoardSink>(s.path, start_step);
  }
  if (args.log.empty() && rank == 0) jsonl = std::make_unique<JsonlSink>((fs::path(args.run_dir) / "metrics.jsonl").string(), start_step);

  std::optional<double> peak;  // MFU only where the device table is meaningful (GPUs)
  if (device.is_cuda()) peak = parallel::peak_flops_for(preq.device, args.precision, args.compute_config.allow_tf32);
  const double flops_per_token = model->flops_per_token(seq_len);
  const auto held = tr.held_bytes_per_param();
  if (rank == 0) {
    int64_t nparams = 0;
    for (auto& p : tr.dp->params()) nparams += p.tensor.numel();
    log::info("model " + args.model.type + ": " + std::to_string(nparams) + " parameters, device " + device.str() +
              ", world " + std::to_string(world) + " (dp " + std::to_string(dp) + "), global batch " +
              std::to_string(global_batch) + " x " + std::to_string(seq_len) + " tokens, steps " +
              std::to_string(start_step) + " -> " + std::to_string(max_steps) + ", optimizer " + tr.optimizer->impl() +
              (plan.zero ? " (ZeRO-1)" : "") + ", plan tp " + std::to_string(plan.tp) + " x dp " +
              std::to_string(plan.dp) + ", recompute " +
              std::to_string(std::count(plan.recompute.begin(), plan.recompute.end(), true)) + " layers" +
              (rt ? ", backend " + rt->backend_name() + ", " + std::to_string(tr.dp->bucket_count()) + " buckets, " +
                        std::to_string(tr.dp->reduced_bytes_per_step()) + " gradient bytes reduced per step"
                  : ""));
    log::info("precision " + args.precision + ": state bytes/param " + fmt(held.total(), 2) + " (param " +
              fmt(held.param, 2) + ", grad " + fmt(held.grad, 2) + ", master " + fmt(held.master, 2) +
              ", moments " + fmt(held.moments, 2) + ")" + (tr.scaler ? ", dynamic loss scaling" : ""));
  }

  // Checkpointing.
  checkpoint::SaveOptions save_opts{args.checkpoint.save_dir, args.checkpoint.save_type,
                                    args.checkpoint.keep_last_n_checkpoints};
  checkpoint::SaveContext save_ctx{rank, world, {}, {}};
  if (rt) {
    save_ctx.barrier = [&] { rt->barrier("checkpoint barrier"); };
    save_ctx.all_ok = [&](bool ok) { return !rt->any(!ok, "checkpoint write status"); };
  }
  // Non-finite steps: skipped on the device; counted, and (without a loss
  // scaler) the run stops at the next logging step or save, naming the step.
  auto skipped = torch::zeros({1}, fopts);
  auto first_bad = torch::full({1}, -1.0, fopts);
  auto step_dev = torch::full({1}, static_cast<double>(start_step), fopts);
  auto check_finite = [&]() {
    if (tr.scaler) return;
    const double bad = first_bad.item<double>();
    if (bad >= 0)
      throw std::runtime_error("step " + std::to_string(static_cast<int64_t>(bad)) +
                               ": non-finite loss or gradient norm; the update was skipped and training stops (" +
                               args.precision + " has no loss scaler); the last checkpoint saved is intact");
  };

  checkpoint::SaveStore save_store;
  if (rt) {
    auto store = rt->store();
    save_store.set = [store](const std::string& k, const std::string& v) {
      store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
    };
    save_store.get = [store](const std::string& k) {
      const auto v = store->get(k);
      return std::string(v.begin(), v.end());
    };
  }
  checkpoint::Saver saver(save_opts, save_ctx, args.checkpoint.async_save, save_store,
                          [](const checkpoint::SaveReport& r) {
                            log::info("saved checkpoint " + r.dir + " in " + fmt(r.total_s, 2) + " s (this rank wrote " +
                                      fmt(r.bytes / 1048576.0, 1) + " MiB in " + fmt(r.write_s, 2) + " s)");
                          });
  auto save = [&](int64_t step) {
    if (args.checkpoint.save_dir.empty()) return;
    check_finite();
    auto tensors = tr.state_tensors();
    std::vector<checkpoint::ExtraRngState> extra;
    if (tp_rng) extra.push_back({"tp", tp_rng->state(device)});
    for (auto& t : checkpoint::rng_state_tensors(rank, device, extra)) tensors.push_back(std::move(t));
    nlohmann::json state = {
        {"step", step},
        {"epoch", step * global_batch / std::max<int64_t>(1, train_ds.samples_per_epoch())},
        {"consumed_samples", step * global_batch},
        {"data_cursor", {{"next_step", step}, {"seed", args.seed}, {"global_batch", global_batch}}},
        {"optimizer", {{"type", args.optimizer.type}, {"step_count", tr.optimizer->step_count()}}},
        {"lr_scheduler", {{"type", args.lr_scheduler.type}, {"last_step", step - 1}}},
        {"plan", plan},
        {"model_type", args.model.type},
        {"config", args.resolved_yaml}};
    saver.save(step, tensors, state, nlohmann::json::object());
  };

  auto evaluate = [&](int64_t step) {
    if (!val_ds || args.max_val_steps <= 0) return;
    torch::NoGradGuard no_grad;
    model->eval();
    auto sum = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kFloat32));
    for (int64_t k = 0; k < args.max_val_steps; ++k) {
      auto b = val_ds->val_batch(k, dp_rank * micro, micro);
      sum += model->loss(b.x.to(device), b.y.to(device)).detach().to(torch::kFloat32);
    }
    model->train();
    if (rt) {
      rt->all_reduce(rt->dp, sum, "validation loss all-reduce");
      sum.div_(dp);
    }
    const double val_loss = sum.item<double>() / args.max_val_steps;
    if (rank == 0) {
      log::info("step " + std::to_string(step) + ": val loss " + fmt(val_loss));
      const nlohmann::json rec = {{"step", step}, {"val_loss", val_loss}};
      if (jsonl) jsonl->write(rec);
      if (tb) tb->write(rec);
    }
  };

  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);

  // Batches for step s, micro-step a on this data-parallel rank: positions
  // [(a * dp + dp_rank) * micro, +micro) of the global batch of step s.
  data::PrefetchLoader loader(
      [&](int64_t index) {
        const int64_t s = index / accum, a = index % accum;
        return train_ds.train_batch(s, (a * dp + dp_rank) * micro, micro);
      },
      start_step * accum, args.dataloader.prefetch, device, args.dataloader.pin_memory);

  // Step-time split at logging steps, profiler window, CUDA memory snapshots.
  auto logs_at = [&](int64_t s) { return s % args.log_progress_every_n_train_steps == 0 || s == max_steps; };
  StepTimer timer(device);
  StepProfiler profiler(args.profile, device, rank);
  if (args.memory_snapshot) {
    if (!device.is_cuda())
      throw config::ConfigError("memory_snapshot: true needs a CUDA device, but this run uses " + device.str() +
                                " (on CPU the progress line shows peak RSS)");
    oom.snapshots = std::make_unique<MemorySnapshots>((fs::path(args.run_dir) / "memory").string(), rank,
                                                      args.memory_snapshot_step > 0 ? args.memory_snapshot_step
                                                                                    : start_step + 1);
  }

  auto loss_sum = torch::zeros({}, fopts);
  std::unique_ptr<StepGraph> graph;
  auto grad_norm = torch::zeros({}, fopts);
  auto interval_start = std::chrono::steady_clock::now();
  int64_t interval_steps = 0;
  int64_t step = start_step;
  bool stopped_by_signal = false;
  StopDecision stop_decision(rt.get());

  // One optimizer step on this step's micro-batches, all on the device with no
  // host sync: forward/backward per micro-batch (gradients reduced as buckets
  // fill), unscale, non-finite check, clip, AdamW, loss scaler. With
  // cuda_graphs it is recorded once and replayed (step_graph.h); the learning
  // rate then comes from lr_dev.
  double lr = 0;
  auto lr_dev = torch::zeros({}, fopts);
  bool poison = false;  // NNSTRAIN_TEST_NONFINITE_AT (eager steps only)
  auto train_step = [&](const std::vector<data::Batch>& batches) {
    tr.dp->zero_grad();
    loss_sum.zero_();
    for (int64_t a = 0; a < accum; ++a) {
      tr.dp->begin_micro_step(a == accum - 1);
      timer.enter(StepTimer::kForward);
      auto loss = model->loss(batches[a].x, batches[a].y) / static_cast<double>(accum);
      if (poison) loss = loss * std::numeric_limits<double>::infinity();
      loss_sum += loss.detach().to(torch::kFloat32);
      timer.enter(StepTimer::kBackward);
      (tr.scaler ? loss * tr.scaler->scale() : loss).backward();
    }
    {
      // All on the device, no host sync: unscale, non-finite check, clip, update.
      torch::NoGradGuard no_grad;
      saver.state_may_change();  // an asynchronous save may still be copying the state
      timer.enter(StepTimer::kComm);
      tr.dp->finish_gradients();
      timer.enter(StepTimer::kOptimizer);
      grad_norm = tr.dp->grad_norm();  // identical on every rank (gradients reduced, norm all-reduced)
      auto found_inf = torch::isfinite(grad_norm).logical_not().to(torch::kFloat32).reshape({1});
      at::Tensor coef;
      if (tr.scaler) {
        const auto inv_scale = tr.scaler->scale().reciprocal().reshape({});
        grad_norm = grad_norm * inv_scale;
        coef = inv_scale;
      }
      if (args.optimizer.clip_gnorm > 0) {
        // torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), never up.
        auto clip = torch::clamp_max(args.optimizer.clip_gnorm / (grad_norm + 1e-6), 1.0);
        coef = coef.defined() ? coef * clip : clip;
      }
      if (coef.defined()) tr.dp->scale_gradients(coef);
      tr.optimizer->step(lr, found_inf, graph ? lr_dev : at::Tensor());  // skipped whole where found_inf
      timer.enter(StepTimer::kComm);
      tr.dp->after_optimizer_step();
      timer.enter(StepTimer::kOptimizer);
      if (tr.scaler) tr.scaler->update(found_inf);
      step_dev.add_(1);
      first_bad.copy_(torch::where(found_inf.gt(0) & first_bad.lt(0), step_dev, first_bad));
      skipped.add_(found_inf);
    }
  };

  if (args.compute_config.cuda_graphs) {
    // What a captured step cannot hold yet: host collectives (Gloo) or NCCL
    // capture, and recompute's RNG save/restore. Refused, never ignored.
    if (!device.is_cuda()) throw config::ConfigError("compute_config.cuda_graphs needs a CUDA device");
    if (world > 1) throw config::ConfigError("compute_config.cuda_graphs: several ranks are not supported yet (one GPU only)");
    if (std::count(plan.recompute.begin(), plan.recompute.end(), true) > 0)
      throw config::ConfigError("compute_config.cuda_graphs: activation recompute is not supported with CUDA graphs yet");
    if (tr.optimizer->impl() != "fused")
      throw config::ConfigError("compute_config.cuda_graphs needs optimizer.args.impl fused (or auto)");
    graph = std::make_unique<StepGraph>(train_step, /*warmup=*/3);
  }
  while (step < max_steps) {
    g_running_step.store(step + 1);
    lr = optim::learning_rate(args.lr_scheduler, args.optimizer.lr,
                              args.lr_scheduler.interval == "epoch" ? step / steps_per_epoch : step,
                              args.lr_scheduler.interval == "epoch" ? max_steps / steps_per_epoch : max_steps);
    profiler.before_step(step + 1);
    // A replayed CUDA graph has no parts to time (the timer's calls ran at capture): no split then.
    timer.begin_step(step + 1, !graph && logs_at(step + 1));
    std::vector<data::Batch> batches;
    for (int64_t a = 0; a < accum; ++a) batches.push_back(loader.next());
    if (graph) {
      lr_dev.fill_(lr);
      saver.state_may_change();  // host side: a replayed step does not run train_step's call
      graph->run(batches);
    } else {
      poison = inject_nonfinite(step + 1, rank);
      train_step(batches);
    }
    timer.end_step();
    ++step;
    ++interval_steps;
    profiler.after_step(step);
    if (oom.snapshots) oom.snapshots->after_step(step);

    const bool last = step == max_steps;
    if (step % args.log_progress_every_n_train_steps == 0 || last) {
      if (rt) {
        rt->all_reduce(rt->dp, loss_sum, "loss all-reduce");
        loss_sum.div_(dp);
      }
      const double loss = loss_sum.item<double>();  // the one host sync, at logging steps
      const double gn = grad_norm.item<double>();
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - interval_start).count();
      const double ms_per_step = 1000.0 * secs / interval_steps;
      const double tokens_per_s = interval_steps * global_batch * seq_len / secs;
      nlohmann::json rec = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gn},
                            {"tokens_per_s", tokens_per_s}, {"ms_per_step", ms_per_step},
                            {"peak_mem_mb", peak_memory_bytes(device) / 1048576.0},
                            {"skipped_steps", static_cast<int64_t>(skipped.item<double>())}};
      if (tr.scaler) rec["loss_scale"] = tr.scaler->scale().item<double>();
      check_finite();
      std::string mfu_txt;
      if (peak) {
        const double mfu = flops_per_token * tokens_per_s / (*peak * world);
        rec["mfu"] = mfu;
        mfu_txt = ", mfu " + fmt(100 * mfu, 1) + "%";
      }
      std::string split_txt;
      if (!graph) {
        const auto split = timer.read();  // this (logged) step's parts
        split_txt = ", time";
        for (int p = 0; p < StepTimer::kNumParts; ++p) {
          rec[StepTimer::metric_key(StepTimer::Part(p))] = split[p];
          split_txt += std::string(p ? " / " : " ") + StepTimer::name(StepTimer::Part(p)) + " " + fmt(split[p], 1);
        }
        split_txt += " ms";
      }
      if (rank == 0) {
        if (console)
          log::info("step " + std::to_string(step) + "/" + std::to_string(max_steps) + ": loss " + fmt(loss) +
                    ", lr " + fmt(lr, 6) + ", grad norm " + fmt(gn, 3) + ", " + fmt(tokens_per_s, 0) +
                    " tok/s, " + fmt(ms_per_step, 1) + " ms/step" + mfu_txt + ", peak mem " +
                    fmt(rec["peak_mem_mb"].get<double>(), 0) + " MB" +
                    (tr.scaler ? ", loss scale " + fmt(rec["loss_scale"].get<double>(), 0) + ", skipped " +
                                     std::to_string(rec["skipped_steps"].get<int64_t>())
                               : "") +
                    split_txt);
        if (jsonl) jsonl->write(rec);
        if (tb) tb->write(rec);
      }
      interval_start = std::chrono::steady_clock::now();
      interval_steps = 0;
    }
    if (args.val_every_n_train_steps > 0 && (step % args.val_every_n_train_steps == 0 || last)) evaluate(step);
    const bool periodic = args.checkpoint.every_n_train_steps > 0 && step % args.checkpoint.every_n_train_steps == 0;
    // Every rank stops at the same step if any was asked to (SLURM/PBS preemption).
    const bool stop = stop_decision.after_step(step, g_stop_signal.load() != 0, periodic || last);
    if (stop) {
      log::warn("stop requested (SIGTERM/SIGUSR1): saving and stopping at step " + std::to_string(step));
      stopped_by_signal = true;
    }
    if (periodic || (last && args.checkpoint.save_on_end) || stop) save(step);
    if (stop) break;
  }
  saver.wait();  // the last save is published before the run ends
  if (rank == 0) log::info(stopped_by_signal ? "stopped early on request" : "training done");
  return 0;
}

}  // namespace

int run(const config::TrainerArgs& args, const dist::DistEnv& env, const RunOptions& opts) {
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
