#include "trainer/plan/planner.h"

#include "base/text.h"
#include "trainer/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <tuple>
#include <cmath>
#include <map>
#include <optional>
#include <limits>
#include <set>
#include <sstream>

namespace nnstrain::parallel {

namespace {

// Tensor-parallel degrees the policy allows.
std::vector<int> allowed_tps(const PlanRequest& req, const ModelFacts& f) {
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
    if (const auto fails = tp_failures(f, plan_ngpus); !fails.empty())
      throw PlanError("tensor parallel size " + std::to_string(plan_ngpus) + " cannot split the model: " + util::join(fails, "; "));
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
  bool batch = false;  // infeasible by the batch arithmetic (global = micro x dp x accumulation)
  bool ep_key = false;  // infeasible by the config's expert_parallel_size
};

// How a candidate splits beyond tp: context- and pipeline-parallel sizes,
// the ring's communication, the schedule (tp, dp, ZeRO and recompute vary inside).
struct Split {
  int cp = 1;
  std::string cp_comm = "p2p";
  int pp = 1, stages = 1;
  std::string scheduler = "1f1b";
};

// The pipelines the search tries: the config's pp_size when it names one
// (with its scheduler and pipeline_nstages), else (autodist,
// PlanRequest::search_pipeline) none and every pp dividing the ranks left
// after tp x cp, with every scheduler, or the one the config names
// (interleaved and zbv at two stages per rank unless pipeline_nstages says).
std::vector<Split> pipeline_splits(const PlanRequest& req, int per_tp_cp, int layers) {
  const auto& q = req.args->compute_config.pipeline;
  auto stages_for = [](const std::string& sched, int pp, int nstages) {
    if (nstages > 0) return nstages;
    return sched == "1f1b_interleaved" || sched == "zbv" ? 2 * pp : pp;
  };
  if (q.pp_size > 1) return {{1, "p2p", q.pp_size, stages_for(q.scheduler, q.pp_size, q.nstages), q.scheduler}};
  std::vector<Split> out{{}};
  if (q.pp_size_given || !req.search_pipeline || req.args->pas_policy != "autodist") return out;
  for (int pp = 2; pp <= per_tp_cp && pp <= layers; ++pp) {
    if (per_tp_cp % pp) continue;
    for (const auto& sched : pipeline::scheduler_names()) {
      if (q.scheduler_given && sched != q.scheduler) continue;
      const int stages = stages_for(sched, pp, q.nstages > 0 && q.nstages % pp == 0 ? q.nstages : 0);
      if (stages <= layers) out.push_back({1, "p2p", pp, stages, sched});
    }
  }
  return out;
}

// What the trainer cannot run yet, for a split it would otherwise take (empty:
// it can). Each line mirrors a refusal at load (base/config/load.cpp) or start
// (trainer/train/startup.cpp); drop it here when the runtime learns the case.
std::string not_runnable(const config::TrainerArgs& a, const Candidate& c) {
  const auto& cc = a.compute_config;
  if (c.pp > 1 && cc.cuda_graphs == "true") return "pipeline parallelism cannot be captured in a CUDA graph (compute_config.cuda_graphs)";
  if (c.cp > 1) {
    if (cc.cuda_graphs == "true") return "context parallelism is not supported with compute_config.cuda_graphs yet";
    if (a.model.args && a.model.args->attention_dropout().second > 0)
      return "context-parallel attention has no attention dropout (model.args." + a.model.args->attention_dropout().first + ")";
  }
  return "";
}

// The search space, listed tp up, ZeRO stage up, recompute up, one offload
// tier at a time, and the choice among what fits.
class Search {
 public:
  Search(const PlanRequest& req, const ModelFacts& f)
      : req_(req), a_(*req.args), f_(f), L_(static_cast<int>(f.layers)), budget_(memory_budget(req)),
        tps_(allowed_tps(req, f)) {}

