#include "trainer/align/alignment.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>

#include "base/config/arg_map.h"
#include "base/log.h"
#include "data/preference_dataset.h"
#include "data/sha256.h"
#include "models/lora/lora_linear.h"
#include "models/model.h"
#include "trainer/align/preference_loss.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/dist/process_groups.h"
#include "trainer/plan/plan.h"

namespace fs = std::filesystem;

namespace nnstrain::align {

namespace {
// Under context parallelism each rank holds a slice of every row: its partial
// sums are summed over the cp group in forward, and so are their gradients in
// backward. Every cp rank then computes the same loss with weight 1/cp of its
// pairs (the trainer's count is all-reduced over dp x cp), and summing the
// incoming gradient over the group restores each rank's share of d loss / d sum.
// The collectives run in the same order on every cp rank (the same graph), as NCCL needs.
class CpRowSum : public torch::autograd::Function<CpRowSum> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t rt) {
    ctx->saved_data["rt"] = rt;
    auto y = x.contiguous().clone();
    auto* r = reinterpret_cast<dist::Runtime*>(rt);
    r->all_reduce(r->cp, y, "alignment row sums over cp");
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto* r = reinterpret_cast<dist::Runtime*>(ctx->saved_data["rt"].toInt());
    auto y = g[0].contiguous().clone();
    r->all_reduce(r->cp, y, "alignment row-sum gradients over cp");
    return {y, torch::Tensor()};
  }
};
}  // namespace

// The objective the heads run: the policy's preference loss, or (collect) a
// reference pass that only keeps each row's summed log-probabilities.
class PreferenceObjective : public models::common::SequenceObjective {
 public:
  PreferenceObjective(const config::AlignmentArgs& a, bool collect, dist::Runtime* cp_rt)
      : a_(a), collect_(collect), cp_rt_(cp_rt) {}

  // Per row over its whole sequence (summed over the cp ranks' slices).
  at::Tensor row_sum(const at::Tensor& t, bool grad) const {
    if (segments.defined()) {  // packed: [chosen of each row; rejected of each row], as two rows would give
      const auto seg = segments.to(t.device());
      return torch::cat({(t * seg.eq(0).to(t.scalar_type())).sum(1), (t * seg.eq(1).to(t.scalar_type())).sum(1)});
    }
    auto r = t.sum(1);
    if (!cp_rt_) return r;
    if (grad) return CpRowSum::apply(r, reinterpret_cast<int64_t>(cp_rt_));
    auto y = r.detach().contiguous().clone();
    cp_rt_->all_reduce(cp_rt_->cp, y, "alignment row statistics over cp");
    return y;
  }

  at::Tensor loss(const models::common::TokenScores& s) override {
    const auto sums = -row_sum(s.nll, !collect_ && torch::GradMode::is_enabled());  // [2P]: each row's completion log-probability
    if (collect_) {
      collected = sums.detach();
      ++forwards;
      return torch::zeros({}, sums.options());
    }
    TORCH_CHECK(sums.size(0) % 2 == 0, "a preference batch holds chosen and rejected rows, got ", sums.size(0));
    const int64_t P = sums.size(0) / 2;
    const auto counted = row_sum(s.counted.to(sums.scalar_type()), false);
    const auto lens = counted.clamp_min(1);
    PairScores ps{sums.narrow(0, 0, P), sums.narrow(0, P, P), lens.narrow(0, 0, P), lens.narrow(0, P, P), {}, {}, {}};
    if (!a_.reference_free()) {
      TORCH_CHECK(ref.defined() && ref.size(0) == 2 * P, "alignment: no reference log-probabilities for this batch");
      ps.ref_chosen = ref.narrow(0, 0, P).to(sums.scalar_type());
      ps.ref_rejected = ref.narrow(0, P, P).to(sums.scalar_type());
    }
    if (a_.loss_type == "orpo") ps.chosen_nll_sum = -sums.narrow(0, 0, P).sum();
    auto out = preference_loss(a_, ps);
    ref = at::Tensor();  // one policy forward per reference
    ++forwards;
    torch::NoGradGuard no_grad;
    const auto d = [](const at::Tensor& t) { return t.to(torch::kDouble); };
    const auto logit_sums = row_sum(s.mean_logits * s.counted.to(s.mean_logits.scalar_type()), false);
    const auto zero = torch::zeros({}, sums.options().dtype(torch::kDouble));
    const double p = double(P);
    auto m = torch::stack({zero + p, d(out.chosen_rewards.sum()), d(out.rejected_rewards.sum()),
                           d(out.chosen_rewards.gt(out.rejected_rewards).sum()),
                           d((out.chosen_rewards - out.rejected_rewards).sum()), d(out.logps_chosen.sum()),
                           d(out.logps_rejected.sum()), d(logit_sums.narrow(0, 0, P).sum()),
                           d(counted.narrow(0, 0, P).sum()), d(logit_sums.narrow(0, P, P).sum()),
                           d(counted.narrow(0, P, P).sum()),
                           a_.loss_type == "orpo" ? d(ps.chosen_nll_sum.detach() / ps.chosen_len.sum()) * p : zero,
                           out.log_odds_ratio.defined() ? d(out.log_odds_ratio) * p : zero,
                           out.log_odds_chosen.defined() ? d(out.log_odds_chosen) * p : zero});
    metrics = metrics.defined() ? metrics + m : m;
    return out.loss;
  }

