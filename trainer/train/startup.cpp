#include "trainer/train/startup.h"

#include "data/preference_dataset.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "models/common/init.h"
#include "models/registry.h"
#include "trainer/interop/hf_import.h"
#include "trainer/lora/converter.h"
#include "trainer/lora/peft_io.h"
#include "trainer/checkpoint/rng_state.h"
#include "trainer/checkpoint/tensor_io.h"
#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "trainer/dist/device.h"
#include "trainer/pipeline/runtime.h"
#include "models/common/context_attention.h"
#include "trainer/state/context_parallel.h"
#include "trainer/offload/nvme_tier.h"
#include "trainer/state/optimizer_comm.h"
#include "trainer/state/param_units.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/optim/registry.h"
#include "trainer/plan/plan_agreement.h"
#include "trainer/state/tensor_parallel.h"
#include "base/log.h"
#include "trainer/train/run_dir.h"
#include "trainer/train/step_graph.h"

namespace fs = std::filesystem;

namespace nnstrain::train {

namespace {

// A tensor every rank holds whole and identical (loss-scaler state).
sharding::StateTensor replicated(const std::string& name, const at::Tensor& t, int world) {
  auto spec = sharding::ShardSpec::full(name, checkpoint::dtype_name(checkpoint::to_dtype(t.scalar_type())),
                                          t.sizes().vec());
  for (int r = 0; r < world; ++r) spec.replica_ranks.push_back(r);
  return {spec, t};
}

// Per parameter (the model's order): whether it lies inside a transformer block
// (the optimizers' parameter groups by rule).
std::vector<bool> in_blocks(const models::CausalLM& model) {
  const auto units = parallel::parameter_units(model);
  const int blocks = static_cast<int>(model.num_layers());
  std::vector<bool> out;
  for (int u : units) out.push_back(u >= 1 && u <= blocks);
  return out;
}

// The parameters whose optimizer keeps one state tensor instead of AdamW's two
// (its cost hook says which: Muon's matrices).
std::set<std::string> one_state_params(const config::TrainerArgs& args, const models::CausalLM& model) {
  const auto& entry = optim::optimizer_entry(args.optimizer.type);
  if (!entry.cost) return {};
  const auto layouts = model.param_layouts();
  const auto blocks = in_blocks(model);
  std::vector<optim::CostParam> params;
  for (size_t i = 0; i < layouts.size(); ++i) params.push_back({layouts[i].name, layouts[i].global_shape, blocks[i]});
  const auto cost = entry.cost(args.optimizer, params, false);
  std::set<std::string> out;
  for (size_t i = 0; i < params.size() && i < cost.state_tensors.size(); ++i)
    if (cost.state_tensors[i] == 1) out.insert(params[i].name);
  return out;
}

// The training state's options for the plan (units from the model's names under ZeRO-3).
parallel::TrainingStateOptions state_options(const config::TrainerArgs& args, const parallel::Plan& plan,
                                             dist::Runtime* rt, const models::CausalLM& model) {
  const auto prec = optim::precision_setup(args.precision, args.compute_config.reduce_dtype);
  parallel::TrainingStateOptions so;
  so.bucket_cap_mb = args.compute_config.reducer_bucket_cap_mb;
  so.zero_stage = plan.zero_stage;
  if (plan.zero_stage && rt) {
    so.zero_size = rt->zero.size();
    so.zero_rank = rt->zero.rank;
    so.zero_replicas = rt->zero_cross.ranks;
    // Experts: sharded over the ranks of my ZeRO group holding the same ones (at ep 1 as the
    // rest); under HSDP their replicas are the other ZeRO groups' (zero_cross), as the rest's.
    so.expert_zero_size = plan.ep > 1 ? rt->ezero.size() : so.zero_size;
    so.expert_zero_rank = plan.ep > 1 ? rt->ezero.rank : so.zero_rank;
    so.expert_zero_replicas = so.zero_replicas;
  }
  if (plan.ep > 1)  // experts in buckets of their own (at ep 1 they are parameters like the rest)
    for (const auto& l : model.param_layouts()) so.expert.push_back(l.split.style == models::SplitStyle::Expert);
  so.weight_decay = args.optimizer.weight_decay;
  so.param_dtype = prec.param;
  so.grad_dtype = prec.grad;
  so.master_weights = prec.master_weights;
  if (plan.zero_stage == 3) so.units = parallel::parameter_units(model);
  // Under pp no bucket spans two stages and a tied parameter is alone (pipeline_runtime.h).
  if (plan.zero_stage >= 2 && plan.pipeline.pp > 1)
    so.units = parallel::pipeline_units(model, plan.pipeline, rt->pp.rank, plan.zero_stage);
  so.offload_ratio = plan.offload_ratio;  // the plan's: autodist may have chosen it
  so.offload_params = plan.offload_params;
  so.offload_delayed = plan.offload_ratio > 0 && args.compute_config.offload.delayed_update;
  if (plan.offload_ratio > 0) so.one_state = one_state_params(args, model);
  return so;
}

// The pipeline's executor for this rank, after refusing what it cannot run yet.
std::unique_ptr<parallel::PipelineExecutor> make_pipeline(const config::TrainerArgs& args, const parallel::Plan& plan,
                                                          const parallel::PipelinePlan& pipe,
                                                          models::CausalLM& model, dist::Runtime& rt,
                                                          parallel::TrainingState& state,
                                                          parallel::GradientReducer& reducer,
                                                          const torch::Device& device) {
  const std::string key = "compute_config.pas_config.pp_size";
  if (args.compute_config.cuda_graphs == "true")
    throw config::ConfigError(key + ": pipeline parallelism cannot be captured in a CUDA graph "
                              "(compute_config.cuda_graphs: false)");
  parallel::PipelineExecutor::Options o;
  o.device = device;
  o.activation_dtype = optim::precision_setup(args.precision, args.compute_config.reduce_dtype).param;
  o.hidden = model.dims().hidden;
  o.sequence_divisor = plan.tp > 1 && args.compute_config.sequence_parallel ? plan.tp : 1;
  o.post_validation = args.compute_config.pipeline.post_validation;
  auto p = std::make_unique<parallel::PipelineExecutor>(model, pipe, rt, state, reducer, o);
  std::string layers;
  for (size_t s = 0; s < pipe.stage_layers.size(); ++s)
    layers += (s ? " " : "") + std::to_string(pipe.stage_layers[s]);
  log::info("pipeline: " + pipe.scheduler + ", " + std::to_string(pipe.stages) + " stages over pp " +
            std::to_string(pipe.pp) + " ranks, " + std::to_string(pipe.nmicros) +
            " micro-batches per step, layers per stage " + layers + "; this rank is pipeline rank " +
            std::to_string(rt.pp.rank) +
            (o.post_validation ? "; optimizer post-validation: " + std::to_string(p->prefix_length()) +
                                     " actions of the next step before validating"
                               : std::string()));
  return p;
}

// The registered optimizer optimizer.type names, over the state's segments.
std::unique_ptr<optim::Optimizer> make_optimizer(const config::TrainerArgs& args, const parallel::Plan& plan,
                                                 const models::CausalLM& model, const parallel::TrainingState& state,
                                                 dist::Runtime* rt, const torch::Device& device) {
  const auto& entry = optim::optimizer_entry(args.optimizer.type);
  optim::OptimizerContext c;
  c.args = &args.optimizer;
  c.segments = state.optimizer_segments();
  c.specs = state.segment_specs("");
  c.cuda = device.is_cuda();
  c.whole_model = plan.pipeline.pp == 1;
  const auto layouts = model.param_layouts();
  const auto blocks = in_blocks(model);
  for (size_t i = 0; i < layouts.size(); ++i) c.params.push_back({layouts[i].name, layouts[i].global_shape, blocks[i]});
  if (entry.whole_matrices) {
    const std::string key = "optimizer.type: " + args.optimizer.type;
    if (args.compute_config.offload.delayed_update)
      throw config::ConfigError(key + " gathers whole matrices in its step, which a delayed (background) host "
                                "step cannot; set compute_config.offload.delayed_update: false");
    if (args.compute_config.offload.optimizer_nvme && plan.offload_ratio > 0)
      throw config::ConfigError(key + " keeps its momentum on the host tier only; compute_config.offload.optimizer: "
                                "nvme is not supported with it (use true)");
    if (args.compute_config.cuda_graphs == "true")
      throw config::ConfigError(key + " makes host decisions and collectives in its step, which a CUDA graph "
                                "cannot capture; set compute_config.cuda_graphs: false");
    c.comm = parallel::make_optimizer_comm(rt, device);
  }
  return entry.build(std::move(c));
}

}  // namespace

std::vector<sharding::StateTensor> Trainable::state_tensors() {
  auto out = state->weight_state();
  // The NVMe tier: the offloaded segments' weights and moments are read from
  // (or loaded into) the files, mapped, never whole in host memory.
  auto* nvme = state->nvme();
  std::vector<std::array<at::Tensor, 3>> in_file(optimizer->segments().size());
  if (nvme) {
    nvme->map_for_checkpoint();
    for (size_t b = 0; b < state->host_buckets(); ++b) {
      for (auto i : state->bucket_segments(b)) {
        const auto& sg = optimizer->segments()[i];
        // Where the segment lies within its bucket: where its view lies in the bucket's slot.
        const int64_t at = (static_cast<const char*>(sg.param.data_ptr()) -
                            static_cast<const char*>(nvme->weights(b).data_ptr())) / sg.param.element_size();
        for (int part = 0; part < 3; ++part)
          in_file[i][part] = nvme->file_view(b, part).narrow(0, at, sg.param.numel()).view(sg.param.sizes());
      }
    }
    const bool weights_are_segments = state->options().master_weights || state->options().zero_stage == 3;
    for (size_t i = 0; weights_are_segments && i < in_file.size(); ++i)
      if (in_file[i][0].defined()) out[i].tensor = in_file[i][0];
  }
  // The optimizer's state, segment by segment (AdamW: optim/exp_avg/<param>
  // and optim/exp_avg_sq/<param>; Muon's matrices: optim/momentum_buffer/<param>).
  const auto specs = state->segment_specs("");
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto st = optimizer->state(i);
    for (size_t j = 0; j < st.size(); ++j) {
      auto spec = specs[i];
      spec.name = "optim/" + st[j].first + "/" + spec.name;
      out.push_back({spec, j < 2 && in_file[i][1 + j].defined() ? in_file[i][1 + j] : st[j].second});
    }
  }
  if (scaler) {
    out.push_back(replicated("amp/scale", scaler->scale(), world));
    out.push_back(replicated("amp/growth_tracker", scaler->growth_tracker(), world));
  }
  for (auto& t : moe->state(moe_holders)) out.push_back(std::move(t));
  if (auto id = lora::base_identity_tensor(); id.defined()) out.push_back(replicated(lora::kBaseIdentityName, id, world));
  return out;
}

