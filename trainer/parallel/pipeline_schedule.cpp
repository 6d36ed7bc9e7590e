#include "trainer/parallel/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <tuple>

namespace nnstrain::parallel::pipeline {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string fail_text(const Schedule& s, const std::string& why, const std::vector<int>& waiting = {}) {
  return "pipeline schedule " + s.name + ": " + why + "\n" + grid(s, waiting);
}

std::string token(const Action& a) {
  const std::string at = std::to_string(a.stage) + "." + std::to_string(a.micro);
  switch (a.op) {
    case Op::F: return "F" + at;
    case Op::B: return "B" + at;
    case Op::I: return "I" + at;
    case Op::W: return "W" + at;
    case Op::Send: return std::string(a.grad ? "sg" : "sa") + at + ">" + std::to_string(a.peer);
    case Op::Recv: return std::string(a.grad ? "rg" : "ra") + at + "<" + std::to_string(a.peer);
  }
  return "?";
}

Schedule empty(const std::string& name, int ranks, int stages, int micros) {
  Schedule s;
  s.name = name;
  s.ranks = ranks;
  s.stages = stages;
  s.micros = micros;
  s.actions.assign(ranks, {});
  return s;
}

void place_looped(Schedule& s) {
  s.stage_rank.resize(s.stages);
  for (int st = 0; st < s.stages; ++st) s.stage_rank[st] = st % s.ranks;
}

void place_v(Schedule& s) {
  s.stage_rank.resize(s.stages);
  for (int st = 0; st < s.stages; ++st) s.stage_rank[st] = st < s.ranks ? st : 2 * s.ranks - 1 - st;
}

Schedule gpipe(int p, int m) {
  auto s = empty("gpipe", p, p, m);
  place_looped(s);
  for (int r = 0; r < p; ++r) {
    for (int j = 0; j < m; ++j) s.actions[r].push_back({Op::F, r, j});
    for (int j = 0; j < m; ++j) s.actions[r].push_back({Op::B, r, j});
  }
  return s;
}

Schedule one_f_one_b(int p, int m) {
  auto s = empty("1f1b", p, p, m);
  place_looped(s);
  for (int r = 0; r < p; ++r) {
    const int warm = std::min(p - 1 - r, m);
    auto& a = s.actions[r];
    for (int j = 0; j < warm; ++j) a.push_back({Op::F, r, j});
    for (int j = 0; j < m; ++j) {
      if (warm + j < m) a.push_back({Op::F, r, warm + j});
      a.push_back({Op::B, r, j});
    }
  }
  return s;
}

// Megatron-LM's interleaved 1F1B: the k-th forward of a rank runs chunk
// (k / p) % v on micro-batch (k / (p v)) p + k % p; backwards the chunks in reverse.
Schedule interleaved(int p, int v, int m) {
  auto s = empty("1f1b_interleaved", p, p * v, m);
  place_looped(s);
  const int total = m * v;
  auto action = [&](int r, int k, bool forward) {
    int chunk = (k % (p * v)) / p;
    if (!forward) chunk = v - 1 - chunk;
    const int micro = (k / (p * v)) * p + k % p;
    return Action{forward ? Op::F : Op::B, chunk * p + r, micro};
  };
  for (int r = 0; r < p; ++r) {
    const int warm = std::min(total, (p - r - 1) * 2 + (v - 1) * p);
    auto& a = s.actions[r];
    for (int k = 0; k < warm; ++k) a.push_back(action(r, k, true));
    for (int i = 0; i < total - warm; ++i) {
      a.push_back(action(r, warm + i, true));
      a.push_back(action(r, i, false));
    }
    for (int k = total - warm; k < total; ++k) a.push_back(action(r, k, false));
  }
  return s;
}

// ZB-H1 (the zero-bubble paper's handcrafted schedule at 1F1B's memory): rank r
// runs p - r forwards, then per micro-batch j its I, the W of micro-batch j - r
// (W delayed by r: the later ranks fill the bubbles 1F1B leaves with
// weight gradients) and the next forward; the W still pending last. At F = I =
// W it idles (p - 1)(F + I - W) per rank where 1F1B idles (p - 1)(F + I + W),
// at most p micro-batches are live (F done, W not yet) on any rank, and at most
// r + 1 W's wait on rank r.
Schedule zb_h1(int p, int m) {
  auto s = empty("zb1p", p, p, m);
  place_looped(s);
  for (int r = 0; r < p; ++r) {
    auto& a = s.actions[r];
    int next_f = 0, next_w = 0;
    while (next_f < std::min(p - r, m)) a.push_back({Op::F, r, next_f++});
    for (int j = 0; j < m; ++j) {
      a.push_back({Op::I, r, j});
      if (j >= r) a.push_back({Op::W, r, next_w++});
      if (next_f < m) a.push_back({Op::F, r, next_f++});
    }
    while (next_w < m) a.push_back({Op::W, r, next_w++});
  }
  return s;
}

// ZB-V, the zero-bubble paper's V schedule (Qi et al., "Pipeline Parallelism
// with Controllable Memory", 2024). Rank r holds chunk a = stage r and chunk
// b = stage 2p - 1 - r. Warm-up: 2(p - r) - 1 forwards of a, then r pairs of
// forwards (b, a), then p - r rounds of b's F, I, W; steady state: F, I, W of a,
// then of b; cool-down: r pairs of I (a, b), then p - r rounds of a's I and its
// oldest pending W, the W's left last. At F = I = W it idles only the V's fill
// and drain, (p - 1) / (6m + p - 1), holding at most 2p stage-activations
// (1F1B's rank 0 in half-size stages). Its steady state runs every W right
// after its I, so it keeps its timing when F, I and W (or the stages) differ:
// the list-scheduled order this replaces had no slack at equal costs and idled
// 5% at p 2, m 64 with I = 1.1 F and W = 0.9 F (4.5% at the 70B plan's pp 2
// costs, F = I = 1.3 W; 8.6% at p 4).
// Fewer than 2p - 1 micro-batches: the lists for 2p - 1 with the others'
// actions removed (dropping whole micro-batches from every rank keeps an order
// that could run, since actions wait only on their own micro-batch's).
Schedule zero_bubble_v(Schedule s) {
  const int p = s.ranks, m = s.micros, n = std::max(m, 2 * p - 1);
  for (int r = 0; r < p; ++r) {
    const int a = r, b = 2 * p - 1 - r;
    int fa = 0, fb = 0, ia = 0, ib = 0, wa = 0, wb = 0;
    std::vector<Action> row;
    auto push = [&](Op op, int stage, int& next) { row.push_back({op, stage, next++}); };
    for (int k = 0; k < 2 * (p - r) - 1; ++k) push(Op::F, a, fa);
    for (int k = 0; k < r; ++k) push(Op::F, b, fb), push(Op::F, a, fa);
    for (int k = 0; k < p - r; ++k) push(Op::F, b, fb), push(Op::I, b, ib), push(Op::W, b, wb);
    while (fa < n || fb < fa) {  // a's forwards run out first: b catches up
      if (fa < n) push(Op::F, a, fa);
      push(Op::I, a, ia), push(Op::W, a, wa);
      push(Op::F, b, fb), push(Op::I, b, ib), push(Op::W, b, wb);
    }
    for (int k = 0; k < r; ++k) push(Op::I, a, ia), push(Op::I, b, ib);
    for (int k = 0; k < p - r; ++k) push(Op::I, a, ia), push(Op::W, a, wa);
    while (wb < n) push(Op::W, b, wb);
    while (wa < n) push(Op::W, a, wa);
    for (const auto& act : row)
      if (act.micro < m) s.actions[r].push_back(act);
  }
  return s;
}

bool has_transfers(const Schedule& s) {
  for (const auto& row : s.actions)
    for (const auto& a : row)
      if (a.op == Op::Send || a.op == Op::Recv) return true;
  return false;
}

}  // namespace