  at::Tensor segments;   // packed pairs ([P, T]: 0 chosen, 1 rejected, 2 padding); undefined: two rows a pair
  at::Tensor ref;        // [2P]: the reference's row sums for the next policy forward
  at::Tensor collected;  // collect: the last forward's row sums
  at::Tensor metrics;    // sums since begin_step (kMetricNames' order)
  int64_t forwards = 0;

 private:
  config::AlignmentArgs a_;
  bool collect_;
  dist::Runtime* cp_rt_;  // cp > 1: the runtime whose cp group splits every row
};

namespace {

// The order of PreferenceObjective::metrics.
enum Metric { kPairs, kRewChosen, kRewRejected, kAccuracy, kMargin, kLogpChosen, kLogpRejected, kLogitChosen,
              kTokChosen, kLogitRejected, kTokRejected, kNll, kLogOddsRatio, kLogOddsChosen, kNumMetrics };

// A batch's packed documents for the model (undefined: two rows a pair).
models::Documents documents(const data::Batch& b, const c10::Device& device) {
  if (!b.segments.defined()) return {};
  return {b.positions.to(device), b.segments.to(device)};
}

[[noreturn]] void refuse(const std::string& key, const std::string& why) { throw config::ConfigError(key + ": " + why); }

// What the precomputed table depends on: the starting model (its section, the
// folder's config and weight files, LoRA's, the seed for a fresh start), the
// precision, the dataset's files and the row length.
std::string reference_fingerprint(const config::TrainerArgs& args, const data::PreferenceDataset& ds) {
  std::string key;
  const YAML::Node root = YAML::Load(args.resolved_yaml);
  for (const char* section : {"model", "lora", "precision"})
    if (root[section]) {
      YAML::Emitter e;
      e << YAML::Flow << root[section];
      key += std::string(section) + "=" + e.c_str() + "\n";
    }
  if (!args.model.init_from.empty()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(args.model.init_from, ec)) {
      const auto name = entry.path().filename().string();
      if (name == "config.json") key += "config.json=" + data::sha256_file_hex(entry.path().string()) + "\n";
      else if (entry.path().extension() == ".safetensors")
        key += name + ":" + std::to_string(entry.file_size(ec)) + "\n";
    }
  } else {
    key += "seed=" + std::to_string(args.seed) + "\n";
  }
  key += "manifest=" + data::sha256_file_hex(ds.manifest().path) + "\n";
  key += "bin=" + std::to_string(fs::file_size(ds.manifest().prefix + ".bin")) + "\n";
  key += "seq_len=" + std::to_string(ds.seq_len()) + "\n";
  return data::sha256_hex(key);
}

}  // namespace