void Trainable::after_optimizer_step() {
  state->refresh_compute_copy();
  reducer->gather_params();
}

void Trainable::optimizer_step(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device) {
  if (state->host_buckets() == 0) {
    optimizer->step(lr, found_inf, lr_device);  // (begin_step included)
    after_optimizer_step();
    return;
  }
  if (delayed_update) {
    // The host reads the flag (on a GPU: the one wait for the device the host
    // step needs anyway), then steps in the background; flush puts the result on the device.
    const auto inf = found_inf.defined() ? found_inf.to(torch::kCPU) : at::Tensor();
    pending_update = std::async(std::launch::async, [this, lr, inf] {
      for (size_t b = 0; b < state->host_buckets(); ++b) optimizer->step(lr, inf, {}, state->bucket_segments(b));
    });
    return;
  }
  optimizer->begin_step(found_inf);
  // Offload: the host step bucket by bucket, each bucket's weights leaving for
  // the device (copy stream) while the next is stepped; then the device's share.
  // The NVMe tier: each bucket read into its slot (the next one's read issued
  // meanwhile) and written back after its step, overlapping the next bucket's.
  for (size_t b = 0; b < state->host_buckets(); ++b) {
    state->nvme_acquire(b);
    const auto segs = state->bucket_segments(b);
    if (!segs.empty()) optimizer->step(lr, found_inf, {}, segs);  // (an empty subset would mean all)
    state->refresh_bucket(b);
    state->nvme_release(b, true);
  }
  const auto on_device = state->device_segments();
  if (!on_device.empty()) optimizer->step(lr, found_inf, lr_device, on_device);
  for (size_t b = state->host_buckets(); b < state->layout().buckets.size(); ++b) state->refresh_bucket(b);
  state->finish_refresh();
  state->nvme_finish();
  reducer->gather_params();
}