const std::vector<std::string>& scheduler_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "1f1b_interleaved", "zb1p", "zbv"};
  return names;
}

int default_stages(const std::string& scheduler, int ranks) {
  return scheduler == "1f1b_interleaved" || scheduler == "zbv" ? 2 * ranks : ranks;
}

Schedule make_schedule(const std::string& scheduler, int ranks, int stages, int micros) {
  const std::string what = "pipeline_scheduler " + scheduler + " with pp_size " + std::to_string(ranks) +
                           ", pipeline_nstages " + std::to_string(stages) + ", pipeline_nmicros " +
                           std::to_string(micros) + ": ";
  if (ranks < 1 || stages < 1 || micros < 1) throw ScheduleError(what + "every count must be at least 1");
  if (scheduler == "gpipe" || scheduler == "1f1b" || scheduler == "zb1p") {
    if (stages != ranks) throw ScheduleError(what + "needs one stage per rank (pipeline_nstages == pp_size)");
    if (scheduler == "gpipe") return gpipe(ranks, micros);
    if (scheduler == "1f1b") return one_f_one_b(ranks, micros);
    return zb_h1(ranks, micros);
  }
  if (scheduler == "1f1b_interleaved") {
    if (stages % ranks != 0 || stages / ranks < 2)
      throw ScheduleError(what + "needs pipeline_nstages a multiple (2 or more) of pp_size");
    if (micros % ranks != 0) throw ScheduleError(what + "needs pipeline_nmicros a multiple of pp_size");
    return interleaved(ranks, stages / ranks, micros);
  }
  if (scheduler == "zbv") {
    if (stages != 2 * ranks) throw ScheduleError(what + "needs two stages per rank (pipeline_nstages == 2 x pp_size)");
    auto s = empty("zbv", ranks, stages, micros);
    place_v(s);
    return zero_bubble_v(std::move(s));
  }
  std::string known;
  for (const auto& n : scheduler_names()) known += (known.empty() ? "" : ", ") + n;
  throw ScheduleError("pipeline_scheduler " + scheduler + " is not one of " + known);
}