  // Offload tiers: 0 none, 1 the optimizer, 2 also the parameters (ZeRO-3).
  // The config's offload holds for every candidate; otherwise autodist adds
  // a tier only when no candidate of the tiers before fits.
  // Context parallelism: the config's size, else (autodist,
  // PlanRequest::search_context) cp 1 and, only when nothing fits there, every
  // cp up to the ranks tp leaves with each communication type.
  const Entry* run() {
    const auto& cc = a_.compute_config;
    const int cp = cc.context_parallel_size;
    int tier = 0;
    std::vector<std::pair<int, std::string>> cps{{cp, cc.cp_comm_type}};
    add_candidates(tier, cps);
    choose();
    if (!best_ && cp == 1 && free_context()) {
      cps.clear();
      for (int c = 2; c <= req_.world_size; ++c)
        if (req_.world_size % c == 0)
          for (const char* comm : {"p2p", "all_gather"}) cps.push_back({c, comm});
      add_candidates(tier, cps);
      choose();
      cps.insert(cps.begin(), std::make_pair(1, cc.cp_comm_type));
    }
    // Tier 3, the last resort: ZeRO-3 with the optimizer and parameters on NVMe (where a disk was probed).
    while (!best_ && free_offload() && tier < (req_.device.disk_read_bw > 0 ? 3 : 2)) {
      add_candidates(++tier, cps);
      choose();
    }
    return best_;
  }

  const std::deque<Entry>& entries() const { return entries_; }
  const Entry* least_memory() const { return least_memory_; }
  double budget() const { return budget_; }
  // The least ZeRO stage that fits at (split, tp, k), if any.
  const Entry* least_stage(const Candidate& c) const {
    auto it = least_stage_.find(key_of(c));
    return it == least_stage_.end() ? nullptr : it->second;
  }
  bool from_first_tier() const { return from_first_tier_; }
  // The node's host memory (where given) holds what its ranks keep there.
  double host_per_node(const PlanEstimate& e) const {
    return e.host_bytes * std::min(req_.world_size, req_.device.ranks_per_node);
  }
  double host_memory() const { return req_.device.host_memory_bytes; }
  bool host_fits(const PlanEstimate& e) const {
    return req_.device.host_memory_bytes <= 0 || host_per_node(e) <= req_.device.host_memory_bytes;
  }

 private:
  bool free_zero() const { return a_.pas_policy == "autodist" && a_.compute_config.use_zero == 0; }
  bool free_offload() const {
    const auto& o = a_.compute_config.offload;
    return a_.pas_policy == "autodist" && !o.optimizer && !o.params;
  }
  bool free_context() const {
    return a_.pas_policy == "autodist" && req_.search_context && !a_.compute_config.context_parallel_given;
  }
  bool free_expert() const { return a_.pas_policy == "autodist" && !a_.compute_config.expert_parallel_given; }

  // Expert-parallel sizes to try at dp x cp ranks, each with why it cannot run
  // (empty: it can): for a dense model none but 1; the config's size when it
  // names one (or the policy is not autodist); else every divisor of dp x cp
  // (under pp only 1 and the first other, which is refused).
  std::vector<std::pair<int, std::string>> expert_sizes(int dp, int cp, int pp) const {
    const int dpcp = dp * cp;
    const int64_t E = f_.experts;
    if (E <= 0) return {{1, ""}};
    auto why = [&](int ep) -> std::string {
      const std::string key = free_expert() ? "ep " + std::to_string(ep) : "compute_config.expert_parallel_size " + std::to_string(ep);
      if (dpcp % ep) return key + " does not divide dp x cp = " + std::to_string(dp) + " x " + std::to_string(cp);
      if (E % ep) return key + " does not divide the " + std::to_string(E) + " experts";
      // HSDP: each ep slice inside one ZeRO group (trainer/train/startup.cpp check_expert_parallel).
      const int zn = a_.compute_config.zero_ngroups;
      if (zn > 1 && dpcp % zn == 0 && (dpcp / zn) % ep)
        return key + " does not divide the ZeRO group of " + std::to_string(dpcp / zn) +
               " ranks (dp x cp / compute_config.zero_ngroups " + std::to_string(zn) + ")";
      return "";
    };
    if (!free_expert()) {
      const int ep = a_.compute_config.expert_parallel_size;
      return {{ep, why(ep)}};
    }
    std::vector<std::pair<int, std::string>> out;
    for (int ep = 1; ep <= dpcp; ++ep)
      if (dpcp % ep == 0) {
        out.push_back({ep, why(ep)});
      }
    return out;
  }