void Trainable::before_norm() {
  if (!delayed_update) return;
  flush();
  state->promote_host_grads();
}

void Trainable::flush() {
  if (!pending_update.valid()) return;
  pending_update.get();  // rethrows what the host step threw
  for (size_t b = 0; b < state->host_buckets(); ++b) state->refresh_bucket(b);
  state->finish_refresh();
  reducer->gather_params();
}

void Trainable::after_load() {
  if (state->nvme()) state->nvme()->after_checkpoint_load();  // what the load wrote through the mapping
  state->pull_host_weights();
  after_optimizer_step();
}

parallel::StateBytes Trainable::held_bytes() {
  auto b = state->held_bytes();
  for (size_t i = 0; i < optimizer->segments().size(); ++i)
    if (!state->segment_on_host(i))
      for (const auto& [name, t] : optimizer->state(i)) b.moments += double(t.nbytes());
  return b;
}

parallel::StateBytes Trainable::held_bytes_per_param() {
  int64_t n = 0;
  for (const auto& p : state->params()) n += p.tensor.numel();
  const auto b = held_bytes();
  const double per = 1.0 / double(std::max<int64_t>(1, n));
  return {b.param * per, b.grad * per, b.master * per, b.moments * per};
}

std::vector<sharding::StateTensor> Trainable::rng_state_tensors(int rank, const torch::Device& device) {
  std::vector<checkpoint::ExtraRngState> extra;
  if (tp_rng) extra.push_back({"tp", tp_rng->state(device)});
  return checkpoint::rng_state_tensors(rank, device, extra);
}

void Trainable::restore_rng_state(const checkpoint::Checkpoint& ck, int rank, const torch::Device& device) {
  std::vector<checkpoint::ExtraRngState> extra;
  if (tp_rng) extra.push_back({"tp", tp_rng->state(device)});
  checkpoint::restore_rng_state(ck, rank, device, &extra);
  if (tp_rng) tp_rng->set_state(device, extra[0].state);
}