void validate(const Schedule& s) {
  if (s.ranks < 1 || s.stages < 1 || s.micros < 1 || static_cast<int>(s.actions.size()) != s.ranks)
    throw ScheduleError(fail_text(s, "ranks, stages and micros must be at least 1, one action list per rank"));
  if (static_cast<int>(s.stage_rank.size()) != s.stages)
    throw ScheduleError(fail_text(s, "the placement names " + std::to_string(s.stage_rank.size()) + " stages, not " +
                                         std::to_string(s.stages)));
  std::vector<bool> used(s.ranks, false);
  for (int st = 0; st < s.stages; ++st) {
    if (s.stage_rank[st] < 0 || s.stage_rank[st] >= s.ranks)
      throw ScheduleError(fail_text(s, "stage " + std::to_string(st) + " is placed on rank " +
                                           std::to_string(s.stage_rank[st]) + ", outside 0.." +
                                           std::to_string(s.ranks - 1)));
    used[s.stage_rank[st]] = true;
  }
  for (int r = 0; r < s.ranks; ++r)
    if (!used[r]) throw ScheduleError(fail_text(s, "rank " + std::to_string(r) + " holds no stage"));
  // Position of each compute action in its rank's list; counts.
  std::map<std::tuple<int, int, int>, int> pos;  // (op, stage, micro) -> index
  for (int r = 0; r < s.ranks; ++r) {
    for (int k = 0; k < static_cast<int>(s.actions[r].size()); ++k) {
      const auto& a = s.actions[r][k];
      if (a.op == Op::Send || a.op == Op::Recv) continue;
      const std::string what = token(a) + " on rank " + std::to_string(r);
      if (a.stage < 0 || a.stage >= s.stages || a.micro < 0 || a.micro >= s.micros)
        throw ScheduleError(fail_text(s, what + ": no such stage or micro-batch"));
      if (s.stage_rank[a.stage] != r)
        throw ScheduleError(fail_text(s, what + ": stage " + std::to_string(a.stage) + " lives on rank " +
                                             std::to_string(s.stage_rank[a.stage])));
      if (!pos.emplace(std::make_tuple(int(a.op), a.stage, a.micro), k).second)
        throw ScheduleError(fail_text(s, what + " appears twice"));
    }
  }
  auto at = [&](Op op, int st, int j) {
    auto it = pos.find({int(op), st, j});
    return it == pos.end() ? -1 : it->second;
  };
  for (int st = 0; st < s.stages; ++st) {
    for (int j = 0; j < s.micros; ++j) {
      const std::string who = "stage " + std::to_string(st) + " micro-batch " + std::to_string(j);
      const int f = at(Op::F, st, j), b = at(Op::B, st, j), i = at(Op::I, st, j), w = at(Op::W, st, j);
      if (f < 0) throw ScheduleError(fail_text(s, who + " has no forward (F)"));
      if (b >= 0 && (i >= 0 || w >= 0))
        throw ScheduleError(fail_text(s, who + " has both a whole backward (B) and a split one (I, W)"));
      if (b < 0 && (i < 0 || w < 0)) throw ScheduleError(fail_text(s, who + " has no backward (B, or I and W)"));
      if ((b >= 0 ? b : i) < f) throw ScheduleError(fail_text(s, who + ": its backward comes before its forward"));
      if (i >= 0 && w < i) throw ScheduleError(fail_text(s, who + ": W comes before I"));
    }
  }
  // A W keeps what its I left (the layers' inputs and output gradients) until
  // it runs: at most p pending per stage a rank holds, so a split backward
  // costs no more memory than 1F1B's first stage (ZB-H1 keeps r + 1 on rank r).
  for (int r = 0; r < s.ranks; ++r) {
    const int held = static_cast<int>(std::count(s.stage_rank.begin(), s.stage_rank.end(), r));
    const int bound = s.ranks * held;
    int pending = 0;
    for (const auto& a : s.actions[r]) {
      pending += a.op == Op::I ? 1 : a.op == Op::W ? -1 : 0;
      if (pending > bound)
        throw ScheduleError(fail_text(s, "rank " + std::to_string(r) + " has " + std::to_string(pending) +
                                             " weight-gradient passes (W) pending after their I at " + token(a) +
                                             ", more than pp_size x its stages = " + std::to_string(bound)));
    }
  }
}