Alignment::Alignment(const AlignmentContext& ctx, std::shared_ptr<models::CausalLM> policy, const data::Dataset& train)
    : ctx_(ctx), a_(ctx.args->alignment), policy_(std::move(policy)) {
  const auto& args = *ctx.args;
  const auto& plan = *ctx.plan;
  // Each row's sums need its whole sequence and the pair's two rows together in one forward.
  // Under pipeline parallelism the head (the last stage) reads each micro-batch's
  // reference from the precomputed table; a reference forward would be a second pipeline pass.
  if (plan.pipeline.pp > 1 && (a_.reference == "frozen" || a_.reference == "adapters_off"))
    refuse("alignment.reference", a_.reference + " under pipeline parallelism (pas_config.pp_size " +
                                      std::to_string(plan.pipeline.pp) + "): use precomputed or a reference-free loss");
  if (args.dataset.preference_train.pack && plan.context.cp > 1)
    refuse("dataset.train_args.pack", "true under compute_config.context_parallel_size " +
                                          std::to_string(plan.context.cp) + ": a packed row's documents are not split by cp yet");
  if (args.compute_config.cuda_graphs == "true")
    refuse("compute_config.cuda_graphs", "true: a preference step reads its reference outside the graph; set auto or false");
  auto* head = policy_->lm_head_module();
  if (!head) refuse("model.type", args.model.type + " has no LM head an alignment objective can run on");
  dist::Runtime* cp_rt = plan.context.cp > 1 ? ctx.rt : nullptr;
  objective_ = std::make_shared<PreferenceObjective>(a_, false, cp_rt);
  head->objective = objective_;
  collector_ = std::make_shared<PreferenceObjective>(a_, true, cp_rt);
  // The reference is the starting model. The LoRA base is that only while every
  // adapter adds nothing: a starting adapter (lora.init_from) whose B is not zero
  // makes the start differ from its base (read from its file: every rank decides alike).
  if ((a_.reference == "adapters_off" || a_.reference == "frozen") && !args.lora.init_from.empty()) {
    const auto file = (fs::path(args.lora.init_from) / "adapter_model.safetensors").string();
    for (const auto& [name, t] : checkpoint::load_tensors(file))
      if (name.find("lora_B") != std::string::npos && t.abs().max().item<double>() > 0)
        refuse("alignment.reference", a_.reference + ": the reference must be the starting model, and " +
                                          args.lora.init_from + "'s adapters (" + name +
                                          " is not zero) make it differ from the base; use precomputed");
  }
  if (a_.reference == "frozen") {
    if (plan.zero_stage >= 3)
      refuse("alignment.reference", "frozen: under ZeRO-3 a frozen copy would hold whole parameters on every rank; "
                                    "use precomputed (or adapters_off with lora)");
    {  // built after a resume restored the generators: whatever it draws leaves them as they were
      auto gen = at::detail::getDefaultCPUGenerator();
      const auto state = gen.get_state();
      frozen_ = ctx.build_reference();
      gen.set_state(state);
    }
    frozen_->eval();
    for (auto& p : frozen_->parameters()) p.requires_grad_(false);
    auto* fh = frozen_->lm_head_module();
    if (!fh) refuse("model.type", args.model.type + " has no LM head a reference can run on");
    fh->objective = collector_;
  }
  (void)train;
}

Alignment::~Alignment() = default;

void Alignment::prepare(const data::Dataset& train, const data::Dataset* val) {
  if (a_.reference != "precomputed") return;
  table_ = reference_table(train, a_.ref_log_probs, &table_path_);
  if (val) val_table_ = reference_table(*val, a_.ref_log_probs.empty() ? "" : a_.ref_log_probs + ".val", &val_table_path_);
}

