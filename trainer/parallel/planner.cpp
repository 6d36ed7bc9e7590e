#include "trainer/parallel/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>

namespace nnstrain::parallel {

namespace {

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// Tensor-parallel degrees the policy allows.
std::vector<int> allowed_tps(const PlanRequest& req) {
  const auto& a = *req.args;
  const int world = req.world_size, plan_ngpus = a.compute_config.plan_ngpus;
  const std::string& policy = a.pas_policy;
  if (policy == "dp") return {1};
  if (policy == "tp" || policy == "hybrid") {
    if (policy == "tp" && world != plan_ngpus)
      throw PlanError("pas_policy tp puts every rank in one tensor-parallel group, so runtime_ngpus " +
                      std::to_string(world) + " must equal compute_config.plan_ngpus " + std::to_string(plan_ngpus) +
                      " (pas_policy hybrid runs tp x dp)");
    if (world % plan_ngpus != 0)
      throw PlanError("runtime_ngpus " + std::to_string(world) + " is not a multiple of compute_config.plan_ngpus " +
                      std::to_string(plan_ngpus));
    check_tp_feasible(*req.model, plan_ngpus);
    return {plan_ngpus};
  }
  if (policy == "autodist") {
    std::vector<int> tps;
    for (int t = 1; t <= plan_ngpus; ++t)
      if (plan_ngpus % t == 0 && world % t == 0) tps.push_back(t);
    return tps;
  }
  throw PlanError("unknown pas_policy '" + policy + "' (dp, tp, hybrid, autodist)");
}

// One candidate of the search: infeasible with its reason, or evaluated.
struct Entry {
  Candidate c;
  std::string infeasible;  // empty: evaluated
  PlanEstimate e;
};

// The search space, listed tp up, ZeRO stage up, recompute up, one offload
// tier at a time, and the choice among what fits.
class Search {
 public:
  Search(const PlanRequest& req, const ModelFacts& f)
      : req_(req), a_(*req.args), f_(f), L_(static_cast<int>(f.layers)), budget_(memory_budget(req)),
        tps_(allowed_tps(req)) {}

  // Offload tiers: 0 none, 1 the optimizer, 2 also the parameters (ZeRO-3).
  // The config's offload holds for every candidate; otherwise autodist adds
  // a tier only when no candidate of the tiers before fits.
  const Entry* run() {
    int tier = 0;
    add_candidates(tier);
    choose();
    while (!best_ && free_offload() && tier < 2) {
      add_candidates(++tier);
      choose();
    }
    return best_;
  }

  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* least_memory() const { return least_memory_; }
  double budget() const { return budget_; }
  // The least ZeRO stage that fits at (tp, k), if any.
  const Entry* least_stage(const Candidate& c) const {
    auto it = least_stage_.find({c.tp, c.recompute_layers});
    return it == least_stage_.end() ? nullptr : it->second;
  }
  bool from_first_tier() const { return from_first_tier_; }

 private:
  bool free_zero() const { return a_.pas_policy == "autodist" && a_.compute_config.use_zero == 0; }
  bool free_offload() const {
    const auto& o = a_.compute_config.offload;
    return a_.pas_policy == "autodist" && !o.optimizer && !o.params;
  }

