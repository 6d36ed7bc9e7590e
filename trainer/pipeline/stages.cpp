#include "trainer/pipeline/stages.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "base/config/arg_map.h"
#include "trainer/pipeline/schedule.h"

namespace nnstrain::parallel {

PipelinePlan pipeline_plan(const config::PipelineArgs& a, int64_t grad_accumulation_steps, int64_t layers) {
  const std::string key = "compute_config.pas_config.";
  PipelinePlan p;
  p.pp = a.pp_size;
  p.scheduler = a.scheduler;
  p.post_validation = a.post_validation;
  p.nmicros = a.nmicros > 0 ? a.nmicros : grad_accumulation_steps;
  p.stages = a.nstages > 0                ? a.nstages
             : !a.layers.empty()          ? static_cast<int>(a.layers.size())
                                          : pipeline::default_stages(a.scheduler, a.pp_size);
  if (!a.layers.empty()) {
    const int64_t sum = std::accumulate(a.layers.begin(), a.layers.end(), int64_t{0});
    if (sum != layers)
      throw config::ConfigError(key + "pipeline_layers: the stages hold " + std::to_string(sum) +
                                " layers but the model has " + std::to_string(layers));
    p.stage_layers = a.layers;
  } else {
    if (layers < p.stages)
      throw config::ConfigError(key + "pipeline_nstages: " + std::to_string(p.stages) + " stages (pp_size " +
                                std::to_string(p.pp) + ", pipeline_scheduler " + p.scheduler + ") but the model has only " +
                                std::to_string(layers) + " layers; every stage needs at least one");
    // Left empty: the planner balances the layers (cost_model.h stage_split).
  }
  try {
    pipeline::make_schedule(p.scheduler, p.pp, p.stages, static_cast<int>(p.nmicros));
  } catch (const pipeline::ScheduleError& e) {
    throw config::ConfigError(key + "pipeline_scheduler: " + e.what());
  }
  return p;
}

std::vector<int> deal_layers(int64_t layers, const std::vector<double>& fixed, std::vector<int> n) {
  for (int64_t left = layers - std::accumulate(n.begin(), n.end(), int64_t{0}); left > 0; --left) {
    size_t best = 0;
    for (size_t k = 1; k < n.size(); ++k)
      if (n[k] + 1 + fixed[k] < n[best] + 1 + fixed[best] - 1e-12) best = k;
    ++n[best];
  }
  return n;
}

std::vector<int> fastest_split(const std::string& scheduler, int ranks, int stages, int micros,
                               const std::vector<int>& start, const std::vector<double>& extra) {
  if (stages <= ranks || static_cast<int>(start.size()) != stages || static_cast<int>(extra.size()) != stages)
    return start;
  const int64_t layers = std::accumulate(start.begin(), start.end(), int64_t{0});
  // Simulated: enough micro-batches for the steady state (2 per stage, a
  // multiple of the ranks as interleaving needs); each further one adds the
  // busiest rank's work, as the cost model extrapolates.
  const int simulated = std::min(micros, 2 * stages);
  const auto s = pipeline::make_schedule(scheduler, ranks, stages, simulated);
  auto rank_load = [&](const std::vector<int>& n) {  // per micro-batch: F + I + W of its stages
    std::vector<double> load(ranks, 0.0);
    for (int st = 0; st < stages; ++st) load[s.stage_rank[st]] += 3 * (n[st] + extra[st]);
    return load;
  };
  auto busiest = [&](const std::vector<int>& n) {
    const auto load = rank_load(n);
    return *std::max_element(load.begin(), load.end());
  };
  auto step = [&](const std::vector<int>& n) {
    pipeline::Costs c;
    for (int st = 0; st < stages; ++st) {
      const double cost = n[st] + extra[st];
      c.stage.push_back({cost, cost, cost});
    }
    return pipeline::simulate(s, c).makespan + double(micros - simulated) * busiest(n);
  };
  // The per-rank balance: each rank's share of the layers by the total of its
  // stages (their extras), then that share over its stages.
  std::vector<double> rank_extra(ranks, 0.0);
  std::vector<int> rank_least(ranks, 0);
  for (int st = 0; st < stages; ++st) rank_extra[s.stage_rank[st]] += extra[st], ++rank_least[s.stage_rank[st]];
  const auto per_rank = deal_layers(layers, rank_extra, rank_least);
  std::vector<int> ranked(stages, 1);
  for (int r = 0; r < ranks; ++r) {
    std::vector<int> mine;
    std::vector<double> fixed;
    for (int st = 0; st < stages; ++st)
      if (s.stage_rank[st] == r) mine.push_back(st), fixed.push_back(extra[st]);
    const auto n = deal_layers(per_rank[r], fixed, std::vector<int>(mine.size(), 1));
    for (size_t k = 0; k < mine.size(); ++k) ranked[mine[k]] = n[k];
  }
  // No stage above start's largest: a stage's activations, and the recompute
  // count the planner tries per stage, grow with its layers.
  const int most = *std::max_element(start.begin(), start.end());
  auto best = start;
  double best_t = step(start);
  auto faster = [](double t, double than) { return t < than * (1 - 1e-9); };
  if (*std::max_element(ranked.begin(), ranked.end()) <= most)
    if (const double t = step(ranked); faster(t, best_t)) best = ranked, best_t = t;
  // Neighbours: one layer from one stage to another, the best move per
  // round. The busiest rank's work bounds a step from below: a move whose
  // bound is no faster is not simulated. The search stops once it has
  // simulated kSearchWork rank-actions (a pipeline of 64 stages affords part
  // of one round; 16 stages at 32 micro-batches, three).
  constexpr double kSearchWork = 1e7;
  const double per_step = double(ranks) * 3 * stages * simulated;
  double work = 2 * per_step;
  for (int64_t round = 0; round < layers && work < kSearchWork; ++round) {
    std::vector<int> next;
    double next_t = best_t;
    for (int from = 0; from < stages && work < kSearchWork; ++from)
      for (int to = 0; to < stages && work < kSearchWork; ++to) {
        if (from == to || best[from] <= 1 || best[to] >= most) continue;
        auto c = best;
        --c[from], ++c[to];
        if (!faster(micros * busiest(c), next_t)) continue;
        work += per_step;
        if (const double t = step(c); faster(t, next_t)) next = c, next_t = t;
      }
    if (next.empty()) break;
    best = next, best_t = next_t;
  }
  return best;
}

std::vector<StageBlocks> stage_blocks(const PipelinePlan& p) {
  std::vector<StageBlocks> out;
  int64_t at = 0;
  for (int n : p.stage_layers) {
    out.push_back({at, at + n});
    at += n;
  }
  return out;
}

}  // namespace nnstrain::parallel