Schedule lower(const Schedule& s) {
  validate(s);
  Schedule out = s;
  for (int r = 0; r < s.ranks; ++r) {
    auto& row = out.actions[r];
    row.clear();
    for (const auto& a : s.actions[r]) {
      const bool fwd = a.op == Op::F, bwd = a.op == Op::B || a.op == Op::I;
      if (fwd && a.stage > 0 && s.stage_rank[a.stage - 1] != r)
        row.push_back({Op::Recv, a.stage, a.micro, s.stage_rank[a.stage - 1], false});
      if (bwd && a.stage + 1 < s.stages && s.stage_rank[a.stage + 1] != r)
        row.push_back({Op::Recv, a.stage, a.micro, s.stage_rank[a.stage + 1], true});
      row.push_back(a);
      if (fwd && a.stage + 1 < s.stages && s.stage_rank[a.stage + 1] != r)
        row.push_back({Op::Send, a.stage + 1, a.micro, s.stage_rank[a.stage + 1], false});
      if (bwd && a.stage > 0 && s.stage_rank[a.stage - 1] != r)
        row.push_back({Op::Send, a.stage - 1, a.micro, s.stage_rank[a.stage - 1], true});
    }
  }
  return out;
}

std::vector<std::vector<int>> retired_sends(const Schedule& s, int rank) {
  using Key = std::tuple<bool, int, int>;  // (gradient, consumer stage, micro-batch): the message, as its tag
  const auto& row = s.actions.at(rank);
  std::vector<std::vector<int>> out(row.size());
  std::map<Key, int> my_send;  // our sends, by message
  for (int k = 0; k < static_cast<int>(row.size()); ++k)
    if (row[k].op == Op::Send) my_send[{row[k].grad, row[k].stage, row[k].micro}] = k;
  // Per peer q: the messages q receives from us, in q's order; and for each
  // message q sends us, how many of those precede it in q's row.
  std::vector<std::vector<Key>> their_recvs(s.ranks);
  std::map<std::pair<int, Key>, size_t> before_send;
  for (int q = 0; q < s.ranks; ++q) {
    if (q == rank) continue;
    for (const auto& a : s.actions[q]) {
      if (a.peer != rank) continue;
      if (a.op == Op::Recv) their_recvs[q].push_back({a.grad, a.stage, a.micro});
      if (a.op == Op::Send) before_send[{q, {a.grad, a.stage, a.micro}}] = their_recvs[q].size();
    }
  }
  std::vector<size_t> done(s.ranks, 0);  // per peer: the prefix of its receives already retired
  for (int k = 0; k < static_cast<int>(row.size()); ++k) {
    const auto& a = row[k];
    if (a.op != Op::Recv) continue;
    const auto it = before_send.find({a.peer, {a.grad, a.stage, a.micro}});
    if (it == before_send.end())
      throw ScheduleError(fail_text(s, "rank " + std::to_string(rank) + "'s " + token(a) + " has no matching send"));
    for (; done[a.peer] < it->second; ++done[a.peer]) {
      const auto& key = their_recvs[a.peer][done[a.peer]];
      const auto mine = my_send.find(key);
      if (mine == my_send.end() || mine->second > k)
        throw ScheduleError(fail_text(s, "rank " + std::to_string(a.peer) + " receives from rank " +
                                             std::to_string(rank) + " what it has not sent before " + token(a)));
      out[k].push_back(mine->second);
    }
  }
  return out;
}

