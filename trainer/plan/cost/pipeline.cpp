// Pipeline parallelism in the cost model: the schedules a search simulates
// (ScheduleCache), the stage split, each pipeline rank's part of the model
// and its peak moment, and the bubble: the step's time through the schedule.
#include "trainer/plan/cost/pipeline.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "trainer/pipeline/schedule.h"
#include "trainer/pipeline/stages.h"
#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel {

struct ScheduleCache::Impl {
  struct Shape {
    pipeline::Schedule schedule;
    // Per rank, the moments that may be its peak: (stage, micro-batch)
    // activations held, (stage, micro-batch)s between I and W (what the split
    // backward keeps for W), boundary tensors held (sent ones not yet
    // retired, and received ones not yet used), none of them below another
    // in all three.
    std::vector<std::vector<std::array<int, 3>>> moments;
  };
  using ShapeKey = std::tuple<std::string, int, int, int>;  // scheduler, ranks, stages, micros
  std::map<ShapeKey, Shape> shapes;
  using CostKey = std::pair<ShapeKey, std::vector<double>>;  // the shape and the costs
  std::map<CostKey, pipeline::Simulation> runs;
  std::map<CostKey, pipeline::SteadyState> steady_runs;
  static CostKey cost_key(const std::string& scheduler, int ranks, int stages, int micros, const pipeline::Costs& c) {
    std::vector<double> costs{c.f, c.i, c.w, c.comm};
    for (const auto& st : c.stage) costs.insert(costs.end(), {st.f, st.i, st.w});
    return {ShapeKey{scheduler, ranks, stages, micros}, std::move(costs)};
  }

  const Shape& shape(const std::string& scheduler, int ranks, int stages, int micros) {
    const ShapeKey key{scheduler, ranks, stages, micros};
    auto it = shapes.find(key);
    if (it != shapes.end()) return it->second;
    Shape sh;
    sh.schedule = pipeline::make_schedule(scheduler, ranks, stages, micros);
    // A micro-batch's activations live from its F until its B or I (I frees
    // the graph); from its I until its W it keeps only what W needs
    // (pending_w_bytes). The order alone decides it. In the lowered order
    // (what runs), a sent tensor is kept until the wait that retires it
    // (the executor's own pipeline::retired_sends; the rest to the step's
    // end), a sent activation also until its stage's B or I (it is the
    // stage's output, backward's root), a received activation from its
    // group's post until its F (then it is the stage's saved input), a
    // received gradient until the micro-batch's B or I.
    const auto lowered = pipeline::lower(sh.schedule);
    sh.moments.assign(ranks, {});
    for (int r = 0; r < ranks; ++r) {
      int live = 0, pending = 0, boundary = 0;
      std::set<std::tuple<bool, int, int>> received;  // (gradient, stage, micro)
      auto& front = sh.moments[r];
      const auto retire = pipeline::retired_sends(lowered, r);
      // Per Send: what still keeps its tensor (its retirement; an activation's
      // output too); each hold ends after the action that ends it.
      std::vector<int> holds(lowered.actions[r].size(), 0), ending;
      std::map<std::pair<int, int>, int> output_sent;  // (stage, micro) -> the Send of its output
      for (size_t k = 0; k < lowered.actions[r].size(); ++k) {
        const auto& act = lowered.actions[r][k];
        for (int i : ending) boundary -= --holds[i] == 0;
        ending = retire[k];
        const bool done = act.op == pipeline::Op::B || act.op == pipeline::Op::I;
        if (act.op == pipeline::Op::Send) {
          ++boundary;
          holds[k] = act.grad ? 1 : 2;
          if (!act.grad) output_sent[{act.stage - 1, act.micro}] = static_cast<int>(k);
        }
        if (const auto it = output_sent.find({act.stage, act.micro}); done && it != output_sent.end())
          ending.push_back(it->second);
        if (act.op == pipeline::Op::Recv && received.insert({act.grad, act.stage, act.micro}).second) ++boundary;
        if ((act.op == pipeline::Op::F && received.erase({false, act.stage, act.micro})) ||
            (done && received.erase({true, act.stage, act.micro})))
          --boundary;
        if (act.op == pipeline::Op::F) ++live;
        if (done) --live;
        if (act.op == pipeline::Op::I) ++pending;
        if (act.op == pipeline::Op::W) --pending;
        // Keep the moment unless one already kept holds as much of all three.
        const std::array<int, 3> now{live, pending, boundary};
        auto below = [](const std::array<int, 3>& u, const std::array<int, 3>& v) {
          return u[0] <= v[0] && u[1] <= v[1] && u[2] <= v[2];
        };
        if (std::any_of(front.begin(), front.end(), [&](const auto& m) { return below(now, m); })) continue;
        front.erase(std::remove_if(front.begin(), front.end(), [&](const auto& m) { return below(m, now); }),
                    front.end());
        front.push_back(now);
      }
    }
    return shapes.emplace(key, std::move(sh)).first->second;
  }
  const pipeline::Simulation& run(const std::string& scheduler, int ranks, int stages, int micros,
                                  const pipeline::Costs& c) {
    const auto key = cost_key(scheduler, ranks, stages, micros, c);
    auto it = runs.find(key);
    if (it != runs.end()) return it->second;
    return runs.emplace(key, pipeline::simulate(shape(scheduler, ranks, stages, micros).schedule, c)).first->second;
  }
  // Consecutive steps overlapping under optimizer post-validation.
  const pipeline::SteadyState& steady(const std::string& scheduler, int ranks, int stages, int micros,
                                      const pipeline::Costs& c) {
    const auto key = cost_key(scheduler, ranks, stages, micros, c);
    auto it = steady_runs.find(key);
    if (it != steady_runs.end()) return it->second;
    return steady_runs.emplace(key, pipeline::simulate_steady(shape(scheduler, ranks, stages, micros).schedule, c))
        .first->second;
  }
};

