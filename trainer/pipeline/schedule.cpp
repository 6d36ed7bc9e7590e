#include "trainer/pipeline/schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

namespace nnstrain::parallel::pipeline {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string fail_text(const Schedule& s, const std::string& why, const std::vector<int>& waiting = {}) {
  return "pipeline schedule " + s.name + ": " + why + "\n" + grid(s, waiting);
}

std::string token(const Action& a) {
  if ((a.op == Op::Send || a.op == Op::Recv) && a.stage < 0)  // the tied embedding's gradient
    return a.op == Op::Send ? "st>" + std::to_string(a.peer) : "rt<" + std::to_string(a.peer);
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

bool is_transfer(const Action& a) { return a.op == Op::Send || a.op == Op::Recv; }

bool has_transfers(const Schedule& s) {
  for (const auto& row : s.actions)
    for (const auto& a : row)
      if (is_transfer(a)) return true;
  return false;
}

// One row as text: transfers of one group joined by '+'; `mark` in [brackets].
std::string row_text(const std::vector<Action>& row, int mark = -1) {
  std::string o;
  for (size_t k = 0; k < row.size(); ++k) {
    const bool joined = k > 0 && is_transfer(row[k]) && is_transfer(row[k - 1]) && row[k].group >= 0 &&
                        row[k].group == row[k - 1].group;
    const bool m = static_cast<int>(k) == mark;
    o += (joined ? "+" : " ") + std::string(m ? "[" : "") + token(row[k]) + (m ? "]" : "");
  }
  return o;
}

std::vector<int> stages_of(const Schedule& s, int rank) {
  std::vector<int> out;
  for (int st = 0; st < s.stages; ++st)
    if (s.stage_rank[st] == rank) out.push_back(st);
  return out;
}

// Start and end of every action of compute lists when each rank runs its list
// in order at F = I = W = 1 (B = 2) and transfers are free: the order of keys
// lower() posts transfers by. Whole numbers, so every rank computes the same.
std::vector<std::vector<std::pair<int64_t, int64_t>>> unit_times(const Schedule& s) {
  const int S = s.stages, m = s.micros;
  std::vector<int64_t> f_end(static_cast<size_t>(S) * m, -1), back_end = f_end;
  auto at = [&](int st, int j) { return static_cast<size_t>(st) * m + j; };
  std::vector<std::vector<std::pair<int64_t, int64_t>>> out(s.ranks);
  std::vector<int64_t> free_at(s.ranks, 0);
  for (int r = 0; r < s.ranks; ++r) out[r].reserve(s.actions[r].size());
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      for (auto& row = s.actions[r]; out[r].size() < row.size();) {
        const auto& a = row[out[r].size()];
        int64_t dep = 0;
        if (a.op == Op::F && a.stage > 0) dep = f_end[at(a.stage - 1, a.micro)];
        if (a.op == Op::B || a.op == Op::I) {
          dep = f_end[at(a.stage, a.micro)];
          if (dep >= 0 && a.stage + 1 < S) {
            const int64_t g = back_end[at(a.stage + 1, a.micro)];
            dep = g < 0 ? -1 : std::max(dep, g);
          }
        }
        if (a.op == Op::W) dep = back_end[at(a.stage, a.micro)];
        if (dep < 0) break;  // waits on another rank's action not yet timed
        const int64_t start = std::max(dep, free_at[r]), end = start + (a.op == Op::B ? 2 : 1);
        if (a.op == Op::F) f_end[at(a.stage, a.micro)] = end;
        if (a.op == Op::B || a.op == Op::I) back_end[at(a.stage, a.micro)] = end;
        free_at[r] = end;
        out[r].emplace_back(start, end);
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.ranks; ++r)
    if (out[r].size() < s.actions[r].size()) {
      std::vector<int> waiting(s.ranks, -1);
      for (int q = 0; q < s.ranks; ++q)
        if (out[q].size() < s.actions[q].size()) waiting[q] = static_cast<int>(out[q].size());
      throw ScheduleError(fail_text(s, "deadlock: no rank can go on", waiting));
    }
  return out;
}

// lower() and lower_forward(): every crossing message keyed by its producer's
// end (unit_times), posted at that key on both ends (lower()'s comment).
Schedule lower_keyed(const Schedule& s, bool forward_only) {
  const auto times = unit_times(s);
  struct Keyed {
    int64_t key;
    Action a;
  };
  std::vector<std::vector<Keyed>> xfer(s.ranks);
  auto cross = [&](int r, int64_t key, int stage, int micro, bool grad) {
    const int q = s.stage_rank[stage];
    xfer[r].push_back({key, {Op::Send, stage, micro, q, grad}});
    xfer[q].push_back({key, {Op::Recv, stage, micro, r, grad}});
  };
  for (int r = 0; r < s.ranks; ++r)
    for (size_t k = 0; k < s.actions[r].size(); ++k) {
      const auto& a = s.actions[r][k];
      const int64_t end = times[r][k].second;
      if (a.op == Op::F && a.stage + 1 < s.stages && s.stage_rank[a.stage + 1] != r)
        cross(r, end, a.stage + 1, a.micro, false);
      if (!forward_only && (a.op == Op::B || a.op == Op::I) && a.stage > 0 && s.stage_rank[a.stage - 1] != r)
        cross(r, end, a.stage - 1, a.micro, true);
    }
  Schedule out = s;
  for (int r = 0; r < s.ranks; ++r) {
    auto& x = xfer[r];
    std::sort(x.begin(), x.end(), [](const Keyed& u, const Keyed& v) {
      return std::make_tuple(u.key, u.a.op == Op::Recv, u.a.peer, u.a.grad, u.a.stage, u.a.micro) <
             std::make_tuple(v.key, v.a.op == Op::Recv, v.a.peer, v.a.grad, v.a.stage, v.a.micro);
    });
    auto& row = out.actions[r];
    row.clear();
    size_t i = 0;
    int group = -1;
    auto post_through = [&](int64_t key) {  // the groups keyed at or before `key`
      for (; i < x.size() && x[i].key <= key; ++i) {
        if (i == 0 || x[i].key != x[i - 1].key) ++group;
        row.push_back(x[i].a);
        row.back().group = group;
      }
    };
    for (size_t k = 0; k < s.actions[r].size(); ++k) {
      post_through(times[r][k].first);
      row.push_back(s.actions[r][k]);
    }
    post_through(std::numeric_limits<int64_t>::max());
  }
  return out;
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
  if (has_transfers(s)) throw ScheduleError(fail_text(s, "already lowered (it holds transfers)"));
  return lower_keyed(s, false);
}

Schedule lower_forward(const Schedule& s) {
  Schedule f = s;
  f.name = s.name + " (evaluation)";
  f.micros = 1;
  for (int r = 0; r < s.ranks; ++r) {
    f.actions[r].clear();
    for (int st : stages_of(s, r)) f.actions[r].push_back({Op::F, st, 0});
  }
  return lower_keyed(f, true);
}

std::vector<int> group_waits(const Schedule& s, int rank) {
  const auto& row = s.actions.at(rank);
  std::map<std::tuple<bool, int, int>, int> recv_group;  // (gradient, consumer stage, micro) -> its group
  for (const auto& a : row)
    if (a.op == Op::Recv) recv_group[{a.grad, a.stage, a.micro}] = a.group;
  std::vector<int> out(row.size(), -1);
  for (size_t k = 0; k < row.size(); ++k) {
    const auto& a = row[k];
    const bool backward = a.op == Op::B || a.op == Op::I;
    if (a.op != Op::F && !backward) continue;
    const auto it = recv_group.find({backward, a.stage, a.micro});
    if (it != recv_group.end()) out[k] = it->second;
  }
  return out;
}

std::vector<std::vector<int>> retired_sends(const Schedule& s, int rank) {
  const auto& row = s.actions.at(rank);
  const auto waits = group_waits(s, rank);
  std::vector<std::vector<int>> out(row.size());
  std::vector<int> sends;  // positions, in row order (their groups ascending)
  for (size_t k = 0; k < row.size(); ++k)
    if (row[k].op == Op::Send) sends.push_back(static_cast<int>(k));
  size_t next = 0;
  for (size_t k = 0; k < row.size(); ++k)
    for (; waits[k] >= 0 && next < sends.size() && row[sends[next]].group <= waits[k]; ++next)
      out[k].push_back(sends[next]);
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
  std::map<std::tuple<int, bool, int, int>, double> sent;
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
      auto it = sent.find({n, grad, a.stage, a.micro});
      return it == sent.end() ? kInf : it->second + c.comm;
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
        if (a.stage < 0) break;  // the tied gradient: after the step
        const int producer = a.grad ? a.stage + 1 : a.stage - 1;
        dep = a.grad ? back_done[idx(n, producer, a.micro)] : f_done[idx(n, producer, a.micro)];
        break;
      }
      case Op::Recv: break;  // posted; its consumer waits for the message
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
    const size_t i = a.stage < 0 ? 0 : idx(n, a.stage, a.micro);  // stage -1: the tied gradient, waited on by nothing here
    switch (a.stage < 0 ? Op::Recv : a.op) {
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
      case Op::Recv: break;
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
  // The first position of the group holding action k of `row` (k itself for a compute action).
  auto group_start = [](const std::vector<Action>& row, int k) {
    while (k > 0 && is_transfer(row[k]) && is_transfer(row[k - 1]) && row[k - 1].group == row[k].group) --k;
    return k;
  };
  // Each rank's row up to its first backward work (B, I, W, or a group with a gradient transfer).
  std::vector<int> cut(R, 0);
  for (int r = 0; r < R; ++r) {
    const auto& row = rows[r];
    const int n = static_cast<int>(row.size());
    for (int k = 0; k < n;) {
      if (row[k].op == Op::F) {
        cut[r] = ++k;
        continue;
      }
      if (!is_transfer(row[k])) break;
      int end = k;
      bool forward = true;
      for (; end < n && is_transfer(row[end]) && row[end].group == row[k].group; ++end) forward = forward && !row[end].grad;
      if (!forward) break;
      cut[r] = k = end;
    }
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
  // Shrink to the largest cuts, between groups, every message crosses whole:
  // sent inside one prefix iff received inside the other (cuts only shrink,
  // so this ends).
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < cut[r]; ++k) {
        const auto& a = rows[r][k];
        if (!is_transfer(a)) continue;
        const auto& other = (a.op == Op::Send ? recv_at : send_at)[{a.stage, a.micro}];
        if (other.second >= cut[other.first]) {
          cut[r] = group_start(rows[r], k);
          changed = true;
          break;
        }
      }
  }
  return cut;
}

namespace {

// check_backend_rules: what each rank issues, in order, over the steps checked.
struct Item {
  enum Kind { Compute, Group, Sync } kind = Compute;
  int step = 0;              // which step's message this is (a rerun prefix: a step of its own)
  std::vector<Action> acts;  // Compute: the one action (none: the step's end, waiting for every group); Group: its transfers
  int waits = -1;            // Compute: the item index of the group it waits on
  int pos = -1;              // the row position of its first action (-1: not in the row)
};
using Program = std::vector<Item>;

std::string label(const Item& it, const Action& a) {
  return token(a) + (it.step == 1 ? " of the next step" : it.step == 2 ? " of the next step's rerun prefix" : "");
}

std::string label(const Item& it) {
  if (it.kind == Item::Sync) return "host sync (the validation)";
  if (it.acts.empty()) return std::string("wait for every group at the step's end") + (it.step ? " (next step)" : "");
  return label(it, it.acts.front());
}

// The finish of a step (or before a rerun prefix): the compute stream waits
// for every group posted so far, as the executor's finish_sends does.
void append_wait_all(Program& prog, int step) {
  int last = -1;
  for (int i = 0; i < static_cast<int>(prog.size()); ++i)
    if (prog[i].kind == Item::Group) last = i;
  prog.push_back({Item::Compute, step, {}, last, -1});
}

// Rank r's program: row[from, to) of `step` appended; waits resolved to the
// latest instance of each group posted so far (`posted`: row group -> item).
void append(Program& prog, const std::vector<Action>& row, const std::vector<int>& waits, size_t from, size_t to,
            int step, std::map<int, int>& posted) {
  for (size_t k = from; k < to;) {
    if (is_transfer(row[k])) {
      Item g{Item::Group, step, {}, -1, static_cast<int>(k)};
      const int id = row[k].group;
      for (; k < to && is_transfer(row[k]) && row[k].group == id; ++k) g.acts.push_back(row[k]);
      posted[id] = static_cast<int>(prog.size());
      prog.push_back(std::move(g));
      continue;
    }
    Item c{Item::Compute, step, {row[k]}, -1, static_cast<int>(k)};
    if (waits[k] >= 0) {
      const auto it = posted.find(waits[k]);
      if (it == posted.end())
        throw ScheduleError("rank's " + token(row[k]) + " waits on a group not posted before it");
      c.waits = it->second;
    }
    prog.push_back(std::move(c));
    ++k;
  }
}

void append_tied(Program& prog, const Schedule& s, int r, int step) {
  const int first = s.stage_rank.front(), last = s.stage_rank.back();
  if (first == last || (r != first && r != last)) return;
  const int peer = r == first ? last : first;
  prog.push_back({Item::Group, step, {{Op::Send, -1, 0, peer, true}, {Op::Recv, -1, 0, peer, true}}, -1, -1});
}

// Runs the programs under NCCL's rules; throws BackendRuleError.
void run_programs(const Schedule& s, const std::vector<Program>& prog, const std::string& what) {
  const int R = s.ranks;
  auto fail = [&](const std::string& why, const std::vector<int>& waiting = {}) {
    throw BackendRuleError("pipeline schedule " + s.name + " (pp " + std::to_string(s.ranks) + ", " +
                               std::to_string(s.micros) + " micro-batches" + what +
                               ") breaks NCCL's point-to-point rules: " + why,
                           grid(s, waiting));
  };
  // Pairing, first in first out per (sender, receiver), tags ignored.
  struct End {
    int item;
    size_t op;
  };
  std::map<std::pair<int, int>, std::vector<End>> sends, recvs;  // (sender, receiver) -> in issue order
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < static_cast<int>(prog[r].size()); ++i) {
      const auto& it = prog[r][i];
      if (it.kind != Item::Group) continue;
      for (size_t o = 0; o < it.acts.size(); ++o) {
        const auto& a = it.acts[o];
        if (a.peer < 0 || a.peer >= R || a.peer == r) fail("rank " + std::to_string(r) + "'s " + label(it, a) + " names no other rank");
        if (a.op == Op::Send) sends[{r, a.peer}].push_back({i, o});
        else recvs[{a.peer, r}].push_back({i, o});
      }
    }
  // partner[r][item][op] = (rank, item) of the matching operation.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> partner(R);
  for (int r = 0; r < R; ++r) {
    partner[r].resize(prog[r].size());
    for (size_t i = 0; i < prog[r].size(); ++i) partner[r][i].assign(prog[r][i].acts.size(), {-1, -1});
  }
  std::set<std::pair<int, int>> pairs;
  for (const auto& [k, v] : sends) pairs.insert(k);
  for (const auto& [k, v] : recvs) pairs.insert(k);
  for (const auto& [from, to] : pairs) {
    const auto& out = sends[{from, to}];
    const auto& in = recvs[{from, to}];
    for (size_t n = 0; n < std::min(out.size(), in.size()); ++n) {
      const auto& si = prog[from][out[n].item];
      const auto& ri = prog[to][in[n].item];
      const auto& a = si.acts[out[n].op];
      const auto& b = ri.acts[in[n].op];
      if (si.step != ri.step || a.grad != b.grad || a.stage != b.stage || a.micro != b.micro) {
        const std::string nth = std::to_string(n + 1);
        fail("mis-paired: rank " + std::to_string(from) + "'s send #" + nth + " to rank " + std::to_string(to) + " is " +
             label(si, a) + ", but rank " + std::to_string(to) + "'s receive #" + nth + " from rank " +
             std::to_string(from) + " is " + label(ri, b) + " (tags are ignored: the n-th send meets the n-th receive)");
      }
      partner[from][out[n].item][out[n].op] = {to, in[n].item};
      partner[to][in[n].item][in[n].op] = {from, out[n].item};
    }
    if (out.size() != in.size())
      fail("rank " + std::to_string(from) + " sends " + std::to_string(out.size()) + " messages to rank " +
           std::to_string(to) + ", which receives " + std::to_string(in.size()));
  }