at::Tensor Alignment::reference_table(const data::Dataset& dataset, const std::string& path_override,
                                      std::string* path) {
  const auto& ds = dynamic_cast<const data::PreferenceDataset&>(dataset);
  const int64_t N = ds.samples_per_epoch();
  const std::string fp = reference_fingerprint(*ctx_.args, ds);
  *path = !path_override.empty() ? path_override : ds.manifest().prefix + ".ref_logps-" + fp.substr(0, 12) + ".safetensors";
  const std::string& file = *path;
  if (fs::exists(file)) {
    std::map<std::string, at::Tensor> t;
    std::map<std::string, std::string> meta;
    try {
      checkpoint::SafetensorsReader r(file);
      meta = r.metadata();
      t = checkpoint::load_tensors(file);
    } catch (const std::exception& e) {
      refuse("alignment.ref_log_probs", std::string(e.what()));
    }
    if (meta["fingerprint"] != fp || !t.count("ref_logps") || t["ref_logps"].sizes() != at::IntArrayRef({N, 2}))
      refuse("alignment.ref_log_probs", file + " holds another reference's or dataset's log-probabilities "
                                                      "(delete it or name another file)");
    if (ctx_.rank == 0) log::info("alignment: reference log-probabilities of " + std::to_string(N) + " pairs read from " + file);
    return t["ref_logps"].to(ctx_.device);
  }
  if (ctx_.start_step > 0)
    refuse("alignment.ref_log_probs", file + " is missing, and this run resumes at step " +
                                          std::to_string(ctx_.start_step) +
                                          ", where the policy is no longer the starting model it was computed from");
  // Chunks of micro_batch pairs dealt round the dp ranks; every rank runs as many
  // forwards (ZeRO-3 gathers in each), the last ones repeats that are dropped.
  const int64_t m = ctx_.micro_batch, chunks = (N + m - 1) / m, rounds = (chunks + ctx_.dp - 1) / ctx_.dp;
  auto table = torch::zeros({N, 2}, torch::TensorOptions().device(ctx_.device).dtype(torch::kFloat32));
  {
    torch::NoGradGuard no_grad;
    // The starting policy itself (LoRA: its starting adapters on), before any step.
    auto* head = policy_->lm_head_module();
    head->objective = collector_;
    policy_->eval();
    for (int64_t k = 0; k < rounds; ++k) {
      const int64_t c = k * ctx_.dp + ctx_.dp_rank;
      const int64_t first = c < chunks ? c * m : 0, n = std::min(m, N - first);
      auto b = ctx_.slice ? ctx_.slice(ds.pairs(first, n)) : ds.pairs(first, n);
      if (ctx_.begin_forward) ctx_.begin_forward();
      collector_->collected = at::Tensor();
      b.x = b.x.to(ctx_.device);
      b.y = b.y.to(ctx_.device);
      collector_->segments = b.segments;
      if (ctx_.pipeline_forward) ctx_.pipeline_forward(b);
      else policy_->loss(b.x, b.y, documents(b, ctx_.device));
      if (c < chunks && collector_->collected.defined()) {  // under pp: the last stage's ranks
        const auto sums = collector_->collected.to(torch::kFloat32);
        table.narrow(0, first, n).select(1, 0).copy_(sums.narrow(0, 0, n));
        table.narrow(0, first, n).select(1, 1).copy_(sums.narrow(0, n, n));
      }
    }
    if (ctx_.end_forward) ctx_.end_forward();
    policy_->train();
    head->objective = objective_;
  }
  // Over dp only: the cp ranks of a row already share its whole sums.
  if (ctx_.rt) ctx_.rt->all_reduce(ctx_.rt->dp, table, "reference log-probabilities all-reduce");
  if (ctx_.rt && ctx_.plan->pipeline.pp > 1)  // from the last stage to every stage
    ctx_.rt->all_reduce(ctx_.rt->pp, table, "reference log-probabilities all-reduce (pipeline)");
  if (ctx_.rank == 0) {
    const std::string tmp = file + ".tmp";
    checkpoint::save_tensors(tmp, {{"ref_logps", table.cpu()}}, {{"fingerprint", fp}, {"pairs", std::to_string(N)}});
    fs::rename(tmp, file);
    log::info("alignment: reference log-probabilities of " + std::to_string(N) + " pairs computed (" +
              std::to_string(rounds) + " forwards per rank) and stored in " + file);
  }
  return table;
}

at::Tensor Alignment::count(const data::Batch& b) const {
  return torch::full({}, b.pairs(), b.y.options());
}

void Alignment::begin_step() { objective_->metrics = at::Tensor(); }

