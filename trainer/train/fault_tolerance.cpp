#include "trainer/train/fault_tolerance.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "base/config/arg_map.h"
#include "base/log.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/precision.h"
#include "trainer/state/training_state.h"
#include "trainer/train/metrics.h"

namespace fs = std::filesystem;

namespace nnstrain::train {

namespace {

// Actions, ordered: the ranks take the largest any proposes.
enum Action { kNone = 0, kTransient, kLog, kRerun, kSkip, kStop };

std::string num(double v) {
  std::ostringstream o;
  o.precision(6);
  o << v;
  return o.str();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// NNSTRAIN_TEST_CORRUPT_PARAM=STEP:RANK: after step STEP, rank RANK changes its
// first parameter's first element (the replica checks' test).
bool corrupt_here(int64_t step, int rank) {
  static const char* at = std::getenv("NNSTRAIN_TEST_CORRUPT_PARAM");
  if (!at) return false;
  const std::string s = at;
  const auto colon = s.find(':');
  return colon != std::string::npos && std::stoll(s.substr(0, colon)) == step && std::stoi(s.substr(colon + 1)) == rank;
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

// Exact and order-free: the sum of a tensor's element bit patterns.
at::Tensor bit_sum(const at::Tensor& p) {
  const auto t = p.detach().contiguous().view(-1);
  switch (t.element_size()) {
    case 8: return t.view(torch::kInt64).sum();
    case 4: return t.view(torch::kInt32).to(torch::kInt64).bitwise_and(0xFFFFFFFFLL).sum();
    case 2: return t.view(torch::kInt16).to(torch::kInt64).bitwise_and(0xFFFFLL).sum();
    default: return t.view(torch::kUInt8).to(torch::kInt64).sum();
  }
}

}  // namespace

int64_t data_step(const SkipWindows& windows, int64_t s) {
  for (const auto& [first, end] : windows)
    if (s >= first) s += end - first;
  return s;
}

SkipWindows add_window(SkipWindows windows, int64_t first, int64_t end) {
  windows.emplace_back(first, end);
  std::sort(windows.begin(), windows.end());
  SkipWindows out;
  for (const auto& w : windows) {
    if (!out.empty() && w.first <= out.back().second) out.back().second = std::max(out.back().second, w.second);
    else out.push_back(w);
  }
  return out;
}

SkipWindows skipped_windows(const std::string& checkpoint_dir) {
  if (checkpoint_dir.empty()) return {};
  const checkpoint::Checkpoint ck(checkpoint_dir);
  const auto& state = ck.state();
  SkipWindows out;
  if (!state.contains("data_cursor") || !state["data_cursor"].contains("skipped")) return out;
  for (const auto& w : state["data_cursor"]["skipped"]) out.emplace_back(w.at(0).get<int64_t>(), w.at(1).get<int64_t>());
  return out;
}

std::string checkpoint_before(const std::string& save_dir, int64_t below, int64_t* step) {
  std::string best;
  *step = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir, ec)) {
    const auto n = e.path().filename().string();
    if (n.size() != 13 || n.rfind("step-", 0) != 0 || !std::all_of(n.begin() + 5, n.end(), ::isdigit)) continue;
    const int64_t s = std::stoll(n.substr(5));
    if (s < below && s > *step && fs::exists(e.path() / "manifest.json")) {
      *step = s;
      best = e.path().string();
    }
  }
  return best;
}

std::string restart_source(const config::TrainerArgs& args, const std::string& requested) {
  const char* count = std::getenv("NNSTRAIN_RESTART_COUNT");
  if (!count || std::atoi(count) <= 0) return requested;
  const auto& save_dir = args.checkpoint.save_dir;
  int64_t step = -1;
  const std::string last =
      save_dir.empty() ? "" : checkpoint_before(save_dir, std::numeric_limits<int64_t>::max(), &step);
  if (!last.empty()) return last;
  // Nothing saved by this run yet: it starts again from where it started.
  const std::string from = requested.empty() ? args.checkpoint.resume_from : requested;
  log::info("restart " + std::string(count) + ": no checkpoint under " +
            (save_dir.empty() ? std::string("checkpoint.save_dir (not set)") : save_dir) + " yet: starting again " +
            (from.empty() ? std::string("from scratch") : "from " + from));
  return requested;
}

FaultTolerance::FaultTolerance(const config::TrainerArgs& args, dist::Runtime* rt, int rank, int world, bool pipeline,
                               const std::string& device, const std::string& resumed_from, int64_t start_step,
                               int zero_stage)
    : args_(args.fault_tolerance),
      save_dir_(args.checkpoint.save_dir),
      run_dir_(args.run_dir),
      rt_(rt),
      rank_(rank),
      world_(world),
      pipeline_(pipeline),
      start_step_(start_step),
      scaler_(optim::precision_setup(args.precision, "auto").loss_scaling),
      skipped_(skipped_windows(resumed_from)),
      slow_intervals_(world, 0) {
  // The plan's stage, not the config's: autodist may choose ZeRO-3 itself.
  if (args_.checksum_every_n_steps > 0 && zero_stage == 3)
    throw config::ConfigError(
        "fault_tolerance.checksum_every_n_steps compares replicated parameters, but the plan shards them with "
        "ZeRO-3 (compute_config.use_zero, or chosen by autodist): set compute_config.use_zero to 0, 1 or 2, or "
        "checksum_every_n_steps to 0");
  // The spike detector's values before the checkpoint: a resumed run is not blind for spike_window steps.
  if (!resumed_from.empty()) {
    const checkpoint::Checkpoint ck(resumed_from);
    const auto& st = ck.state();
    if (st.contains("fault_tolerance") && st["fault_tolerance"].contains("history"))
      for (const auto& h : st["fault_tolerance"]["history"])
        if (h.size() == 3 && h[0].get<int64_t>() <= start_step)
          history_[h[0].get<int64_t>()] = {h[1].get<double>(), h[2].get<double>()};
    while (static_cast<int64_t>(history_.size()) > args_.spike_window) history_.erase(history_.begin());
  }
  // Where each rank runs, for naming a straggler (read by rank 0 from the store, no collective).
  if (rt_ && rt_->store()) {
    const std::string w = host_name() + " " + device;
    rt_->store()->set("ft/where/" + std::to_string(rank_), std::vector<uint8_t>(w.begin(), w.end()));
  }
  if (!skipped_.empty() && rank_ == 0) {
    std::string list;
    for (const auto& [a, b] : skipped_) list += (list.empty() ? "" : ", ") + std::to_string(a) + ".." + std::to_string(b - 1);
    log::info("fault_tolerance: data steps skipped by earlier rewinds: " + list);
  }
}

FaultTolerance::~FaultTolerance() = default;

std::string FaultTolerance::where(int rank) {
  if (!rt_ || !rt_->store()) return "?";
  try {
    const auto v = rt_->store()->get("ft/where/" + std::to_string(rank));
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    return "?";
  }
}

Rewind FaultTolerance::checkpoint_for(int64_t below) {
  // Asynchronous saves finished first, then the oldest choice of any rank
  // (a rank may not see rank 0's latest publish yet): every rank loads the same.
  if (wait_saves_) wait_saves_();
  Rewind r;
  checkpoint_before(save_dir_, below, &r.step);
  if (rt_) {
    std::vector<int64_t> v{-r.step};
    rt_->host_max(v, "fault tolerance rewind step");
    r.step = -v[0];
  }
  if (r.step >= 0) r.dir = (fs::path(save_dir_) / checkpoint::step_dir_name(r.step)).string();
  return r;
}

int FaultTolerance::agree(int action) {
  if (!rt_) return action;
  std::vector<int64_t> v{action};
  rt_->host_max(v, "fault tolerance decision");
  return static_cast<int>(v[0]);
}

void FaultTolerance::event(int64_t step, nlohmann::json what, const std::string& line) {
  if (rank_ != 0) return;
  if (!line.empty()) log::warn("step " + std::to_string(step) + ": fault_tolerance: " + line);
  events_.push_back({{"step", step}, {"fault_tolerance", std::move(what)}});
  if (jsonl_) jsonl_->write(events_.back());
}

void FaultTolerance::record_restart(int64_t step) {
  restart_recorded_ = true;
  const char* count = std::getenv("NNSTRAIN_RESTART_COUNT");
  if (rank_ != 0 || !count) return;
  const char* cause = std::getenv("NNSTRAIN_RESTART_CAUSE");
  const char* failed_at = std::getenv("NNSTRAIN_RESTART_FAILED_AT_MS");
  const double cost_s = failed_at ? (now_ms() - std::atoll(failed_at)) / 1000.0 : -1;
  const nlohmann::json rec = {{"restart", std::atoi(count)},
                              {"cause", cause ? cause : ""},
                              {"resumed_at_step", start_step_},
                              {"first_step", step},
                              {"seconds_from_failure_to_first_step", cost_s}};
  std::ofstream(fs::path(run_dir_) / "restarts.jsonl", std::ios::app) << rec.dump() << "\n";
  log::info("restart " + std::string(count) + " (" + (cause ? cause : "") + "): resumed at step " +
            std::to_string(start_step_) + ", step " + std::to_string(step) + " done " + num(cost_s) +
            " s after the failure");
}

std::optional<Rewind> FaultTolerance::after_step(int64_t step, const at::Tensor& loss_share,
                                                 const at::Tensor& grad_norm,
                                                 const std::vector<parallel::ParamShard>& params) {
  if (!restart_recorded_) record_restart(step);
  if (corrupt_here(step, rank_) && !params.empty()) {
    torch::NoGradGuard no_grad;
    params[0].tensor.view(-1)[0].add_(1e-3);
    log::warn("test hook NNSTRAIN_TEST_CORRUPT_PARAM: changed parameter " + params[0].name + " on rank " +
              std::to_string(rank_) + " after step " + std::to_string(step));
  }
  if (args_.checksum_every_n_steps > 0 && step % args_.checksum_every_n_steps == 0)
    if (auto r = check_replicas(step, params)) return r;
  if (!args_.detects_spikes()) return std::nullopt;
  // The step's loss over every rank (as the logging step sums it) and the global norm.
  auto loss = loss_share.detach().to(torch::kFloat32).reshape({1}).clone();
  if (rt_) {
    if (pipeline_) rt_->all_reduce(rt_->pp, loss, "loss all-reduce for fault_tolerance (pipeline: from the last stage)");
    rt_->all_reduce(rt_->dp_cp, loss, "loss all-reduce for fault_tolerance");
  }
  const auto host = torch::cat({loss, grad_norm.detach().to(torch::kFloat32).reshape({1})}).to(torch::kFloat64).cpu();
  return check_spike(step, {host[0].item<double>(), host[1].item<double>()});
}

std::optional<Rewind> FaultTolerance::check_spike(int64_t step, const Values& v) {
  const bool finite = std::isfinite(v.loss) && std::isfinite(v.grad_norm);
  int proposal = kNone;
  nlohmann::json what;
  std::string line;
  const bool rerun_step = rerun_ && rerun_->step == step;
  if (rerun_step) {
    // The same numbers again (non-finite counts as the same): the data or the optimisation.
    auto same = [](double a, double b) {
      return (!std::isfinite(a) && !std::isfinite(b)) || std::abs(a - b) <= 1e-6 * std::max(std::abs(b), 1e-12);
    };
    const bool reproduced = same(v.loss, rerun_->seen.loss) && same(v.grad_norm, rerun_->seen.grad_norm);
    proposal = reproduced ? kSkip : kTransient;
    what = {{"event", "rerun_check"}, {"reproduced", reproduced}, {"loss", v.loss}, {"grad_norm", v.grad_norm},
            {"first_loss", rerun_->seen.loss}, {"first_grad_norm", rerun_->seen.grad_norm}};
    line = "rerun check of step " + std::to_string(step) + ": loss " + num(v.loss) + ", grad norm " +
           num(v.grad_norm) + " against " + num(rerun_->seen.loss) + ", " + num(rerun_->seen.grad_norm) +
           " the first time: " +
           (reproduced ? "reproduced, so the data or the optimisation, not the hardware"
                       : "different, so a transient fault; nothing skipped");
  } else if (scaler_ && std::isfinite(v.loss) && !finite) {
    // A finite loss whose scaled gradients overflowed: the loss scaler skipped
    // the update and backed off, as it is meant to (GradScaler's normal
    // operation): neither a non-finite step nor a value for the medians.
  } else {
    std::string kind;
    if (!finite) {
      ++nonfinite_run_;
      if (args_.nonfinite_steps > 0 && nonfinite_run_ >= args_.nonfinite_steps) kind = "nonfinite";
    } else {
      nonfinite_run_ = 0;
    }
    if (finite && args_.spike_factor > 0 && static_cast<int64_t>(history_.size()) >= args_.spike_window) {
      std::vector<double> l, g;
      for (const auto& [s, h] : history_) l.push_back(h.loss), g.push_back(h.grad_norm);
      const double ml = median(l), mg = median(g);
      if (v.loss > args_.spike_factor * ml || v.grad_norm > args_.spike_factor * mg) {
        kind = "spike";
        what = {{"median_loss", ml}, {"median_grad_norm", mg}, {"factor", args_.spike_factor},
                {"window", args_.spike_window}};
        line = "loss " + num(v.loss) + ", grad norm " + num(v.grad_norm) + " against rolling medians " + num(ml) +
               ", " + num(mg) + " (factor " + num(args_.spike_factor) + ")";
      }
    }
    if (kind == "nonfinite")
      line = std::to_string(nonfinite_run_) + " non-finite steps in a row (loss " + num(v.loss) + ", grad norm " +
             num(v.grad_norm) + ")";
    if (!kind.empty()) {
      what["event"] = kind;
      what["loss"] = v.loss;
      what["grad_norm"] = v.grad_norm;
      proposal = args_.on_spike == "log" ? kLog : args_.on_spike == "stop" ? kStop : args_.rerun_check ? kRerun : kSkip;
    } else if (finite) {
      history_[step] = v;
      while (static_cast<int64_t>(history_.size()) > args_.spike_window) history_.erase(history_.begin());
    }
  }
  const int action = agree(proposal);
  if (action == kNone) return std::nullopt;
  if (action == kTransient || action == kLog) {
    what["action"] = action == kLog ? "logged" : "continued";
    event(step, what, line);
    rerun_.reset();
    return std::nullopt;
  }
  // A spike again at a step whose data was skipped: the rewind did not help, and would repeat forever.
  if ((action == kSkip || action == kRerun) && !rerun_step && skipped_at_.count(step)) {
    what["action"] = "stop";
    event(step, what, line);
    throw std::runtime_error("step " + std::to_string(step) + ": " + line +
                             "; a spike again at a step already rewound past skipped data: training stops");
  }
  if (action == kStop) {
    what["action"] = "stop";
    event(step, what, line);
    throw std::runtime_error("step " + std::to_string(step) + ": " + line +
                             "; training stops (fault_tolerance.on_spike: stop)");
  }
  // Back to the last checkpoint before the first bad step (of a non-finite run, its first).
  const int64_t run = rerun_step ? rerun_->run : std::max<int64_t>(1, nonfinite_run_);
  const int64_t first_bad = step - (run - 1);
  Rewind r = checkpoint_for(first_bad);
  if (r.dir.empty())
    throw std::runtime_error("step " + std::to_string(step) + ": " + line + "; no checkpoint under " + save_dir_ +
                             " before step " + std::to_string(first_bad) +
                             " to rewind to (fault_tolerance.on_spike: rewind; checkpoint.every_n_train_steps)");
  if (action == kRerun) {
    rerun_ = Rerun{step, v, run};
    what["action"] = "rerun";
    what["to_step"] = r.step;
    event(step, what, line + "; rerunning from the checkpoint of step " + std::to_string(r.step) +
                          " before deciding (rerun_check)");
    return r;
  }
  // Skip the data of the spike step and of the window before it (at least the
  // whole non-finite run, also when a rerun confirmed it), no further back than
  // the checkpoint's own next step.
  const int64_t last = data_step(step - 1);
  const int64_t len = std::max<int64_t>(args_.skip_window, run);
  const int64_t first = std::max(last - len + 1, data_step(r.step));
  {
    std::lock_guard<std::mutex> lock(skipped_mu_);
    skipped_ = add_window(skipped_, first, last + 1);
    skipped_changed_ = true;
  }
  skipped_at_.insert(step);
  what["action"] = "rewind";
  what["to_step"] = r.step;
  what["skipped_data_steps"] = {first, last + 1};
  event(step, what, line + "; rewinding to the checkpoint of step " + std::to_string(r.step) +
                        " and skipping data steps " + std::to_string(first) + ".." + std::to_string(last));
  rerun_.reset();
  return r;
}

std::optional<Rewind> FaultTolerance::check_replicas(int64_t step, const std::vector<parallel::ParamShard>& params) {
  // Replicas of a dense parameter (shard) live on the dp x cp group, those of
  // an expert shard on edp (the ranks holding the same experts; an ep peer
  // holds others), and the tied copies (the embedding the head reuses) on the
  // first and last ranks of the pp group: every such group has the same size
  // and every rank of a stage the same parameters, and every rank knows the tied
  // names, so every rank checks or none does, with the same collectives.
  const bool replicas = rt_ && rt_->dp_cp.size() >= 2;
  const bool tied = rt_ && pipeline_ && rt_->pp.size() >= 2 && !tied_.empty();
  if (!(replicas || tied) || params.empty()) return std::nullopt;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> sums;
  for (const auto& p : params) sums.push_back(bit_sum(p.tensor));
  const auto c = torch::stack(sums);
  const auto mine = c.cpu();
  const auto n = static_cast<int64_t>(params.size());
  int64_t bad = -1;  // 0..n-1: a parameter whose replicas differ; n + t: tied name t
  if (replicas) {
    std::vector<int64_t> dense, expert;
    for (int64_t i = 0; i < n; ++i) (params[i].expert ? expert : dense).push_back(i);
    auto compare = [&](dist::Group& g, const std::vector<int64_t>& idx, const char* what) {
      if (idx.empty() || g.size() < 2) return;
      const auto sel = c.index_select(0, torch::tensor(idx, torch::kInt64).to(c.device()));
      auto both = torch::cat({sel, -sel});
      rt_->all_reduce_max(g, both, what);
      const auto h = both.cpu();
      const auto* p = h.data_ptr<int64_t>();
      const auto k = static_cast<int64_t>(idx.size());
      for (int64_t j = 0; j < k; ++j)
        if (p[j] != -p[k + j] && (bad < 0 || idx[j] < bad)) {
          bad = idx[j];
          break;
        }
    };
    compare(rt_->dp_cp, dense, "replica checksums (max and -min over dp x cp)");
    compare(rt_->edp, expert, "expert replica checksums (max and -min over the ranks holding the same experts)");
  }
  // The tied copies: a stage without the parameter offers the lowest value to both maxima.
  std::vector<int64_t> tied_sum(tied_.size(), 0);
  if (tied) {
    const auto T = static_cast<int64_t>(tied_.size());
    auto both = torch::full({2 * T}, std::numeric_limits<int64_t>::min(), torch::kInt64);
    std::vector<bool> held(tied_.size(), false);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < n; ++i)
        if (params[i].name == tied_[t]) {
          held[t] = true;
          tied_sum[t] = mine.data_ptr<int64_t>()[i];
          both[t] = tied_sum[t];
          both[T + t] = -tied_sum[t];
        }
    both = both.to(c.device());
    rt_->all_reduce_max(rt_->pp, both, "tied parameter checksums (max and -min over the pipeline stages)");
    const auto h = both.cpu();
    const auto* p = h.data_ptr<int64_t>();
    for (int64_t t = 0; t < T && bad < 0; ++t)
      if (held[t] && p[t] != -p[T + t]) bad = n + t;
  }
  // Every rank learns which ranks saw a mismatch, and their checksums of it.
  constexpr int64_t kMask = 0x7FFFFFFFFFFFFFFFLL;
  std::vector<int64_t> v(2 * world_, -1);
  if (bad >= 0) {
    v[rank_] = bad;
    v[world_ + rank_] = (bad < n ? mine.data_ptr<int64_t>()[bad] : tied_sum[bad - n]) & kMask;
  }
  rt_->host_max(v, "replica checksum comparison");
  std::vector<int> disagree;
  for (int r = 0; r < world_; ++r)
    if (v[r] >= 0) disagree.push_back(r);
  if (disagree.empty()) return std::nullopt;
  std::string msg = "step " + std::to_string(step) + ": ";
  if (bad >= n) {
    msg += "parameter " + tied_[bad - n] + " differs between its tied copies on the first and last pipeline stages:";
    for (int r : rt_->pp.ranks)
      if (v[r] >= 0) msg += " rank " + std::to_string(r) + " checksum " + std::to_string(v[world_ + r]) + ",";
    msg.pop_back();
    msg += " (group " + rt_->pp.name + ")";
  } else if (bad >= 0) {
    const dist::Group& g = params[bad].expert ? rt_->edp : rt_->dp_cp;
    msg += "parameter " + params[bad].name + " differs between replicas:";
    for (int r : g.ranks) msg += " rank " + std::to_string(r) + " checksum " + std::to_string(v[world_ + r]) + ",";
    msg.pop_back();
    msg += " (group " + g.name + " should hold the same values)";
  } else {
    msg += "replicas disagree on ranks";
    for (int r : disagree) msg += " " + std::to_string(r);
    msg += " (their logs name the parameter)";
  }
  log::error(msg);
  event(step,
        {{"event", "replica_mismatch"}, {"ranks", disagree}, {"message", msg}, {"action", args_.on_checksum_mismatch}},
        "");
  if (args_.on_checksum_mismatch == "stop")
    throw std::runtime_error(msg + "; training stops (fault_tolerance.on_checksum_mismatch: stop)");
  // The last check that passed was checksum_every_n_steps ago: a checkpoint up to it is clean.
  Rewind r = checkpoint_for(step - args_.checksum_every_n_steps + 1);
  if (r.dir.empty())
    throw std::runtime_error(msg + "; no checkpoint under " + save_dir_ + " from before the last passed check to " +
                             "rewind to (fault_tolerance.on_checksum_mismatch: rewind)");
  if (rank_ == 0) log::warn("fault_tolerance: rewinding to the checkpoint of step " + std::to_string(r.step));
  return r;
}