  // Streams. state: 0 waiting, 1 in flight (groups), 2 done.
  std::vector<std::vector<int>> state(R);
  std::vector<size_t> comp(R, 0), comm(R, 0);  // next compute/sync item, next group item
  for (int r = 0; r < R; ++r) state[r].assign(prog[r].size(), 0);
  auto skip = [&](int r, size_t& i, bool groups) {
    while (i < prog[r].size() && ((prog[r][i].kind == Item::Group) != groups || state[r][i] == 2)) ++i;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      // Compute stream: each action once the group it waits on is done.
      for (skip(r, comp[r], false); comp[r] < prog[r].size(); skip(r, comp[r], false)) {
        const auto& it = prog[r][comp[r]];
        if (it.kind == Item::Sync) break;  // all ranks together, below
        if (it.waits >= 0 && state[r][it.waits] != 2) break;
        state[r][comp[r]] = 2;
        progress = true;
      }
      // Communication stream: the next group starts once the compute issued
      // before it is done (and with it any sync before it), and completes once
      // every partner's group is in flight.
      skip(r, comm[r], true);
      if (comm[r] < prog[r].size()) {
        const size_t g = comm[r];
        if (state[r][g] == 0 && comp[r] > g) state[r][g] = 1, progress = true;
        if (state[r][g] == 1) {
          bool all = true;
          for (const auto& [q, i] : partner[r][g]) all = all && state[q][i] >= 1;
          if (all) state[r][g] = 2, progress = true;
        }
      }
    }
    // A host sync (post-validation's) completes when every rank's compute reached it.
    bool at_sync = true;
    for (int r = 0; r < R; ++r) {
      skip(r, comp[r], false);
      at_sync = at_sync && comp[r] < prog[r].size() && prog[r][comp[r]].kind == Item::Sync;
    }
    if (at_sync) {
      for (int r = 0; r < R; ++r) state[r][comp[r]] = 2;
      progress = true;
    }
  }
  // Done, or a deadlock: name the first rank whose group waits on a partner
  // that is not in flight, and what holds that partner back.
  for (int r = 0; r < R; ++r) {
    skip(r, comm[r], true);
    skip(r, comp[r], false);
  }
  std::vector<int> stuck, waiting(R, -1);  // waiting: the row position each rank is held at, for the grid
  for (int r = 0; r < R; ++r) {
    if (comm[r] == prog[r].size() && comp[r] == prog[r].size()) continue;
    stuck.push_back(r);
    const bool on_group = comm[r] < prog[r].size() && (comp[r] == prog[r].size() || state[r][comm[r]] == 1);
    waiting[r] = prog[r][on_group ? comm[r] : comp[r]].pos;
  }
  if (stuck.empty()) return;
  // Rank q's side of the operation `a` of rank p.
  auto other_end = [&](int q, int item, int p, const Action& a) {
    for (const auto& b : prog[q][item].acts)
      if (b.peer == p && (b.op == Op::Recv) == (a.op == Op::Send)) return label(prog[q][item], b);
    return label(prog[q][item]);
  };
  // Why q's group `item` is not in flight.
  auto held_back = [&](int q, int item) -> std::string {
    if (comm[q] < static_cast<size_t>(item)) {
      const auto& h = prog[q][comm[q]];
      for (size_t o = 0; o < h.acts.size(); ++o) {
        const auto& [p, pi] = partner[q][comm[q]][o];
        if (p >= 0 && state[p][pi] == 0)
          return ", queued behind rank " + std::to_string(q) + "'s " + label(h, h.acts[o]) + ", which waits for rank " +
                 std::to_string(p) + "'s " + other_end(p, pi, q, h.acts[o]);
      }
      return ", queued behind rank " + std::to_string(q) + "'s " + label(h);
    }
    if (comp[q] < prog[q].size() && comp[q] <= static_cast<size_t>(item)) {
      const auto& c = prog[q][comp[q]];
      return ", posted after rank " + std::to_string(q) + "'s " + label(c) +
             (c.waits >= 0 ? ", which waits for its group " + label(prog[q][c.waits]) : "");
    }
    return "";
  };
  for (int r : stuck) {
    if (comm[r] >= prog[r].size() || state[r][comm[r]] != 1) continue;
    const auto& g = prog[r][comm[r]];
    for (size_t o = 0; o < g.acts.size(); ++o) {
      const auto& [q, i] = partner[r][comm[r]][o];
      if (state[q][i] >= 1) continue;
      fail("deadlock: rank " + std::to_string(r) + "'s " + label(g, g.acts[o]) + " waits for rank " + std::to_string(q) +
               "'s " + other_end(q, i, r, g.acts[o]) + held_back(q, i),
           waiting);
    }
  }
  const int r = stuck.front();
  fail("deadlock: rank " + std::to_string(r) + " cannot go on at " +
           label(prog[r][comp[r] < prog[r].size() ? comp[r] : comm[r]]),
       waiting);
}

}  // namespace