torch::Device start_rank(const config::TrainerArgs& args, const dist::DistEnv& env) {
  log::init(env.rank, env.world_size);
  fs::create_directories(fs::path(args.run_dir) / "logs");
  log::add_file(rank_log_path(args.run_dir, env.rank));
  const torch::Device device = dist::bind_device(args.compute_config.device, env);
  dist::set_allow_tf32(args.compute_config.allow_tf32);
  // CUDA graphs: the run works on a non-default stream from here on (step_graph.h),
  // wherever a graph may be captured (auto decides once the plan is known): one
  // rank, or several over NCCL.
  if (args.compute_config.cuda_graphs != "false" && device.is_cuda() &&
      (env.world_size == 1 || args.compute_config.backend != "gloo"))
    use_capture_stream(device);
  return device;
}

std::shared_ptr<models::CausalLM> describe_model(const config::TrainerArgs& args) {
  return models::find_model(args.model.type)->build_sharded(*args.model.args, parallel::sharding_context(nullptr));
}

LocalModel materialise_model(const config::TrainerArgs& args, const parallel::Plan& plan, dist::Runtime* rt,
                             const torch::Device& device, int64_t vocab) {
  auto ctx = parallel::sharding_context(rt, args.model.make_vocab_size_divisible_by, args.seed,
                                        args.compute_config.sequence_parallel);
  if (plan.context.cp > 1) {  // each rank holds its slice of every sequence (trainer.cpp cuts the batches)
    ctx.cp_comm = parallel::make_cp_comm(*rt);
    ctx.cp_comm_type = models::common::parse_cp_comm_type(plan.context.comm_type);
    ctx.cp_layout = models::common::parse_cp_layout(plan.context.load_balance);
  }
  if (plan.ep > 1) {  // this rank's experts of every MoE layer; tokens to the others' by all-to-all
    ctx.ep = plan.ep;
    ctx.ep_rank = rt->ep.rank;
    ctx.ep_comm = parallel::make_ep_comm(*rt, device);
  }
  const int64_t padded = ctx.padded_vocab(vocab);
  if (ctx.tp > 1 && padded / ctx.tp * (ctx.tp - 1) >= vocab)
    throw config::ConfigError("model.make_vocab_size_divisible_by " + std::to_string(args.model.make_vocab_size_divisible_by) +
                              ": padding the vocabulary of " + std::to_string(vocab) + " to " + std::to_string(padded) +
                              " leaves tensor-parallel rank " + std::to_string(ctx.tp - 1) + " no rows; lower it");
  LocalModel local{models::find_model(args.model.type)->build_sharded(*args.model.args, ctx), ctx.rng, {}};
  // Pipeline parallelism: this rank's stages only; the rest stay on meta.
  if (plan.pipeline.pp > 1) parallel::hold_stages(*local.model, plan.pipeline, rt->pp.rank);
  // ZeRO-3: each parameter, once filled, gives up this rank's chunks and its
  // storage before the next is allocated, so no rank ever holds the whole model.
  models::common::Filler after;
  std::shared_ptr<parallel::FlatLayout> layout;
  size_t next = 0;
  if (plan.zero_stage == 3 && !args.lora.enabled) {  // under LoRA the state holds the adapters alone, made after this
    std::vector<int64_t> numels;
    for (const auto& l : local.model->param_layouts()) {
      int64_t n = 1;
      for (auto d : l.local_shape) n *= d;
      numels.push_back(n);
    }
    layout = std::make_shared<parallel::FlatLayout>(
        parallel::TrainingState::layout_for(numels, state_options(args, plan, rt, *local.model)));
    local.initial_chunks = torch::zeros({layout->shard_size}, torch::TensorOptions().device(device));
    after = [&](const models::common::ParamLayout&, at::Tensor& t) {
      parallel::TrainingState::move_into_chunks(*layout, next++, t, local.initial_chunks);
    };
  }
  if (!args.model.init_from.empty()) {
    const auto r = interop::load_hf_weights(*local.model, args.model.init_from, device, after);
    log::info("initialised weights from " + args.model.init_from + " (this rank read " +
              std::to_string(r.bytes_read >> 20) + " of " + std::to_string(r.bytes_needed >> 20) + " MiB)");
  } else {
    models::common::materialise_fresh(*local.model, device, args.seed, after);
  }
  if (args.lora.enabled) {  // adapters on the filled base, which freezes (trainer/lora/converter.h)
    lora::apply_lora(*local.model, args.lora, ctx, device,
                     optim::precision_setup(args.precision, args.compute_config.reduce_dtype).param, args.seed,
                     args.model.init_from);
    if (plan.pipeline.pp > 1) parallel::hold_stages(*local.model, plan.pipeline, rt->pp.rank);  // with their adapters
  }
  return local;
}