  void add_candidates(int tier) {
    const auto& cc = a_.compute_config;
    const int k_min = a_.model.activation_checkpointing ? L_ : 0;
    for (int t : tps_) {
      const int dp = req_.world_size / (t * a_.compute_config.context_parallel_size);
      const auto fails = tp_failures(f_, t);
      if (!fails.empty()) {
        if (tier == 0) entries_.push_back({{t, dp, 0, 0}, join(fails, "; "), {}});
        continue;
      }
      if (a_.global_batch_size % (a_.micro_batch_size * dp) != 0) {
        if (tier == 0)
          entries_.push_back({{t, dp, 0, 0},
                              "global batch " + std::to_string(a_.global_batch_size) +
                                  " is not a multiple of micro_batch_size " + std::to_string(a_.micro_batch_size) +
                                  " x dp " + std::to_string(dp),
                              {}});
        continue;
      }
      // ZeRO shards over dp / zero_ngroups ranks: with one there is nothing to
      // shard, so autodist tries no stage (a stage the config names still runs,
      // on one-rank groups). Parameter offload is ZeRO-3's, whatever the group.
      const int zsize = dp % cc.zero_ngroups == 0 ? dp / cc.zero_ngroups : 0;
      std::vector<int> zeros;
      if (!free_zero()) zeros = {cc.use_zero};
      else if (tier == 2) zeros = {3};
      else if (zsize > 1) zeros = {0, 1, 2, 3};
      else zeros = {0};
      for (int zero : zeros) {
        if (zero && zsize == 0) {
          if (tier == 0)
            entries_.push_back({{t, dp, zero, 0},
                                "compute_config.zero_ngroups " + std::to_string(cc.zero_ngroups) +
                                    " does not divide dp " + std::to_string(dp),
                                {}});
          continue;
        }
        if (tier == 2 && zero != 3) continue;
        for (int k = k_min; k <= L_; ++k) {
          Candidate c{t, dp, zero, k};
          if (!free_offload()) {
            c.offload_ratio = cc.offload.optimizer ? cc.offload.ratio : 0.0;
            c.offload_params = cc.offload.params;
          } else {
            c.offload_ratio = tier >= 1 ? 1.0 : 0.0;
            c.offload_params = tier == 2;
          }
          entries_.push_back({c, "", estimate(req_, f_, c)});
        }
      }
    }
  }

  // The choice (docs/parallelism.md, "What autodist searches"): per (tp, k),
  // the least ZeRO stage that fits; at the smallest feasible tp without
  // recompute that is the plan, whatever the others' speed (sharding the state
  // further costs less than splitting layers or recomputing them). Otherwise
  // the fastest of those least stages; ties keep the smaller tp, then the
  // smaller k. A tier's candidates are added only when nothing before fits,
  // so within the entries that fit there is one tier.
  void choose() {
    least_stage_.clear();
    std::optional<Key> first_tier;
    least_memory_ = nullptr;
    best_ = nullptr;
    for (const auto& en : entries_) {
      if (!en.infeasible.empty()) continue;
      const Key key{en.c.tp, en.c.recompute_layers};
      if (!first_tier || key < *first_tier) first_tier = key;
      if (!least_memory_ || en.e.total_bytes < least_memory_->e.total_bytes) least_memory_ = &en;
      auto& slot = least_stage_[key];
      if (en.e.total_bytes <= budget_ && (!slot || en.c.zero_stage < slot->c.zero_stage)) slot = &en;
    }
    from_first_tier_ = first_tier && least_stage_.count(*first_tier) && least_stage_[*first_tier];
    if (from_first_tier_) {
      best_ = least_stage_[*first_tier];
      return;
    }
    for (const auto& [key, en] : least_stage_)  // tp up, then k up: strict < keeps the first on ties
      if (en && (!best_ || en->e.step_s < best_->e.step_s)) best_ = en;
  }