at::Tensor Alignment::reference_sums(const data::Batch& b) {
  torch::NoGradGuard no_grad;
  if (a_.reference == "precomputed") {
    const auto& table = in_eval_ ? val_table_ : table_;
    const auto rows = table.index_select(0, b.pair_index.to(table.device()));  // [P, 2]
    return torch::cat({rows.select(1, 0), rows.select(1, 1)});
  }
  collector_->segments = b.segments;
  if (a_.reference == "frozen") {
    frozen_->loss(b.x, b.y, documents(b, b.x.device()));
    return collector_->collected;
  }
  // adapters_off: the policy's own forward on its base (its train mode kept, as TRL's)
  models::lora::AdaptersOff off;
  auto* head = policy_->lm_head_module();
  head->objective = collector_;
  policy_->loss(b.x, b.y, documents(b, b.x.device()));
  head->objective = objective_;
  return collector_->collected;
}

void Alignment::before_forward(const data::Batch& b) {
  objective_->segments = b.segments;
  if (!a_.reference_free()) objective_->ref = reference_sums(b);
}

void Alignment::report(nlohmann::json& rec) { rec.update(metrics_record(objective_->metrics, "")); }

void Alignment::begin_eval() {
  in_eval_ = true;
  step_metrics_ = objective_->metrics;
  objective_->metrics = at::Tensor();
}

void Alignment::end_eval(nlohmann::json& rec) {
  rec.update(metrics_record(objective_->metrics, "val_"));
  objective_->metrics = step_metrics_;
  in_eval_ = false;
}

nlohmann::json Alignment::metrics_record(const at::Tensor& sums, const std::string& prefix) {
  auto m = sums.defined() ? sums.clone()
                          : torch::zeros({kNumMetrics}, torch::TensorOptions().device(ctx_.device).dtype(torch::kDouble));
  if (ctx_.rt) ctx_.rt->all_reduce(ctx_.rt->dp_cp, m, "alignment metrics all-reduce");
  if (ctx_.rt && ctx_.plan->pipeline.pp > 1)  // held by the last stage's ranks
    ctx_.rt->all_reduce(ctx_.rt->pp, m, "alignment metrics all-reduce (pipeline)");
  m = m.cpu() / double(ctx_.plan->context.cp);  // every cp rank of a row holds the same statistics
  const auto v = [&](int i) { return m[i].item<double>(); };
  const double P = std::max(1.0, v(kPairs));
  nlohmann::json rec;
  rec[prefix + "rewards/chosen"] = v(kRewChosen) / P;
  rec[prefix + "rewards/rejected"] = v(kRewRejected) / P;
  rec[prefix + "rewards/accuracies"] = v(kAccuracy) / P;
  rec[prefix + "rewards/margins"] = v(kMargin) / P;
  rec[prefix + "logps/chosen"] = v(kLogpChosen) / P;
  rec[prefix + "logps/rejected"] = v(kLogpRejected) / P;
  rec[prefix + "logits/chosen"] = v(kTokChosen) > 0 ? v(kLogitChosen) / v(kTokChosen) : 0.0;
  rec[prefix + "logits/rejected"] = v(kTokRejected) > 0 ? v(kLogitRejected) / v(kTokRejected) : 0.0;
  rec[prefix + "pairs"] = int64_t(v(kPairs));
  if (a_.loss_type == "orpo") {
    rec[prefix + "nll_loss"] = v(kNll) / P;
    rec[prefix + "log_odds_ratio"] = v(kLogOddsRatio) / P;
    rec[prefix + "log_odds_chosen"] = v(kLogOddsChosen) / P;
  }
  return rec;
}

nlohmann::json Alignment::describe() const {
  nlohmann::json j = {{"loss_type", a_.loss_type}, {"beta", a_.beta}, {"reference", a_.reference},
                      {"policy_forwards", objective_->forwards}, {"reference_forwards", collector_->forwards}};
  if (!table_path_.empty()) j["ref_log_probs"] = table_path_;
  if (!val_table_path_.empty()) j["val_ref_log_probs"] = val_table_path_;
  return j;
}

}  // namespace nnstrain::align