// Expert parallelism against the model and the plan: one line naming the key.
static void check_expert_parallel(const config::TrainerArgs& args, const parallel::Plan& plan, const models::CausalLM& model) {
  const int ep = plan.ep;
  int64_t experts = 0;
  std::string where;
  for (const auto& l : model.param_layouts())
    if (l.split.style == models::SplitStyle::Expert && experts == 0) experts = l.global_shape.at(0), where = l.name;
  if (ep == 1) return;
  const std::string key = "compute_config.expert_parallel_size " + std::to_string(ep);
  if (experts == 0)
    throw config::ConfigError(key + ": model '" + args.model.type + "' has no experts (expert parallelism needs an MoE model)");
  if (experts % ep != 0)
    throw config::ConfigError(key + " does not divide the " + std::to_string(experts) + " experts of '" + where + "'");
  const int dpcp = plan.dp * plan.context.cp;
  if (dpcp % ep != 0)
    throw config::ConfigError(key + " does not divide dp x cp = " + std::to_string(plan.dp) + " x " +
                              std::to_string(plan.context.cp) + " (experts split over ranks that hold different samples)");
  if (plan.zero_stage && plan.zero_ngroups > 1 && (dpcp / plan.zero_ngroups) % ep != 0)
    throw config::ConfigError(key + " does not divide the ZeRO group of " + std::to_string(dpcp / plan.zero_ngroups) +
                              " ranks (dp x cp / compute_config.zero_ngroups " + std::to_string(plan.zero_ngroups) +
                              "): HSDP needs each expert-parallel slice inside one ZeRO group");
}

Agreed decide_plan(const config::TrainerArgs& args, const dist::DistEnv& env, const models::CausalLM& model,
                   const torch::Device& device, std::chrono::milliseconds timeout) {
  const auto& pipe = args.compute_config.pipeline;
  if (pipe.pp_size > 1) {
    // Refused on every rank alike, before the ranks agree on a plan.
    if (env.world_size % pipe.pp_size != 0)
      throw config::ConfigError("compute_config.pas_config.pp_size: " + std::to_string(pipe.pp_size) +
                                " pipeline ranks, but this run has " + std::to_string(env.world_size) + " rank" +
                                (env.world_size == 1 ? "" : "s"));
    // Under autodist the micro-batches per flush are the plan's (the planner
    // checks them with the schedule); the layers and stages are checked here
    // with a count every scheduler takes (a multiple of pp, above the stages).
    const int64_t any = 4 * pipe.pp_size * std::max<int64_t>({1, pipe.nstages, int64_t(pipe.layers.size())});
    const int64_t micros = args.pas_policy != "autodist" ? args.grad_accumulation_steps
                           : pipe.nmicros > 0            ? pipe.nmicros
                                                         : any;
    parallel::pipeline_plan(pipe, micros, model.num_layers());
  }
  const int cp = args.compute_config.context_parallel_size;
  if (env.world_size % cp != 0)  // a one-process launch is not refused at load
    throw config::ConfigError("compute_config.context_parallel_size " + std::to_string(cp) +
                              " does not divide the " + std::to_string(env.world_size) +
                              " processes launched (world size)");
  parallel::PlanRequest req;
  req.args = &args;
  req.model = &model;
  req.world_size = env.world_size;
  req.device = parallel::device_spec(device.is_cuda() ? "auto" : "cpu");
  req.memory_budget_bytes = args.compute_config.memory_budget_gb * 1073741824.0;
  // Autodist chooses pp and cp as `nnstrain plan` does (a size the config names stays).
  req.search_pipeline = req.search_context = true;
  if (args.lora.enabled) {  // the frozen base and the adapters, as apply_lora will leave them
    const auto base = optim::precision_setup(args.precision, args.compute_config.reduce_dtype).param;
    req.adjust_facts = [&args, &model, base](parallel::ModelFacts& f) { lora::lora_plan_facts(model, args.lora, base, f); };
  }
  Agreed a{{}, req.device, nullptr};
  if (env.world_size > 1) a.store = dist::rendezvous(env, timeout);
  try {
    a.plan = a.store ? parallel::agree_plan(req, *a.store, env.rank, env.world_size, timeout) : parallel::make_plan(req);
  } catch (const parallel::PlanError& e) {
    if (e.config) throw config::ConfigError(e.what());  // the batch arithmetic: exit 2 as at load
    throw;
  }
  check_expert_parallel(args, a.plan, model);
  if (a.plan.pipeline.pp > 1) {
    // The dry run under the rules of the backend users run (NCCL): a schedule
    // that would hang or mis-pair its messages there is refused here, on every
    // rank alike, before any process group exists.
    try {
      parallel::check_transfers(a.plan.pipeline, !model.head_ties().empty(),
                                args.compute_config.pipeline.post_validation);
    } catch (const parallel::pipeline::BackendRuleError& e) {
      log::error(e.what());  // the line and the grid
      throw config::ConfigError("compute_config.pas_config.pipeline_scheduler: " + e.line);
    }
  }
  log::info("plan (" + args.pas_policy + "): " + parallel::plan_summary(a.plan));
  return a;
}