void FaultTolerance::rewound(const Rewind& r) {
  // The values after the checkpoint are gone with the steps that made them.
  history_.erase(history_.upper_bound(r.step), history_.end());
  nonfinite_run_ = 0;
  if (rt_) rt_->barrier("fault tolerance rewind (every rank loaded the checkpoint)");
  if (rank_ != 0) return;
  // The reopened metrics file dropped the records after the checkpoint, this run's decisions among them.
  if (jsonl_)
    for (const auto& e : events_)
      if (e["step"].get<int64_t>() > r.step) jsonl_->write(e);
  // The windows this rewind added, into the checkpoint it went back to: a
  // restart before the next save resumes from it and must skip them too.
  SkipWindows windows;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(skipped_mu_);
    windows = skipped_;
    changed = std::exchange(skipped_changed_, false);
  }
  if (changed) {
    nlohmann::json w = nlohmann::json::array();
    for (const auto& [a, b] : windows) w.push_back({a, b});
    checkpoint::rewrite_state(r.dir, [&](nlohmann::json& state) { state["data_cursor"]["skipped"] = w; });
  }
  // Later checkpoints hold the state the rewind abandons: a restart must not
  // resume from them. Each is renamed out of sight before it is deleted, so a
  // kill in between never leaves a half-deleted step folder for a restart to pick.
  std::vector<fs::path> later;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir_, ec)) {
    const auto n = e.path().filename().string();
    if (n.size() == 13 && n.rfind("step-", 0) == 0 && std::all_of(n.begin() + 5, n.end(), ::isdigit) &&
        std::stoll(n.substr(5)) > r.step)
      later.push_back(e.path());
  }
  for (const auto& p : later) {
    try {
      checkpoint::discard_step(p.string());
      log::info("fault_tolerance: removed " + p.string() + " (after the rewind point)");
    } catch (const std::exception& e) {
      // Out of sight already when only the deletion failed; the next save clears what is left.
      log::warn("fault_tolerance: " + std::string(e.what()));
    }
  }
  checkpoint::write_file_durable((fs::path(save_dir_) / "latest").string(), checkpoint::step_dir_name(r.step) + "\n");
}