  using Key = std::pair<int, int>;  // (tp, k)
  const PlanRequest& req_;
  const config::TrainerArgs& a_;
  const ModelFacts& f_;
  const int L_;
  const double budget_;
  const std::vector<int> tps_;
  std::vector<Entry> entries_;  // choose() re-points into it after every add_candidates()
  std::map<Key, const Entry*> least_stage_;
  const Entry* least_memory_ = nullptr;
  const Entry* best_ = nullptr;
  bool from_first_tier_ = false;
};

// Nothing fits: the infeasible reasons, or the least any candidate needs.
[[noreturn]] void refuse(const PlanRequest& req, const Search& s, int L) {
  const auto& a = *req.args;
  const int world = req.world_size;
  if (!s.least_memory()) {
    std::string why;
    for (const auto& en : s.entries()) why += "\n  " + candidate_text(en.c, L) + ": " + en.infeasible;
    throw PlanError("no feasible plan for pas_policy " + a.pas_policy + " on " + std::to_string(world) + " ranks:" + why);
  }
  const auto& m = *s.least_memory();
  throw PlanError("no plan fits the memory budget of " + format_bytes(s.budget()) + " per rank (pas_policy " +
                      a.pas_policy + ", " + std::to_string(world) + (world == 1 ? " rank" : " ranks") +
                      ", plan_ngpus " + std::to_string(a.compute_config.plan_ngpus) +
                      "): the least any candidate needs is " + format_bytes(m.e.total_bytes) + " (" +
                      candidate_text(m.c, L) + "); raise compute_config.memory_budget_gb to at least " +
                      format_fixed(std::ceil(m.e.total_bytes / kGiB * 100) / 100, 2) +
                      ", use more ranks or a larger plan_ngpus, or shrink micro_batch_size",
                  m.e.total_bytes);
}

// Every candidate not taken, with the one reason it lost to `best`.
std::vector<Rejected> rejections(const Search& s, const Entry& best, int L) {
  std::vector<Rejected> out;
  for (const auto& en : s.entries()) {
    if (&en == &best) continue;
    Rejected r{candidate_text(en.c, L), "", "", en.c, en.e.total_bytes, en.e.step_s};
    const Entry* least = s.least_stage(en.c);
    if (!en.infeasible.empty()) {
      r.kind = "infeasible";
      r.reason = en.infeasible;
      r.memory_bytes = r.step_s = 0;
    } else if (en.e.total_bytes > s.budget()) {
      r.kind = "memory";
      r.reason = "needs " + format_bytes(en.e.total_bytes) + ", over the budget " + format_bytes(s.budget()) +
                 " by " + format_bytes(en.e.total_bytes - s.budget());
    } else if (least != &en) {
      r.kind = "sharding";
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but shards more than needed: zero=" +
                 std::to_string(least->c.zero_stage) + " fits at this tp and recompute";
    } else if (s.from_first_tier()) {
      r.kind = "order";
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but needs no " +
                 (en.c.tp > best.c.tp ? std::string("tensor parallelism") : std::string("recompute")) + ": " +
                 candidate_text(best.c, L) + " fits (ZeRO stages are tried first)";
    } else {
      r.kind = "slower";
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but slower: " + format_fixed(en.e.step_s, 4) +
                 " s vs " + format_fixed(best.e.step_s, 4) + " s" +
                 (en.e.step_s == best.e.step_s ? " (tie: search order)" : "");
    }
    out.push_back(std::move(r));
  }
  return out;
}

// The chosen candidate as the Plan every rank applies.
Plan to_plan(const PlanRequest& req, const ModelFacts& f, const Entry& best, double budget) {
  const auto& a = *req.args;
  const int L = static_cast<int>(f.layers);
  Plan p;
  p.policy = a.pas_policy;
  p.world = req.world_size;
  p.tp = best.c.tp;
  p.dp = best.c.dp;
  p.context = {a.compute_config.context_parallel_size, a.compute_config.cp_comm_type, a.compute_config.cp_load_balance};
  p.zero_stage = best.c.zero_stage;
  p.zero_ngroups = a.compute_config.zero_ngroups;
  p.offload_ratio = best.c.offload_ratio;
  p.offload_params = best.c.offload_params;
  p.recompute.assign(L, false);
  for (int i = 0; i < best.c.recompute_layers && i < L; ++i) p.recompute[i] = true;
  if (p.zero_stage == 3) {
    bool after = false;
    for (const auto& pf : f.params) {
      after = after || pf.unit >= 0;
      if (pf.unit < 0) (after ? p.units_after_blocks : p.units_before_blocks).push_back(pf.name);
    }
  }
  for (const auto& pf : f.params) {
    ParamPlan pp;
    pp.param = pf.name;
    pp.split = p.tp > 1 ? split_style_name(pf.split.style) : "replicate";
    pp.global_shape = pf.shape;
    pp.local_shape = local_shape(pf, p.tp);
    p.params.push_back(std::move(pp));
  }
  p.estimate = best.e;
  p.memory_budget_bytes = std::isfinite(budget) ? budget : 0.0;
  p.device = req.device.name;
  p.micro_batch_size = a.micro_batch_size;
  p.seq_len = seq_len_of(a, f);
  p.grad_accumulation_steps = a.global_batch_size / (a.micro_batch_size * p.dp);
  return p;
}

}  // namespace

Plan make_plan(const PlanRequest& req, std::vector<Rejected>* rejected) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  if (req.world_size < 1) throw PlanError("world size must be >= 1, got " + std::to_string(req.world_size));
  const auto f = model_facts(*req.model);
  const int L = static_cast<int>(f.layers);
  Search search(req, f);
  const Entry* best = search.run();
  if (!best) refuse(req, search, L);
  if (rejected) *rejected = rejections(search, *best, L);
  return to_plan(req, f, *best, search.budget());
}