std::unique_ptr<dist::Runtime> connect(const config::TrainerArgs& args, const dist::DistEnv& env, const Agreed& a,
                                       const torch::Device& device, std::chrono::milliseconds timeout) {
  // ZeRO-2/3 at one rank still runs its collectives (one-rank groups), so that
  // one GPU checks the code many ranks run; anything else at one rank has none.
  if (env.world_size == 1 && a.plan.zero_stage < 2) return nullptr;
  dist::RuntimeOptions o;
  o.one_rank_backend = env.world_size == 1;
  o.tp = a.plan.tp;
  o.pp = a.plan.pipeline.pp;
  o.pp_validation = args.compute_config.pipeline.post_validation && o.pp > 1;
  o.stage = optim::optimizer_entry(args.optimizer.type).whole_matrices;
  o.cp = a.plan.context.cp;
  o.ep = a.plan.ep;
  o.zero_ngroups = a.plan.zero_stage ? a.plan.zero_ngroups : 1;
  o.backend = args.compute_config.backend;
  o.cuda = device.is_cuda();
  o.timeout = timeout;
  o.flight_size = static_cast<size_t>(args.fault_tolerance.flight_recorder_size);
  o.flight_path = (fs::path(args.run_dir) / "flight" / ("rank" + std::to_string(env.rank) + ".json")).string();
  return std::make_unique<dist::Runtime>(env, o, a.store);
}

Trainable make_trainable(const config::TrainerArgs& args, const parallel::Plan& plan, const LocalModel& local,
                         dist::Runtime* rt, const dist::DistEnv& env, const torch::Device& device) {
  auto& model = *local.model;
  models::RuntimeOptions ro;
  const auto loss = config::resolved_loss(args.model, int64_t(args.micro_batch_size) * plan.seq_len);
  ro.loss = loss == "fused"     ? models::common::LossKind::Fused
            : loss == "chunked" ? models::common::LossKind::Chunked
                                : models::common::LossKind::Plain;
  ro.loss_chunk_size = args.model.loss_chunk_size;
  log::info("LM head loss: " + loss +
            (loss == "plain" ? "" : " (chunks of " + std::to_string(args.model.loss_chunk_size) + " tokens)") +
            (args.model.loss == "auto" ? ", chosen by model.loss: auto" : ""));
  ro.recompute_layers = plan.recompute;
  model.set_runtime_options(ro);
  model.train();
  // Dropout streams differ between data-parallel replicas and agree within a
  // tensor-parallel group, so replicated regions draw the same masks there.
  torch::manual_seed(args.seed + 1000003ULL * static_cast<uint64_t>(env.rank / plan.tp));

  const auto prec = optim::precision_setup(args.precision, args.compute_config.reduce_dtype);
  auto so = state_options(args, plan, rt, model);
  so.initial_chunks = local.initial_chunks;
  const auto& off = args.compute_config.offload;
  if (off.optimizer_nvme && plan.offload_ratio > 0) {  // the NVMe tier (nvme_tier.h)
    so.nvme_path = off.nvme_path;
    so.nvme_io = off.nvme_io;
    so.nvme_rank = env.rank;
    so.nvme_buffer_bytes = static_cast<int64_t>(off.nvme_buffer_mb * 1048576.0);
    so.nvme_params = off.params_nvme && plan.offload_params;
  }
  Trainable tr;
  tr.world = env.world_size;
  tr.tp_rng = local.tp_rng;
  auto shards = parallel::tensor_parallel_shards(model, rt, env.world_size);
  if (plan.pipeline.pp > 1) parallel::pipeline_replicas(shards, model, plan.pipeline, *rt, env.world_size);
  const int blocks = static_cast<int>(model.num_layers());
  tr.state = std::make_unique<parallel::TrainingState>(std::move(shards), so);
  tr.reducer = std::make_unique<parallel::GradientReducer>(*tr.state, rt, blocks, args.compute_config.zero_prefetch);
  tr.optimizer = make_optimizer(args, plan, model, *tr.state, rt, device);
  tr.moe = std::make_unique<MoeMonitor>(model, rt);
  for (int r = 0; r < env.world_size; ++r)  // under pp: the ranks of this rank's stage
    if (plan.pipeline.pp == 1 || (r / (plan.tp * plan.context.cp)) % plan.pipeline.pp == rt->pp.rank)
      tr.moe_holders.push_back(r);
  tr.delayed_update = so.offload_delayed;
  if (prec.loss_scaling) tr.scaler.emplace(args.loss_scaler, torch::TensorOptions().device(device).dtype(torch::kFloat32));
  // Under pp the executor, not the block hooks, gathers ZeRO-3's units (once per step).
  if (plan.pipeline.pp > 1) {
    tr.pipeline_plan = plan.pipeline;
    tr.pipeline = make_pipeline(args, plan, tr.pipeline_plan, model, *rt, *tr.state, *tr.reducer, device);
  }
  ro.block_hooks = tr.reducer->block_hooks();
  model.set_runtime_options(ro);
  if (args.lora.enabled && so.zero_stage == 3 && plan.pipeline.pp == 1) {
    // ZeRO-3 shards LoRA's frozen base with the units (gathered for compute,
    // never reduced); experts under ep > 1 stay whole (their group is not the ZeRO group).
    std::vector<std::pair<int, at::Tensor>> frozen;
    for (const auto& f : lora::frozen_base(model)) {
      if (f.expert && rt && rt->ep.size() > 1) continue;
      const int b = model.block_of(f.name);
      frozen.emplace_back(b >= 0 ? 1 + b : 0, f.tensor);  // outside the blocks: with unit 0, gathered all step
    }
    tr.reducer->shard_frozen(frozen);
  }
  return tr;
}