namespace {

// The mean over ranks of a simulation's (or steady state's) idle fractions.
template <typename Sim>
double mean_over_ranks(const Sim& sim) {
  if (sim.busy.empty()) return 0;
  double sum = 0;
  for (size_t r = 0; r < sim.busy.size(); ++r) sum += sim.bubble(static_cast<int>(r));
  return sum / double(sim.busy.size());
}

}  // namespace

double Simulation::mean_bubble() const { return mean_over_ranks(*this); }

namespace {

// The simulation of `steps` consecutive steps: each rank runs its row once per
// step, in order. Step n > 0's actions at or after prefix[r] in rank r's row
// also wait for every rank to have finished step n - 1 (the optimizer step
// between them takes no time here); its first prefix[r] actions only for rank
// r itself (post-validation's leading forwards). Empty prefix: every action.
struct Run {
  Simulation sim;
  std::vector<double> step_end;  // per step: when its last rank finished it
};

Run run_steps(const Schedule& s, const Costs& c, int steps, const std::vector<int>& prefix) {
  const bool lowered = has_transfers(s);
  const int S = s.stages, m = s.micros;
  if (!c.stage.empty() && static_cast<int>(c.stage.size()) != S)
    throw ScheduleError(fail_text(s, "costs for " + std::to_string(c.stage.size()) + " stages, not " + std::to_string(S)));
  auto idx = [&](int n, int st, int j) { return (static_cast<size_t>(n) * S + st) * m + j; };
  // Finish times: compute actions by (step, stage, micro); messages by (step, grad, consumer stage, micro).
  std::vector<double> f_done(static_cast<size_t>(steps) * S * m, kInf), back_done = f_done, w_done = f_done;
  std::map<std::tuple<int, bool, int, int>, double> sent, received;
  std::vector<size_t> next(s.ranks, 0);  // over the row repeated `steps` times
  std::vector<double> free_at(s.ranks, 0.0);
  std::vector<int> finished(steps, 0);   // ranks done with each step
  Run out;
  out.step_end.assign(steps, 0.0);
  Simulation& sim = out.sim;
  sim.busy.assign(s.ranks, 0.0);
  sim.peak_live.assign(s.ranks, 0);
  std::vector<int> live(s.ranks, 0);
  size_t left = 0;
  for (const auto& row : s.actions) left += row.size() * steps;

  // When rank r's action a of step n could start (kInf: what it needs is not done yet).
  auto ready_at = [&](int r, int n, size_t k, const Action& a) -> double {
    auto cross = [&](int producer_stage, double done) {  // a dependency, maybe on another rank
      if (s.stage_rank[producer_stage] == s.stage_rank[a.stage] || done == kInf) return done;
      if (!lowered) return done + c.comm;
      const bool grad = producer_stage > a.stage;
      auto it = received.find({n, grad, a.stage, a.micro});
      return it == received.end() ? kInf : it->second;
    };
    double dep = 0;
    switch (a.op) {
      case Op::F:
        if (a.stage > 0) dep = cross(a.stage - 1, f_done[idx(n, a.stage - 1, a.micro)]);
        break;
      case Op::B:
      case Op::I:
        dep = f_done[idx(n, a.stage, a.micro)];
        if (a.stage + 1 < S) dep = std::max(dep, cross(a.stage + 1, back_done[idx(n, a.stage + 1, a.micro)]));
        break;
      case Op::W:
        dep = back_done[idx(n, a.stage, a.micro)];
        break;
      case Op::Send: {
        // What is sent was produced by this rank: the forward of the stage before
        // the consumer, or the backward of the stage after it.
        const int producer = a.grad ? a.stage + 1 : a.stage - 1;
        dep = a.grad ? back_done[idx(n, producer, a.micro)] : f_done[idx(n, producer, a.micro)];
        break;
      }
      case Op::Recv: {
        auto it = sent.find({n, a.grad, a.stage, a.micro});
        dep = it == sent.end() ? kInf : it->second + c.comm;
        break;
      }
    }
    if (n > 0 && (prefix.empty() || static_cast<int>(k) >= prefix[r]))
      dep = std::max(dep, finished[n - 1] == s.ranks ? out.step_end[n - 1] : kInf);
    return std::max(dep, free_at[r]);
  };

  while (left > 0) {
    int best = -1;
    double best_t = kInf;
    for (int r = 0; r < s.ranks; ++r) {
      const size_t len = s.actions[r].size();
      if (next[r] >= len * steps) continue;
      const int n = static_cast<int>(next[r] / len);
      const size_t k = next[r] % len;
      const double t = ready_at(r, n, k, s.actions[r][k]);
      if (t < best_t) best_t = t, best = r;
    }
    if (best < 0) {
      std::vector<int> waiting(s.ranks, -1);
      std::string who;
      for (int r = 0; r < s.ranks; ++r) {
        const size_t len = s.actions[r].size();
        if (next[r] < len * steps) {
          waiting[r] = static_cast<int>(next[r] % len);
          who += (who.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " on " +
                 token(s.actions[r][next[r] % len]);
        }
      }
      throw ScheduleError(fail_text(s, "deadlock: no rank can go on (" + who + ")", waiting));
    }
    const size_t len = s.actions[best].size();
    const int n = static_cast<int>(next[best] / len);
    const auto& a = s.actions[best][next[best] % len];
    ++next[best];
    --left;
    double dur = 0;
    const bool own = !c.stage.empty() && a.op != Op::Send && a.op != Op::Recv;
    const double cf = own ? c.stage[a.stage].f : c.f, ci = own ? c.stage[a.stage].i : c.i,
                 cw = own ? c.stage[a.stage].w : c.w;
    switch (a.op) {
      case Op::F: dur = cf; break;
      case Op::B: dur = ci + cw; break;
      case Op::I: dur = ci; break;
      case Op::W: dur = cw; break;
      default: break;  // transfers cost the receiver c.comm of waiting, no compute
    }
    const double end = best_t + dur;
    free_at[best] = end;
    sim.busy[best] += dur;
    sim.makespan = std::max(sim.makespan, end);
    const size_t i = idx(n, a.stage, a.micro);
    switch (a.op) {
      case Op::F:
        f_done[i] = end;
        sim.peak_live[best] = std::max(sim.peak_live[best], ++live[best]);
        break;
      case Op::B:
        back_done[i] = w_done[i] = end;
        --live[best];
        break;
      case Op::I: back_done[i] = end; break;
      case Op::W:
        w_done[i] = end;
        --live[best];
        break;
      case Op::Send: sent[{n, a.grad, a.stage, a.micro}] = end; break;
      case Op::Recv: received[{n, a.grad, a.stage, a.micro}] = end; break;
    }
    if (next[best] % len == 0) {  // this rank finished step n
      ++finished[n];
      out.step_end[n] = std::max(out.step_end[n], end);
    }
  }
  return out;
}

}  // namespace

Simulation simulate(const Schedule& s, const Costs& c) { return run_steps(s, c, 1, {}).sim; }

std::vector<int> post_validation_prefix(const Schedule& lowered) {
  const auto& rows = lowered.actions;
  const int R = lowered.ranks;
  // Each rank's row up to its first backward work (B, I, W or a gradient transfer).
  std::vector<int> cut(R, 0);
  for (int r = 0; r < R; ++r) {
    const auto& row = rows[r];
    while (cut[r] < static_cast<int>(row.size()) &&
           (row[cut[r]].op == Op::F || ((row[cut[r]].op == Op::Send || row[cut[r]].op == Op::Recv) && !row[cut[r]].grad)))
      ++cut[r];
  }
  // Where each activation message is sent and received: (consumer stage, micro) -> (rank, position).
  std::map<std::pair<int, int>, std::pair<int, int>> send_at, recv_at;
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < static_cast<int>(rows[r].size()); ++k) {
      const auto& a = rows[r][k];
      if (a.grad) continue;
      if (a.op == Op::Send) send_at[{a.stage, a.micro}] = {r, k};
      if (a.op == Op::Recv) recv_at[{a.stage, a.micro}] = {r, k};
    }
  // Shrink to the largest cut every message crosses whole: sent inside one
  // prefix iff received inside the other (cuts only shrink, so this ends).
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < cut[r]; ++k) {
        const auto& a = rows[r][k];
        if (a.op != Op::Send && a.op != Op::Recv) continue;
        const auto& other = (a.op == Op::Send ? recv_at : send_at)[{a.stage, a.micro}];
        if (other.second >= cut[other.first]) {
          cut[r] = k;
          changed = true;
          break;
        }
      }
  }
  return cut;
}