void FaultTolerance::annotate(nlohmann::json& state) const {
  nlohmann::json w = nlohmann::json::array();
  {
    std::lock_guard<std::mutex> lock(skipped_mu_);
    for (const auto& [a, b] : skipped_) w.push_back({a, b});
  }
  state["data_cursor"]["skipped"] = w;
  nlohmann::json h = nlohmann::json::array();
  for (const auto& [s, v] : history_) h.push_back({s, v.loss, v.grad_norm});
  state["fault_tolerance"]["history"] = h;
}

void FaultTolerance::add_step_times(std::vector<int64_t>& values, const std::array<double, 6>& split_ms,
                                    bool measured) {
  // StepTimer's parts: data, forward, backward, comm, optimizer, graph.
  times_offset_ = values.size();
  values.resize(times_offset_ + 2 * world_, -1);
  if (!measured) return;
  const double compute = split_ms[1] + split_ms[2] + split_ms[4] + split_ms[5], wait = split_ms[0] + split_ms[3];
  values[times_offset_ + rank_] = std::llround(compute * 1000);
  values[times_offset_ + world_ + rank_] = std::llround(wait * 1000);
}

void FaultTolerance::read_step_times(const std::vector<int64_t>& values, nlohmann::json& record, int64_t step) {
  if (world_ < 2 || values.size() < times_offset_ + 2 * world_) return;
  std::vector<double> compute(world_), wait(world_);
  for (int r = 0; r < world_; ++r) {
    if (values[times_offset_ + r] < 0) return;  // not measured at this step
    compute[r] = values[times_offset_ + r] / 1000.0;
    wait[r] = values[times_offset_ + world_ + r] / 1000.0;
  }
  record["rank_compute_ms"] = compute;
  record["rank_wait_ms"] = wait;
  if (args_.straggler_factor <= 0) return;
  // A rank slower than the others' median by the factor, M logging intervals in a row.
  for (int r = 0; r < world_; ++r) {
    std::vector<double> others;
    for (int o = 0; o < world_; ++o)
      if (o != r) others.push_back(compute[o]);
    const double med = median(others);
    slow_intervals_[r] = compute[r] > args_.straggler_factor * med ? slow_intervals_[r] + 1 : 0;
    if (slow_intervals_[r] != args_.straggler_intervals || rank_ != 0) continue;
    const std::string at = where(r);
    record["straggler"] = {{"rank", r}, {"where", at}, {"compute_ms", compute[r]}, {"others_median_ms", med},
                           {"intervals", slow_intervals_[r]}};
    log::warn("step " + std::to_string(step) + ": straggler: rank " + std::to_string(r) + " (" + at +
              ") computed " + num(compute[r]) + " ms per step against the other ranks' median " + num(med) +
              " ms, above " + num(args_.straggler_factor) + "x for " + std::to_string(slow_intervals_[r]) +
              " logging intervals in a row");
  }
}

}  // namespace nnstrain::train