void check_backend_rules(const Schedule& lowered, const BackendCheck& check) {
  const int R = lowered.ranks;
  std::vector<std::vector<int>> waits(R);
  for (int r = 0; r < R; ++r) waits[r] = group_waits(lowered, r);
  auto build = [&](bool two_steps, bool rerun) {
    std::vector<Program> prog(R);
    for (int r = 0; r < R; ++r) {
      const auto& row = lowered.actions[r];
      std::map<int, int> posted;
      append(prog[r], row, waits[r], 0, row.size(), 0, posted);
      append_wait_all(prog[r], 0);
      if (check.tied) append_tied(prog[r], lowered, r, 0);
      if (!two_steps) continue;
      const size_t cut = static_cast<size_t>(check.prefix.at(r));
      posted.clear();
      append(prog[r], row, waits[r], 0, cut, 1, posted);
      prog[r].push_back({Item::Sync, 1, {}, -1, -1});
      if (rerun) {
        append_wait_all(prog[r], 1);
        append(prog[r], row, waits[r], 0, cut, 2, posted);
      }
      append(prog[r], row, waits[r], cut, row.size(), 1, posted);
      append_wait_all(prog[r], 1);
      if (check.tied) append_tied(prog[r], lowered, r, 1);
    }
    return prog;
  };
  run_programs(lowered, build(false, false), "");
  if (check.prefix.empty()) return;
  if (static_cast<int>(check.prefix.size()) != R)
    throw ScheduleError(fail_text(lowered, "post-validation prefixes for " + std::to_string(check.prefix.size()) +
                                               " ranks, not " + std::to_string(R)));
  run_programs(lowered, build(true, false), ", post-validation");
  run_programs(lowered, build(true, true), ", post-validation with a rollback");
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
  for (int r = 0; r < static_cast<int>(s.actions.size()); ++r)
    o << "  rank " << r << " |" << row_text(s.actions[r], r < static_cast<int>(waiting.size()) ? waiting[r] : -1) << '\n';
  return o.str();
}