ScheduleCache::ScheduleCache() : impl(std::make_unique<Impl>()) {}
ScheduleCache::~ScheduleCache() = default;

namespace {

// The micro-batches of one pipeline flush: the step's, global batch / (micro x dp).
int pipeline_micros(const config::TrainerArgs& a, const Candidate& c) {
  return static_cast<int>(std::max<int64_t>(1, a.global_batch_size / (a.micro_batch_size * std::max(1, c.dp))));
}

// Micro-batches the pipeline simulator runs: beyond 4 x stages (a multiple of
// pp, as interleaving needs) the schedule is in its steady state, where every
// further micro-batch adds one F + B to every rank. The zero-bubble
// schedules are simulated in full (their W now waits a bounded time, but
// their steady state has not been checked against a cap).
int simulated_micros(const std::string& scheduler, int micros, int pp, int stages) {
  const int cap = std::max(4 * stages, 2 * pp);
  if (scheduler == "zb1p" || scheduler == "zbv" || micros <= cap) return micros;
  return cap - cap % pp;
}

}  // namespace

std::vector<int> balanced_stage_split(int64_t layers, int stages, double first_extra, double last_extra) {
  if (stages < 1 || layers < stages)
    throw PlanError(std::to_string(layers) + " layers cannot fill " + std::to_string(stages) +
                    " pipeline stages (each needs at least one)");
  std::vector<double> extra(stages, 0.0);
  extra.front() += first_extra;
  extra.back() += last_extra;
  return deal_layers(layers, extra, std::vector<int>(stages, 1));
}

std::vector<int> stage_split(const PlanRequest& req, const ModelFacts& f, const Candidate& c) {
  const int stages = c.stages;
  const auto& given = req.args->compute_config.pipeline.layers;
  if (!given.empty() && static_cast<int>(given.size()) == stages) {
    int64_t sum = 0;
    for (int n : given) sum += n;
    if (sum != f.layers)
      throw PlanError("compute_config.pas_config.pipeline_layers sums to " + std::to_string(sum) + ", but the model has " +
                      std::to_string(f.layers) + " layers");
    return given;
  }
  const int64_t seq = seq_len_of(*req.args, f);
  const double attn = f.flops_per_token(seq) - f.flops_per_token(0);
  const double flops = f.flops_per_token(seq) - 0.5 * attn;  // causal: as work_per_token
  const double head = 6 * double(f.dims.vocab) * double(f.dims.hidden);
  const double layer = std::max(1.0, (flops - head) / std::max<double>(1, f.layers));
  // The embedding is a lookup (no matmul): its stage has no extra time.
  const auto balanced = balanced_stage_split(f.layers, stages, 0.0, head / layer);
  if (stages <= c.pp) return balanced;
  std::vector<double> extra(stages, 0.0);
  extra.back() = head / layer;
  return fastest_split(c.scheduler, c.pp, stages, pipeline_micros(*req.args, c), balanced, extra);
}