namespace {

std::string lr_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// lr_scheduler.type wsd against the run's length, now that an epoch's steps are
// known (the loader checked what the config alone gives), and its phases logged.
void check_wsd_schedule(const config::TrainerArgs& args, const Data& d) {
  const auto& s = args.lr_scheduler;
  if (s.type != "wsd") return;
  const bool by_epoch = s.interval == "epoch";
  const int64_t total = by_epoch ? d.max_steps / d.steps_per_epoch : d.max_steps;
  const std::string per_epoch = std::to_string(d.steps_per_epoch) + " steps per epoch";
  const std::string from = args.max_train_steps > 0
                               ? "max_train_steps " + std::to_string(args.max_train_steps) + (by_epoch ? " / " + per_epoch : "")
                               : "max_epochs " + std::to_string(args.max_epochs) + (by_epoch ? "" : " x " + per_epoch);
  config::check_wsd_fits(s, total, from);
  const int64_t decay = config::wsd_decay_length(s, total);
  const std::string unit = by_epoch ? "epoch" : "step";
  log::info("lr_scheduler wsd: warmup " + std::to_string(s.warmup_steps) + ", stable at " + lr_text(args.optimizer.lr) +
            ", " + s.decay_type + " decay from " + unit + " " + std::to_string(total - decay + 1) + " to " +
            std::to_string(total) + " towards min_lr " + lr_text(s.min_lr));
}

// A resume may change the schedule: a WSD annealing branch resumes a
// stable-phase checkpoint with a new decay_steps and max_train_steps. Its lr
// at the checkpoint's last step is then the one that step trained with (the
// stable lr), so the run continues without a jump. A schedule whose decay
// already began before the checkpoint's step while the saved run was elsewhere
// is a decay that does not fit the resumed run: refused. Any other change in
// the lr there (a longer cosine, a new optimizer.args.lr) is warned about.
void check_schedule_continues(const config::TrainerArgs& args, const Data& data, const nlohmann::json& st,
                              const std::string& dir, int rank) {
  if (!st.contains("lr_scheduler") || !st["lr_scheduler"].contains("lr")) return;  // saved before lr was recorded
  const int64_t last = st["lr_scheduler"].value("last_step", int64_t{-1});
  if (last < 0) return;
  const double saved = st["lr_scheduler"]["lr"].get<double>();
  const auto& s = args.lr_scheduler;
  const double now = optim::learning_rate_at_step(s, args.optimizer.lr, last, data.max_steps, data.steps_per_epoch);
  if (std::abs(now - saved) <= 1e-9 * std::max(std::abs(now), std::abs(saved))) return;
  const std::string jump = dir + " trained step " + std::to_string(last + 1) + " at lr " + lr_text(saved) +
                           ", where this config's schedule has " + lr_text(now);
  if (s.type == "wsd") {
    const bool by_epoch = s.interval == "epoch";
    const int64_t total = by_epoch ? data.max_steps / data.steps_per_epoch : data.max_steps;
    const int64_t start = total - config::wsd_decay_length(s, total);  // the decay's first iteration
    const int64_t next = by_epoch ? (last + 1) / data.steps_per_epoch : last + 1;
    if (start < next) {
      const std::string key = s.decay_steps > 0 ? "decay_steps" : "decay_ratio";
      throw config::ConfigError(
          "lr_scheduler.args." + key + ": the decay would start at " + (by_epoch ? "epoch " : "step ") +
          std::to_string(start + 1) + ", before the resumed " + (by_epoch ? "epoch " : "step ") +
          std::to_string(next + 1) + " (" + jump + "); an annealing branch starts its decay at or after the " +
          "checkpoint's step");
    }
  }
  if (rank == 0) log::warn("lr_scheduler: " + jump + "; the lr jumps at the resume");
}

}  // namespace