SteadyState simulate_steady(const Schedule& s, const Costs& c, bool post_validation) {
  const auto lowered = has_transfers(s) ? s : lower(s);
  // Enough steps for the pattern to repeat; the period from the later ones.
  constexpr int kSteps = 8, kTimed = 4;
  const auto run = run_steps(lowered, c, kSteps, post_validation ? post_validation_prefix(lowered) : std::vector<int>(s.ranks, 0));
  SteadyState st;
  st.period = (run.step_end[kSteps - 1] - run.step_end[kSteps - 1 - kTimed]) / kTimed;
  for (double b : run.sim.busy) st.busy.push_back(b / kSteps);
  st.peak_live = run.sim.peak_live;
  return st;
}

double SteadyState::mean_bubble() const { return mean_over_ranks(*this); }

std::string grid(const Schedule& s, const std::vector<int>& waiting) {
  std::ostringstream o;
  for (int r = 0; r < static_cast<int>(s.actions.size()); ++r) {
    o << "  rank " << r << " |";
    for (int k = 0; k < static_cast<int>(s.actions[r].size()); ++k) {
      const bool mark = r < static_cast<int>(waiting.size()) && waiting[r] == k;
      o << ' ' << (mark ? "[" : "") << token(s.actions[r][k]) << (mark ? "]" : "");
    }
    o << '\n';
  }
  return o.str();
}