namespace cost {

void pipeline_term(const Setting&, Interim&, PlanEstimate&) {}

PipelineLayout pipeline_layout(const PlanRequest& req, const ModelFacts& f, const Candidate& c,
                               ScheduleCache::Impl& cache) {
  PipelineLayout pl;
  pl.stages = c.stages, pl.ranks = c.pp;
  pl.stage_layers = c.stage_layers.empty() ? stage_split(req, f, c) : c.stage_layers;
  pl.micros = pipeline_micros(*req.args, c);
  pl.m_sim = simulated_micros(c.scheduler, pl.micros, pl.ranks, pl.stages);
  const auto& shape = cache.shape(c.scheduler, pl.ranks, pl.stages, pl.m_sim);
  pl.stage_rank = &shape.schedule.stage_rank;
  pl.moments = &shape.moments;
  pl.cache = &cache;
  pl.first_layer.assign(pl.stages + 1, 0);
  for (int st = 0; st < pl.stages; ++st) pl.first_layer[st + 1] = pl.first_layer[st] + pl.stage_layers[st];
  return pl;
}

// Memory: each pipeline rank holds its stages' parameters (the embedding on
// the first stage, the final norm and head on the last; a tied embedding on
// both) with their gradients and optimizer state (ZeRO over dp x cp), and
// the activations of the micro-batches in flight at its peak.
RankPart pipeline_rank_part(const PlanRequest& req, const ModelFacts& f, const Candidate& c,
                            const PipelineLayout& pl, int r, const optim::StepCost& optimizer) {
  const int S = pl.stages;
  const auto& stage_rank = *pl.stage_rank;
  const auto& layers = pl.stage_layers;
  const auto& first_layer = pl.first_layer;
  const int micros = pl.micros, m_sim = pl.m_sim;
  RankPart part;
  part.layers = part.recomputed = 0;
  part.first = stage_rank[0] == r;
  part.last = stage_rank[S - 1] == r;
  std::vector<bool> in_layer(f.layers, false);
  int held_stages = 0;
  for (int st = 0; st < S; ++st) {
    if (stage_rank[st] != r) continue;
    ++held_stages;
    part.layers += layers[st];
    part.recomputed += std::min(c.recompute_layers, layers[st]);
    for (int l = first_layer[st]; l < first_layer[st + 1]; ++l) in_layer[l] = true;
  }
  part.held.assign(f.params.size(), false);
  for (size_t i = 0; i < f.params.size(); ++i) {
    const int u = f.params[i].unit;
    const bool before = u < 0 && f.zero3_units[i] == 0;
    part.held[i] = u >= 0 ? (u < f.layers && in_layer[u])
                          : before ? part.first || (part.last && f.dims.tied_embeddings) : part.last;
  }
  // The rank's peak moment: the most activations and boundary tensors held
  // at once, weighed by their sizes (a (stage, micro-batch)'s activations,
  // one micro-batch's hidden states). GPipe holds every micro-batch; the
  // other schedules' peak does not grow with more than the m_sim simulated.
  const double grow = c.scheduler == "gpipe" ? double(micros) / m_sim : 1.0;
  if (c.scheduler == "zb1p" || c.scheduler == "zbv")  // the split backward (models/common/weight_grad.h)
    for (int st = 0; st < S; ++st)
      if (stage_rank[st] == r) part.split_layers = std::max<double>(part.split_layers, layers[st]);
  const double stages_held = std::max(1, held_stages);
  part.live = 1.0 / stages_held;  // one (stage, micro-batch), to weigh it
  const auto one_setting = setting(req, f, c, part, &optimizer);
  const auto one = activation_term(one_setting);
  const double pair_bytes = one.saved_layers, boundary_bytes = one.sent_per_tensor;
  const double pending_bytes = pending_w_bytes(one_setting) / stages_held;
  double most = -1;
  for (const auto& [live, pending, boundary] : (*pl.moments)[r]) {
    const double bytes = grow * (live * pair_bytes + pending * pending_bytes + boundary * boundary_bytes);
    if (bytes > most) {
      most = bytes;
      part.live = grow * live / stages_held;
      part.w_live = grow * pending / stages_held;
      part.sends = grow * boundary;
    }
  }
  return part;
}

// Time: pipeline::simulate with each stage's own F, B (zero-bubble: I and W)
// times from the compute, tensor- and context-parallel terms, and the
// activation (or gradient) transfer between ranks; compute is the busiest
// rank's (the sum of the stages it holds), pp_bubble the schedule's idle
// fraction (a lighter rank's idle time counts), pp_comm_s what the transfers
// add to the makespan.
double schedule_time(const Setting& x, const PipelineLayout& pl, PlanEstimate& e) {
  const auto& c = x.c;
  const auto& a = x.a;
  const int S = pl.stages, P = pl.ranks, micros = pl.micros, m_sim = pl.m_sim;
  const auto& layers = pl.stage_layers;
  const auto& stage_rank = *pl.stage_rank;
  auto& im = *pl.cache;
  // Per-stage costs of one micro-batch.
  const auto& dev = x.req.device;
  const double peak = peak_flops_for(dev, a.precision, a.compute_config.allow_tf32) * kAssumedEfficiency;
  const double flops_token = work_per_token(x);
  const double head_flops = 6 * x.V * x.h;
  const double layer_flops = std::max(0.0, flops_token - head_flops) / std::max(1.0, x.L);
  const double tp_one = c.tp > 1 ? dev.collective_latency_s + 2 * (x.t - 1) / x.t * x.tokens * x.h * x.pb.act /
                                                                 link_bw(dev, x.t)
                                 : 0.0;
  const auto ring = cp_layer(x);
  const bool split_backward = c.scheduler == "zb1p" || c.scheduler == "zbv";
  struct StageCost {
    double f = 0, i = 0, w = 0, compute = 0, tp = 0, cp = 0, cp_contention = 0;
  };
  std::vector<StageCost> rank_cost(P);  // per micro-batch: the sum of the rank's stages
  pipeline::Costs costs{0, 0, 0, 0};
  costs.stage.resize(S);
  for (int st = 0; st < S; ++st) {
    const double n = layers[st], k = std::min<double>(c.recompute_layers, n);
    const bool head = st == S - 1, embed = st == 0;
    const double fwd = x.tokens * (n * layer_flops + (head ? head_flops : 0.0)) / 3 / x.t / peak;
    const double rec = x.tokens * k * layer_flops / 3 / x.t / peak;
    const double vocab = x.f.vocab_parallel_head && (head || embed) ? 1 : 0;
    const double tp_f = (2 * n + vocab) * tp_one, tp_b = (2 * n + 2 * k + vocab) * tp_one;
    const double cp_f = n * ring.forward_s, cp_b = n * ring.backward_s + k * ring.forward_s;
    StageCost sc;
    sc.f = fwd + tp_f + cp_f;
    // Backward is twice the forward: the input's gradient (I, with the
    // recompute and the collectives on its path) and the weights' (W).
    sc.i = (split_backward ? fwd : 2 * fwd) + rec + tp_b + cp_b;
    sc.w = split_backward ? fwd : 0.0;
    sc.compute = 3 * fwd + rec;
    sc.tp = tp_f + tp_b;
    sc.cp = cp_f + cp_b;
    sc.cp_contention = n * (ring.forward_contention_s + ring.backward_contention_s) + k * ring.forward_contention_s;
    costs.stage[st] = {sc.f, sc.i, sc.w};
    auto& rc = rank_cost[stage_rank[st]];
    rc.f += sc.f, rc.i += sc.i, rc.w += sc.w, rc.compute += sc.compute, rc.tp += sc.tp, rc.cp += sc.cp;
    rc.cp_contention += sc.cp_contention;
  }
  // The busiest rank bounds the steady state; its work is the step's compute.
  double mean_load = 0;
  const StageCost* busiest = &rank_cost[0];
  for (const auto& rc : rank_cost) {
    mean_load += (rc.f + rc.i + rc.w) / P;
    if (rc.f + rc.i + rc.w > busiest->f + busiest->i + busiest->w) busiest = &rc;
  }
  const double act_bytes = x.tokens * x.h * x.pb.act * (x.sp ? 1 / x.t : 1.0);  // each tp rank sends its share
  costs.comm = dev.collective_latency_s + act_bytes / link_bw(dev, x.t * x.cp * P);
  auto quiet = costs;
  quiet.comm = 0;
  const double beyond = double(micros - m_sim);  // micro-batches past the simulated ones
  const double extra = beyond * (busiest->f + busiest->i + busiest->w);
  double busy = 0, makespan0 = 0, makespan = 0;
  if (a.compute_config.pipeline.post_validation) {
    // Steps overlap: the step time is the steady state's period.
    const auto& with_comm = im.steady(c.scheduler, P, S, m_sim, costs);
    const auto& without = im.steady(c.scheduler, P, S, m_sim, quiet);
    for (double b : without.busy) busy += b;
    makespan0 = without.period + extra, makespan = with_comm.period + extra;
  } else {
    const auto& with_comm = im.run(c.scheduler, P, S, m_sim, costs);
    const auto& without = im.run(c.scheduler, P, S, m_sim, quiet);
    for (double b : without.busy) busy += b;
    makespan0 = without.makespan + extra, makespan = with_comm.makespan + extra;
  }
  busy = busy / double(P) + beyond * mean_load;
  e.pp_bubble = makespan0 > 0 ? 1 - busy / makespan0 : 0.0;
  e.pp_comm_s = std::max(0.0, makespan - makespan0);
  e.compute_s = micros * busiest->compute;
  e.tp_comm_s = micros * busiest->tp;
  e.cp_comm_s = micros * busiest->cp;
  e.contention_s = micros * busiest->cp_contention;
  return makespan;
}

}  // namespace cost
}  // namespace nnstrain::parallel