std::string describe_rejected(const std::vector<Rejected>& rejected, int layers) {
  std::ostringstream o;
  // Fold runs of the same (tp, zero, kind) over consecutive recompute counts.
  for (size_t i = 0; i < rejected.size();) {
    const auto& r = rejected[i];
    size_t j = i;
    // sharding / order runs fold only while their reason (which stage or plan fits) is the same.
    while (j + 1 < rejected.size() && rejected[j + 1].kind == r.kind && r.kind != "infeasible" &&
           (r.kind == "memory" || r.kind == "slower" || rejected[j + 1].reason.substr(rejected[j + 1].reason.find(") but ")) ==
                                                             r.reason.substr(r.reason.find(") but "))) &&
           rejected[j + 1].cand.tp == r.cand.tp && rejected[j + 1].cand.zero_stage == r.cand.zero_stage &&
           rejected[j + 1].cand.offload_ratio == r.cand.offload_ratio &&
           rejected[j + 1].cand.offload_params == r.cand.offload_params &&
           rejected[j + 1].cand.recompute_layers == rejected[j].cand.recompute_layers + 1)
      ++j;
    const auto& last = rejected[j];
    std::string head = "tp=" + std::to_string(r.cand.tp) + " dp=" + std::to_string(r.cand.dp) +
                       " zero=" + std::to_string(r.cand.zero_stage) + offload_text(r.cand);
    if (r.kind == "infeasible") {
      o << "  " << head << ": infeasible: " << r.reason << "\n";
    } else if (i == j) {
      o << "  " << r.candidate << ": " << (r.kind == "memory" ? "over budget: " : "") << r.reason << "\n";
    } else {
      o << "  " << head << " recompute=" << r.cand.recompute_layers << ".." << last.cand.recompute_layers << "/"
        << layers << ": ";
      // The run's least-memory / fastest end says the most.
      if (r.kind == "memory") {
        o << "over budget: at recompute=" << last.cand.recompute_layers << " still " << last.reason;
      } else if (r.kind != "slower") {
        // sharding / order: each fits; the reason after "but" is the run's.
        const auto but = last.reason.find(") but ");
        o << "fit but " << (but == std::string::npos ? last.reason : last.reason.substr(but + 6));
      } else {
        const auto vs = r.reason.rfind(" vs ");
        o << "fit but slower: " << format_fixed(r.step_s, 4) << " s .. " << format_fixed(last.step_s, 4) << " s"
          << (vs == std::string::npos ? "" : r.reason.substr(vs));
      }
      o << "\n";
    }
    i = j + 1;
  }
  return o.str();
}

}  // namespace nnstrain::parallel