std::string to_text(const Schedule& s) {
  std::ostringstream o;
  o << "schedule " << s.name << " ranks " << s.ranks << " stages " << s.stages << " micros " << s.micros << "\n";
  o << "placement";
  for (int r : s.stage_rank) o << ' ' << r;
  o << "\n";
  for (int r = 0; r < static_cast<int>(s.actions.size()); ++r) o << "rank " << r << ":" << row_text(s.actions[r]) << "\n";
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
      std::string word;
      int group = static_cast<int>(std::count_if(s.actions[r].begin(), s.actions[r].end(), is_transfer));  // > any id so far
      while (words >> word) {
        std::vector<std::string> parts;
        for (size_t from = 0;;) {
          const auto plus = word.find('+', from);
          parts.push_back(word.substr(from, plus == std::string::npos ? std::string::npos : plus - from));
          if (plus == std::string::npos) break;
          from = plus + 1;
        }
        ++group;
        for (const auto& t : parts) {
          if (t.empty()) throw bad("'" + word + "': an empty action");
          Action a;
          const char c = t[0];
          if (c == 's' || c == 'r') {
            // A transfer: s|r, then a|g|t, then STAGE.MICRO (not for t), then >PEER or <PEER.
            if (t.size() < 4 || (t[1] != 'a' && t[1] != 'g' && t[1] != 't'))
              throw bad("'" + t + "' is not a transfer (sa, sg, ra, rg, st or rt)");
            a.op = c == 's' ? Op::Send : Op::Recv;
            a.grad = t[1] != 'a';
            const auto arrow = t.find(c == 's' ? '>' : '<');
            if (arrow == std::string::npos) throw bad("'" + t + "': expected " + (c == 's' ? ">PEER" : "<PEER"));
            a.peer = parse_int(t.substr(arrow + 1));
            if (t[1] == 't') {
              if (arrow != 2) throw bad("'" + t + "': the tied gradient takes no stage");
              a.stage = -1;
            } else {
              const auto dot = t.find('.');
              if (dot == std::string::npos || dot > arrow) throw bad("'" + t + "': expected STAGE.MICRO");
              a.stage = parse_int(t.substr(2, dot - 2));
              a.micro = parse_int(t.substr(dot + 1, arrow - dot - 1));
            }
            a.group = group;
            s.actions[r].push_back(a);
            continue;
          }
          if (parts.size() > 1) throw bad("'" + word + "': only transfers are joined by '+'");
          if (c == 'F') a.op = Op::F;
          else if (c == 'B') a.op = Op::B;
          else if (c == 'I') a.op = Op::I;
          else if (c == 'W') a.op = Op::W;
          else throw bad("'" + t + "' is not an action (F, B, I or W followed by STAGE.MICRO, or a transfer)");
          const auto dot = t.find('.');
          if (dot == std::string::npos) throw bad("'" + t + "': expected STAGE.MICRO after the letter");
          a.stage = parse_int(t.substr(1, dot - 1));
          a.micro = parse_int(t.substr(dot + 1));
          s.actions[r].push_back(a);
        }
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