  // Recompute counts to try: every k for a whole model; under pp (k per
  // stage) at most 9 evenly spaced counts from none to the largest stage's layers.
  std::vector<int> recompute_counts(const Candidate& c) const {
    if (c.pp <= 1) {
      std::vector<int> ks;
      for (int k = a_.model.activation_checkpointing ? L_ : 0; k <= L_; ++k) ks.push_back(k);
      return ks;
    }
    const int most = *std::max_element(c.stage_layers.begin(), c.stage_layers.end());
    if (a_.model.activation_checkpointing) return {most};
    const int step = std::max(1, (most + 7) / 8);
    std::vector<int> ks;
    for (int k = 0; k < most; k += step) ks.push_back(k);
    ks.push_back(most);
    return ks;
  }

  void add_candidates(int tier, const std::vector<std::pair<int, std::string>>& cps) {
    for (const auto& [cp, comm] : cps)
      for (int t : tps_) {
        if (req_.world_size % (t * cp) != 0) continue;
        for (auto sp : pipeline_splits(req_, req_.world_size / (t * cp), L_)) {
          sp.cp = cp;
          sp.cp_comm = comm;
          add_split(tier, t, sp);
        }
      }
  }

  void add_split(int tier, int t, const Split& sp) {
    const auto& cc = a_.compute_config;
    Candidate base{t, req_.world_size / (t * sp.cp * sp.pp), 0, 0};
    base.cp = sp.cp;
    base.cp_comm = sp.cp_comm;
    base.cp_balance = cc.cp_load_balance;
    base.pp = sp.pp;
    base.stages = sp.stages;
    base.scheduler = sp.scheduler;
    const int dp = base.dp;
    auto refuse_split = [&](const std::string& why, bool batch = false, bool ep_key = false) {
      if (tier == 0) entries_.push_back({base, why, {}, batch, ep_key});
    };
    if (req_.world_size % (t * sp.cp * sp.pp) != 0)
      return refuse_split("tp x cp x pp = " + std::to_string(t * sp.cp * sp.pp) + " does not divide the world " +
                          std::to_string(req_.world_size));
    {
      const auto fails = tp_failures(f_, t);
      if (!fails.empty()) return refuse_split(util::join(fails, "; "));
    }
    // The step's accumulation is derived here; a config naming it (or, under
    // pp, pipeline_nmicros) keeps only the splits that agree.
    const int64_t per_dp = a_.micro_batch_size * a_.grad_accumulation_steps;
    if (a_.accumulation_fixed && a_.global_batch_size != per_dp * dp)
      return refuse_split("global_batch_size " + std::to_string(a_.global_batch_size) + " = micro_batch_size " +
                              std::to_string(a_.micro_batch_size) + " x grad_accumulation_steps " +
                              std::to_string(a_.grad_accumulation_steps) + " x dp needs dp " +
                              format_fixed(double(a_.global_batch_size) / double(per_dp),
                                           a_.global_batch_size % per_dp ? 2 : 0) +
                              ", not " + std::to_string(dp),
                          true);
    if (a_.global_batch_size % (a_.micro_batch_size * dp) != 0)
      return refuse_split("global_batch_size " + std::to_string(a_.global_batch_size) +
                              " is not a multiple of micro_batch_size " + std::to_string(a_.micro_batch_size) +
                              " x dp " + std::to_string(dp),
                          true);
    const int64_t accumulation = a_.global_batch_size / (a_.micro_batch_size * dp);
    if (sp.pp > 1 && cc.pipeline.nmicros > 0 && accumulation != cc.pipeline.nmicros)
      return refuse_split("compute_config.pas_config.pipeline_nmicros " + std::to_string(cc.pipeline.nmicros) +
                              " != global_batch_size " + std::to_string(a_.global_batch_size) + " / (micro_batch_size " +
                              std::to_string(a_.micro_batch_size) + " x dp " + std::to_string(dp) + ") = " +
                              std::to_string(accumulation),
                          true);
    if (const auto why = not_runnable(a_, base); !why.empty()) return refuse_split(why);
    if (sp.cp > 1) {
      const int64_t parts = cc.cp_load_balance == "zigzag" ? 2 * sp.cp : sp.cp;
      if (seq_len_of(a_, f_) % parts != 0)
        return refuse_split("sequence " + std::to_string(seq_len_of(a_, f_)) + " does not split into " +
                            std::to_string(parts) + " equal parts (cp " + std::to_string(sp.cp) + ", " +
                            cc.cp_load_balance + ")");
    }
    if (sp.pp > 1) {
      const int64_t micros = a_.global_batch_size / (a_.micro_batch_size * dp);
      try {
        base.stage_layers = stage_split(req_, f_, base);
        pipeline::make_schedule(sp.scheduler, sp.pp, sp.stages, static_cast<int>(micros));
      } catch (const std::exception& e) {
        std::string why = e.what();
        return refuse_split(why.substr(0, why.find('\n')));
      }
    }
    // ZeRO shards over dp x cp / zero_ngroups ranks: with one there is nothing to
    // shard, so autodist tries no stage (a stage the config names still runs,
    // on one-rank groups). Parameter offload is ZeRO-3's, whatever the group.
    // Each expert-parallel size is a split of its own.
    const Candidate split_base = base;
    for (const auto& [ep, ep_why] : expert_sizes(dp, sp.cp, sp.pp)) {
      base = split_base;
      base.ep = ep;
      if (!ep_why.empty()) {
        refuse_split(ep_why, false, !free_expert());
        continue;
      }
      if (ep > 1)
        if (const auto why = not_runnable(a_, base); !why.empty()) {
          refuse_split(why);
          continue;
        }
      const int group = dp * sp.cp;
      const int zsize = group % cc.zero_ngroups == 0 ? group / cc.zero_ngroups : 0;
      std::vector<int> zeros;
      if (!free_zero()) zeros = {cc.use_zero};
      else if (tier >= 2) zeros = {3};
      else if (zsize > 1) zeros = {0, 1, 2, 3};
      else zeros = {0};
      for (int zero : zeros) {
        if (zero && zsize == 0) {
          if (tier == 0) {
            Candidate c = base;
            c.zero_stage = zero;
            entries_.push_back({c,
                                "compute_config.zero_ngroups " + std::to_string(cc.zero_ngroups) +
                                    " does not divide dp " + std::to_string(dp) +
                                    (sp.cp > 1 ? " x cp " + std::to_string(sp.cp) : std::string()),
                                {}});
          }
          continue;
        }
        if (tier >= 2 && zero != 3) continue;
        {
          Candidate c = base;
          c.zero_stage = zero;
          if (const auto why = not_runnable(a_, c); !why.empty()) {
            if (tier == 0) entries_.push_back({c, why, {}});
            continue;
          }
        }
        for (int k : recompute_counts(base)) {
          Candidate c = base;
          c.zero_stage = zero;
          c.recompute_layers = k;
          if (!free_offload()) {
            c.offload_ratio = cc.offload.optimizer ? cc.offload.ratio : 0.0;
            c.offload_params = cc.offload.params;
            c.offload_nvme = cc.offload.optimizer_nvme;
          } else {
            c.offload_ratio = tier >= 1 ? 1.0 : 0.0;
            c.offload_params = tier >= 2;
            c.offload_nvme = tier == 3;
          }
          entries_.push_back({c, "", estimate(req_, f_, c, &schedules_)});
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
  // so within the entries that fit there is one tier. The expert-parallel size
  // is chosen by speed: at the first point every ep's least stage competes
  // (ties keep the smaller ep).
  void choose() {
    least_stage_.clear();
    std::optional<Key> first_tier;
    least_memory_ = nullptr;
    best_ = nullptr;
    for (const auto& en : entries_) {
      if (!en.infeasible.empty()) continue;
      const Key key = key_of(en.c);
      if (!first_tier || point_of(key) < *first_tier) first_tier = point_of(key);
      if (!least_memory_ || en.e.total_bytes < least_memory_->e.total_bytes) least_memory_ = &en;
      auto& slot = least_stage_[key];
      if (en.e.total_bytes <= budget_ && host_fits(en.e) && (!slot || en.c.zero_stage < slot->c.zero_stage)) slot = &en;
    }
    from_first_tier_ = false;
    for (const auto& [key, en] : least_stage_)  // cp, pp, tp, k, then ep up: strict < keeps the first on ties
      if (en && point_of(key) == first_tier && (!best_ || en->e.step_s < best_->e.step_s)) best_ = en;
    from_first_tier_ = best_ != nullptr;
    if (from_first_tier_) return;
    for (const auto& [key, en] : least_stage_)
      if (en && (!best_ || en->e.step_s < best_->e.step_s)) best_ = en;
  }

  // (cp, pp, stages, scheduler, cp comm, tp, k, ep): the first point (the key
  // without ep) is the plan without context or pipeline parallelism, at the
  // smallest tp and recompute.
  using Key = std::tuple<int, int, int, std::string, std::string, int, int, int>;
  static Key key_of(const Candidate& c) {
    return {c.cp, c.pp, c.stages, c.scheduler, c.cp_comm, c.tp, c.recompute_layers, c.ep};
  }

 public:
  static Key point_of(Key k) {
    std::get<7>(k) = 0;
    return k;
  }
  static Key point_of(const Candidate& c) { return point_of(key_of(c)); }

 private:
  const PlanRequest& req_;
  const config::TrainerArgs& a_;
  const ModelFacts& f_;
  const int L_;
  const double budget_;
  const std::vector<int> tps_;
  ScheduleCache schedules_;
  std::deque<Entry> entries_;  // stable addresses; choose() re-points into it after every add_candidates()
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
    // Only the batch arithmetic stands in the way: a config error, one line.
    const auto& all = s.entries();
    if (!all.empty() && std::all_of(all.begin(), all.end(), [](const Entry& en) { return en.batch; })) {
      std::set<int, std::greater<int>> dps;
      for (const auto& en : all) dps.insert(en.c.dp);
      std::string tried;
      for (int d : dps) tried += (tried.empty() ? "" : ", ") + std::to_string(d);
      throw PlanError(all.front().infeasible + "; no split of the " + std::to_string(world) +
                          " ranks takes this batch (dp " + tried +
                          " tried): change global_batch_size, micro_batch_size or grad_accumulation_steps",
                      0, /*config=*/true);
    }
    // The configured expert_parallel_size fits no split (the batch aside): a config error, one line.
    const auto ep_key = std::find_if(all.begin(), all.end(), [](const Entry& en) { return en.ep_key; });
    if (ep_key != all.end() && std::all_of(all.begin(), all.end(), [](const Entry& en) { return en.batch || en.ep_key; }))
      throw PlanError(ep_key->infeasible, 0, /*config=*/true);
    std::string why;
    for (const auto& en : s.entries()) why += "\n  " + candidate_text(en.c, L) + ": " + en.infeasible;
    throw PlanError("no feasible plan for pas_policy " + a.pas_policy + " on " + std::to_string(world) + " ranks:" + why);
  }
  const auto& m = *s.least_memory();
  // The device would hold it: host memory (--host-memory-gb) is what is short.
  if (m.e.total_bytes <= s.budget() && !s.host_fits(m.e)) {
    double least_host = std::numeric_limits<double>::infinity();
    for (const auto& en : s.entries())
      if (en.infeasible.empty() && en.e.total_bytes <= s.budget()) least_host = std::min(least_host, s.host_per_node(en.e));
    throw PlanError("no plan fits the host memory of " + format_bytes(s.host_memory()) + " per node (pas_policy " +
                        a.pas_policy + ", " + std::to_string(world) + (world == 1 ? " rank" : " ranks") +
                        "): those within the device budget of " + format_bytes(s.budget()) + " keep at least " +
                        format_bytes(least_host) + " per node on the host; probe a local disk for the NVMe tier "
                        "(--probe-disk PATH) or use more nodes",
                    m.e.total_bytes);
  }
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
    } else if (!s.host_fits(en.e)) {
      r.kind = "host memory";
      r.reason = "keeps " + format_bytes(s.host_per_node(en.e)) + " per node on the host, over its " +
                 format_bytes(s.host_memory());
    } else if (least != &en) {
      r.kind = "sharding";
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but shards more than needed: zero=" +
                 std::to_string(least->c.zero_stage) + " fits at this tp and recompute";
    } else if (s.from_first_tier() && Search::point_of(en.c) == Search::point_of(best.c)) {
      r.kind = "slower";  // another expert-parallel size at the plan's point: ep goes by speed
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but slower: " + format_fixed(en.e.step_s, 4) +
                 " s vs " + format_fixed(best.e.step_s, 4) + " s at ep=" + std::to_string(best.c.ep) +
                 (en.e.step_s == best.e.step_s ? " (tie: the smaller ep)" : "");
    } else if (s.from_first_tier()) {
      r.kind = "order";
      const std::string what = en.c.cp > best.c.cp   ? "context parallelism"
                               : en.c.pp > best.c.pp ? "pipeline parallelism"
                               : en.c.tp > best.c.tp ? "tensor parallelism"
                                                     : "recompute";
      r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but needs no " + what + ": " +
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
  p.zero_stage = best.c.zero_stage;
  p.zero_ngroups = a.compute_config.zero_ngroups;
  // A dense model keeps the config's size, for the trainer to refuse by name.
  p.ep = f.experts > 0 ? best.c.ep : a.compute_config.expert_parallel_size;
  p.offload_ratio = best.c.offload_ratio;
  p.offload_params = best.c.offload_params;
  p.offload_nvme = best.c.offload_nvme;
  p.context = {best.c.cp, best.c.cp_comm, best.c.cp_balance};
  p.pipeline = {best.c.pp, best.c.stages, best.c.scheduler,
                a.global_batch_size / (a.micro_batch_size * best.c.dp), best.c.stage_layers,
                a.compute_config.pipeline.post_validation};
  p.recompute.assign(L, false);
  // The first k layers of the model, or under pp of every stage.
  const auto stages = p.pipeline.stage_layers.empty() ? std::vector<int>{L} : p.pipeline.stage_layers;
  for (int st = 0, first = 0; st < static_cast<int>(stages.size()); ++st) {
    const int n = stages[st];
    for (int i = 0; i < best.c.recompute_layers && i < n; ++i) p.recompute[first + i] = true;
    first += n;
  }
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
    const bool expert = pf.split.style == models::SplitStyle::Expert && best.c.ep > 1;
    pp.split = p.tp > 1 || expert ? split_style_name(pf.split.style) : "replicate";
    pp.global_shape = pf.shape;
    pp.local_shape = local_shape(pf, p.tp, best.c.ep);
    p.params.push_back(std::move(pp));
  }
  p.estimate = best.e;
  p.memory_budget_bytes = std::isfinite(budget) ? budget : 0.0;
  p.device = req.device.name;
  p.optimizer = a.optimizer.type;
  p.optimizer_work = optimizer_cost(req, f).what;
  p.frozen = f.frozen_what;
  p.micro_batch_size = a.micro_batch_size;
  p.seq_len = seq_len_of(a, f);
  p.grad_accumulation_steps = a.global_batch_size / (a.micro_batch_size * p.dp);
  return p;
}

}  // namespace

Plan make_plan(const PlanRequest& req, std::vector<Rejected>* rejected) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  return make_plan(req, model_facts(req), rejected);
}

Plan make_plan(const PlanRequest& req, const ModelFacts& f, std::vector<Rejected>* rejected) {
  if (!req.args) throw PlanError("plan request without config");
  if (!f.flops_per_token) throw PlanError("model facts without a FLOP count (ModelFacts::flops_per_token)");
  if (req.world_size < 1) throw PlanError("world size must be >= 1, got " + std::to_string(req.world_size));
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
           split_text(rejected[j + 1].cand) == split_text(r.cand) &&
           rejected[j + 1].cand.offload_ratio == r.cand.offload_ratio &&
           rejected[j + 1].cand.offload_params == r.cand.offload_params &&
           rejected[j + 1].cand.offload_nvme == r.cand.offload_nvme &&
           (r.cand.pp > 1 ? rejected[j + 1].cand.recompute_layers > rejected[j].cand.recompute_layers
                          : rejected[j + 1].cand.recompute_layers == rejected[j].cand.recompute_layers + 1))
      ++j;
    const auto& last = rejected[j];
    std::string head = "tp=" + std::to_string(r.cand.tp) + split_text(r.cand) + " dp=" + std::to_string(r.cand.dp) +
                       " zero=" + std::to_string(r.cand.zero_stage) + offload_text(r.cand);
    // Under pp the recompute count is per stage, out of the largest stage's layers.
    const auto& sl = r.cand.stage_layers;
    const std::string of = r.cand.pp > 1 && !sl.empty()
                               ? std::to_string(*std::max_element(sl.begin(), sl.end())) + " per stage"
                               : std::to_string(layers);
    if (r.kind == "infeasible") {
      o << "  " << head << ": infeasible: " << r.reason << "\n";
    } else if (i == j) {
      o << "  " << r.candidate << ": " << (r.kind == "memory" ? "over budget: " : "") << r.reason << "\n";
    } else {
      o << "  " << head << " recompute=" << r.cand.recompute_layers << ".." << last.cand.recompute_layers << "/" << of
        << ": ";
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