Data open_data(const config::TrainerArgs& args, const models::CausalLM& model, const parallel::Plan& plan) {
  Data d;
  if (args.dataset.type == "preference") {
    auto train = std::make_unique<data::PreferenceDataset>(args.dataset.preference_train, args.seed,
                                                           args.global_batch_size, "dataset.train_args");
    train->check_vocab(model.vocab_size());
    d.train = std::move(train);
    if (args.dataset.preference_val) {  // in the file's order (val_batch), whatever shuffle says
      auto val = std::make_unique<data::PreferenceDataset>(*args.dataset.preference_val, 0, args.global_batch_size,
                                                           "dataset.val_args");
      val->check_vocab(model.vocab_size());
      d.val = std::move(val);
    }
  } else if (args.dataset.type == "indexed") {
    auto train = std::make_unique<data::IndexedDataset>(args.dataset.indexed_train, args.seed, args.global_batch_size,
                                                        "dataset.train_args");
    train->check_vocab(model.vocab_size());
    d.train = std::move(train);
    if (args.dataset.indexed_val) {
      // Validation is independent of the seed: a stream of its own with seed 0.
      auto val = std::make_unique<data::IndexedDataset>(*args.dataset.indexed_val, 0, args.global_batch_size,
                                                        "dataset.val_args");
      val->check_vocab(model.vocab_size());
      d.val = std::move(val);
    }
  } else {
    auto train = std::make_unique<data::TokenBinDataset>(args.dataset.train_args, args.seed);
    data::check_token_ids(train->file(), model.vocab_size(), "dataset.train_args.path");
    d.train = std::move(train);
    if (args.dataset.val_args) {
      auto val = std::make_unique<data::TokenBinDataset>(*args.dataset.val_args, args.seed);
      data::check_token_ids(val->file(), model.vocab_size(), "dataset.val_args.path");
      d.val = std::move(val);
    }
  }
  // Sequence parallelism splits each rank's tokens (seq_len / cp of every sequence) over the tensor-parallel ranks.
  const int tp = plan.tp, cp = plan.context.cp;
  for (const auto* ds : {d.train.get(), d.val.get()})
    if (ds && tp > 1 && args.compute_config.sequence_parallel && ds->seq_len() / cp % tp != 0)
      throw config::ConfigError("compute_config.sequence_parallel: the sequence of " + std::to_string(ds->seq_len()) +
                                " tokens (dataset." + (ds == d.train.get() ? "train" : "val") + "_args.seq_len)" +
                                (cp > 1 ? " / context_parallel_size " + std::to_string(cp) : std::string()) +
                                " is not divisible by tp " + std::to_string(tp) + "; set it to false or change seq_len");
  d.seq_len = d.train->seq_len();
  if (d.seq_len > model.max_seq_len())
    throw config::ConfigError("dataset.train_args.seq_len " + std::to_string(d.seq_len) +
                              " exceeds the model's maximum sequence length " + std::to_string(model.max_seq_len()));
  // One epoch = samples_per_epoch samples (docs/data.md), in whole steps.
  d.steps_per_epoch = std::max<int64_t>(1, d.train->samples_per_epoch() / args.global_batch_size);
  d.max_steps = args.max_train_steps > 0 ? args.max_train_steps : args.max_epochs * d.steps_per_epoch;
  check_wsd_schedule(args, d);
  return d;
}

std::string resume(const config::TrainerArgs& args, const RunOptions& opts, Trainable& tr, const Data& data, int rank,
                   const torch::Device& device, int64_t* step) {
  *step = 0;
  std::string dir = opts.resume.empty() ? args.checkpoint.resume_from : opts.resume;
  if (dir == "last") {
    if (args.checkpoint.save_dir.empty()) throw config::ConfigError("--resume without a path needs checkpoint.save_dir");
    dir = checkpoint::latest(args.checkpoint.save_dir);
    if (dir.empty()) log::warn("no checkpoint under " + args.checkpoint.save_dir + " yet: starting fresh");
  }
  if (dir.empty()) return dir;
  checkpoint::Checkpoint ck(dir);
  const auto& st = ck.state();
  if (st.value("model_type", "") != args.model.type)
    throw checkpoint::CheckpointError(dir + ": checkpoint of model type '" + st.value("model_type", "") +
                                      "', but this run trains '" + args.model.type + "'");
  // The optimizer's state is its own (AdamW's moments, Muon's momentum): no conversion between them.
  const std::string saved_optimizer = st.contains("optimizer") ? st["optimizer"].value("type", "adamw") : "adamw";
  if (saved_optimizer != args.optimizer.type)
    throw config::ConfigError("optimizer.type: " + args.optimizer.type + ", but " + dir + " holds the state of " +
                              saved_optimizer + "; resume with optimizer.type " + saved_optimizer +
                              " (or merge it with nnstrain merge --hf and start from its weights: model.init_from)");
  check_schedule_continues(args, data, st, dir, rank);
  lora::check_resume_base(dir);  // a LoRA run resumes only on the base its adapters were trained on
  torch::NoGradGuard no_grad;
  for (auto& t : tr.state_tensors()) {
    if (t.spec.name == lora::kBaseIdentityName) continue;  // checked above
    // A checkpoint saved without a loss scaler (another precision) keeps the fresh scale.
    if (t.spec.name.rfind("amp/", 0) == 0 && !ck.has(t.spec.name)) continue;
    ck.load_into(t);
  }
  tr.after_load();  // the compute copy from the loaded (master) weights
  *step = st.at("step").get<int64_t>();
  tr.optimizer->set_step_count(st.at("optimizer").at("step_count").get<int64_t>());
  tr.restore_rng_state(ck, rank, device);
  log::info("resumed from " + dir + " at step " + std::to_string(*step));
  return dir;
}

}  // namespace nnstrain::train