std::string to_text(const Schedule& s) {
  std::ostringstream o;
  o << "schedule " << s.name << " ranks " << s.ranks << " stages " << s.stages << " micros " << s.micros << "\n";
  o << "placement";
  for (int r : s.stage_rank) o << ' ' << r;
  o << "\n";
  for (int r = 0; r < static_cast<int>(s.actions.size()); ++r) {
    o << "rank " << r << ":";
    for (const auto& a : s.actions[r]) o << ' ' << token(a);
    o << "\n";
  }
  return o.str();
}

Schedule from_text(const std::string& text, const std::string& what) {
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  Schedule s;
  auto bad = [&](const std::string& why) {
    return ScheduleError(what + " line " + std::to_string(line_no) + ": " + why);
  };
  auto parse_int = [&](const std::string& t) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != t.size() || t.empty()) throw bad("'" + t + "' is not a whole number");
    return v;
  };
  bool header = false, placement = false;
  while (std::getline(in, line)) {
    ++line_no;
    std::istringstream words(line);
    std::string key;
    if (!(words >> key) || key[0] == '#') continue;
    if (key == "schedule") {
      std::string k1, v1, k2, v2, k3, v3;
      if (!(words >> s.name >> k1 >> v1 >> k2 >> v2 >> k3 >> v3) || k1 != "ranks" || k2 != "stages" || k3 != "micros")
        throw bad("expected 'schedule NAME ranks R stages S micros M'");
      s.ranks = parse_int(v1), s.stages = parse_int(v2), s.micros = parse_int(v3);
      if (s.ranks < 1 || s.ranks > 4096 || s.stages < 1 || s.stages > 65536 || s.micros < 1 || s.micros > 1 << 20)
        throw bad("ranks, stages and micros out of range");
      s.actions.assign(s.ranks, {});
      header = true;
    } else if (key == "placement") {
      if (!header) throw bad("placement before the schedule line");
      std::string t;
      while (words >> t) s.stage_rank.push_back(parse_int(t));
      placement = true;
    } else if (key == "rank") {
      if (!placement) throw bad("a rank's actions before the placement line");
      std::string r_text;
      words >> r_text;
      if (r_text.empty() || r_text.back() != ':') throw bad("expected 'rank R: ACTION ...'");
      const int r = parse_int(r_text.substr(0, r_text.size() - 1));
      if (r < 0 || r >= s.ranks) throw bad("rank " + std::to_string(r) + " outside 0.." + std::to_string(s.ranks - 1));
      std::string t;
      while (words >> t) {
        Action a;
        const char c = t[0];
        if (c == 'F') a.op = Op::F;
        else if (c == 'B') a.op = Op::B;
        else if (c == 'I') a.op = Op::I;
        else if (c == 'W') a.op = Op::W;
        else throw bad("'" + t + "' is not an action (F, B, I or W followed by STAGE.MICRO)");
        const auto dot = t.find('.');
        if (dot == std::string::npos) throw bad("'" + t + "': expected STAGE.MICRO after the letter");
        a.stage = parse_int(t.substr(1, dot - 1));
        a.micro = parse_int(t.substr(dot + 1));
        s.actions[r].push_back(a);
      }
    } else {
      throw bad("unknown line '" + key + "' (schedule, placement or rank)");
    }
  }
  if (!header || !placement) throw ScheduleError(what + ": no 'schedule' and 'placement' lines");
  validate(s);
  return s;
}

uint64_t hash(const Schedule& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : to_text(s)) {
    h ^= ch;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace nnstrain::parallel::pipeline
