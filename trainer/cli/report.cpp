#include "trainer/cli/report.h"

#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/text.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/dist/flight_recorder.h"
#include "trainer/train/step_timer.h"

extern char** environ;

namespace fs = std::filesystem;

namespace nnstrain::cli {

namespace {

constexpr const char* kReportUsage = "usage: nnstrain report RUN_DIR [--out PNG] [--no-plot]\n";

struct ReportError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// An in-training evaluation's record (eval: tasks): its keys are eval_<task>/<metric>.
bool is_eval_record(const nlohmann::json& rec) { return rec.contains("eval_seconds"); }

// metrics.jsonl, split into training, validation and task-evaluation records.
void read_metrics(const fs::path& file, std::vector<nlohmann::json>& train, std::vector<nlohmann::json>& val,
                  std::vector<nlohmann::json>& evals) {
  std::ifstream in(file);
  if (!in) throw ReportError(file.string() + ": not found (is this a run folder? it holds metrics.jsonl)");
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    auto rec = nlohmann::json::parse(line, nullptr, false);
    if (!rec.is_object() || !rec.contains("step") || !rec["step"].is_number_integer())
      throw ReportError(file.string() + " line " + std::to_string(n) + ": not a metrics record");
    (rec.contains("val_loss") ? val : is_eval_record(rec) ? evals : train).push_back(std::move(rec));
  }
  if (train.empty() && val.empty() && evals.empty()) throw ReportError(file.string() + ": no records yet");
}

std::string checkpoints_line(const fs::path& run_dir) {
  std::ifstream in(run_dir / "run.json");
  if (!in) return "unknown (no run.json)";
  const auto run = nlohmann::json::parse(in, nullptr, false);
  const std::string dir = run.is_object() ? run.value("checkpoint_dir", "") : "";
  if (dir.empty()) return "none (checkpoint.save_dir not set)";
  std::vector<std::string> saved;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0 &&
        fs::exists(e.path() / "manifest.json"))
      saved.push_back(e.path().filename().string());
  std::sort(saved.begin(), saved.end());
  if (saved.empty()) return dir + ": none saved";
  std::string out = dir + ": ";
  for (size_t i = 0; i < saved.size(); ++i) out += (i ? ", " : "") + saved[i];
  const auto latest = checkpoint::latest(dir);
  if (!latest.empty()) out += " (latest " + fs::path(latest).filename().string() + ")";
  return out;
}

// Fault tolerance: restarts (restarts.jsonl), decisions and stragglers
// (metrics.jsonl), every rank's median step times, and the flight recorder's
// files lined up (flight/rank<R>.json).
void fault_lines(const fs::path& run_dir, const std::vector<nlohmann::json>& train, std::ostream& s) {
  std::ifstream restarts(run_dir / "restarts.jsonl");
  for (std::string line; std::getline(restarts, line);) {
    const auto r = nlohmann::json::parse(line, nullptr, false);
    if (!r.is_object()) continue;
    s << "restart          " << r.value("restart", 0) << ": " << r.value("cause", std::string()) << "; resumed at step "
      << r.value("resumed_at_step", int64_t(0)) << ", step " << r.value("first_step", int64_t(0)) << " done "
      << util::fixed(r.value("seconds_from_failure_to_first_step", -1.0), 1) << " s after the failure\n";
  }
  std::vector<std::vector<double>> compute, wait;
  for (const auto& r : train) {
    if (r.contains("fault_tolerance")) s << "fault tolerance  step " << r["step"] << ": " << r["fault_tolerance"].dump() << "\n";
    if (r.contains("straggler")) {
      const auto& g = r["straggler"];
      s << "straggler        step " << r["step"] << ": rank " << g.value("rank", -1) << " ("
        << g.value("where", std::string("?")) << "), compute " << util::fixed(g.value("compute_ms", 0.0), 1)
        << " ms against the others' median " << util::fixed(g.value("others_median_ms", 0.0), 1) << " ms\n";
    }
    if (r.contains("rank_compute_ms") && r.contains("rank_wait_ms")) {
      const auto c = r["rank_compute_ms"].get<std::vector<double>>(), w = r["rank_wait_ms"].get<std::vector<double>>();
      compute.resize(std::max(compute.size(), c.size()));
      wait.resize(std::max(wait.size(), w.size()));
      for (size_t i = 0; i < c.size(); ++i) compute[i].push_back(c[i]);
      for (size_t i = 0; i < w.size(); ++i) wait[i].push_back(w[i]);
    }
  }
  if (!compute.empty()) {
    s << "rank step times ";
    for (size_t i = 0; i < compute.size(); ++i)
      s << (i ? ", " : " ") << "rank " << i << " " << util::fixed(median(compute[i]), 1) << " / "
        << util::fixed(i < wait.size() ? median(wait[i]) : 0.0, 1);
    s << " ms compute / waiting (medians)\n";
  }
  std::vector<nlohmann::json> records;
  int world = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir / "flight", ec)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    auto r = nlohmann::json::parse(in, nullptr, false);
    if (!r.is_object() || !r.contains("rank") || !r.contains("entries") || !r.contains("groups")) {
      s << "flight recorder  " << e.path().string() << ": not a flight record, ignored\n";
      continue;
    }
    world = std::max(world, r.value("world_size", 0));
    records.push_back(std::move(r));
  }
  if (records.empty()) return;
  std::sort(records.begin(), records.end(), [](const auto& a, const auto& b) { return a["rank"] < b["rank"]; });
  s << "flight recorder  " << records.size() << " of " << world << " ranks wrote one (";
  for (size_t i = 0; i < records.size(); ++i)
    s << (i ? "; " : "") << "rank " << records[i]["rank"] << ": " << records[i].value("reason", std::string()).substr(0, 80);
  s << ")\n";
  const auto lines = dist::align_flight_records(records, world);
  if (lines.empty()) s << "flight recorder  the ranks agree on every collective they kept\n";
  for (const auto& l : lines) s << "flight recorder  " << l << "\n";
}

// Runs `argv` and waits; returns its exit status (127 if it could not start).
int run_program(const std::vector<std::string>& argv) {
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ) != 0) return 127;
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return 127;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

int report_main(const std::vector<std::string>& args) {
  std::string run_dir, out;
  bool plot = true;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--out" && i + 1 < args.size()) {
      out = args[++i];
    } else if (args[i] == "--no-plot") {
      plot = false;
    } else if (args[i] == "-h" || args[i] == "--help") {
      std::cout << kReportUsage;
      return 0;
    } else if (args[i].rfind("-", 0) != 0 && run_dir.empty()) {
      run_dir = args[i];
    } else {
      std::cerr << "nnstrain report: unexpected argument '" << args[i] << "'\n" << kReportUsage;
      return 2;
    }
  }
  if (run_dir.empty()) {
    std::cerr << "nnstrain report: missing RUN_DIR\n" << kReportUsage;
    return 2;
  }
  if (out.empty()) out = (fs::path(run_dir) / "loss_curves.png").string();

  std::vector<nlohmann::json> train, val, evals;
  try {
    read_metrics(fs::path(run_dir) / "metrics.jsonl", train, val, evals);
  } catch (const ReportError& e) {
    std::cerr << "nnstrain report: " << e.what() << "\n";
    return 2;
  }

  auto column = [&](const char* key) {
    std::vector<double> v;
    for (const auto& r : train)
      if (r.contains(key) && r[key].is_number()) v.push_back(r[key].get<double>());
    return v;
  };
  std::ostringstream s;
  s << "run              " << run_dir << "\n";
  if (!train.empty()) {
    const auto &first = train.front(), &last = train.back();
    s << "steps            " << first["step"].get<int64_t>() << " .. " << last["step"].get<int64_t>() << " ("
      << train.size() << " logged)\n";
    if (first.contains("loss") && last.contains("loss"))
      s << "train loss       " << util::fixed(first["loss"].get<double>(), 4) << " (step " << first["step"] << ") -> "
        << util::fixed(last["loss"].get<double>(), 4) << " (step " << last["step"] << ")\n";
  }
  if (!val.empty()) {
    const auto best = std::min_element(val.begin(), val.end(), [](const auto& a, const auto& b) {
      return a["val_loss"].template get<double>() < b["val_loss"].template get<double>();
    });
    s << "best val loss    " << util::fixed((*best)["val_loss"].get<double>(), 4) << " at step " << (*best)["step"]
      << " (last " << util::fixed(val.back()["val_loss"].get<double>(), 4) << " at step " << val.back()["step"] << ")\n";
  } else {
    s << "best val loss    none (no validation records)\n";
  }
  // Each task score: its first and last value (plot_run.py draws it against steps).
  std::vector<std::string> scores;
  for (const auto& r : evals)
    for (const auto& [k, v] : r.items())
      if (k.rfind("eval_", 0) == 0 && k != "eval_seconds" && v.is_number() &&
          std::find(scores.begin(), scores.end(), k) == scores.end())
        scores.push_back(k);
  for (const auto& k : scores) {
    const nlohmann::json *first = nullptr, *last = nullptr;
    for (const auto& r : evals)
      if (r.contains(k)) {
        if (!first) first = &r;
        last = &r;
      }
    s << "eval " << k.substr(5) << "  " << util::fixed((*first)[k].get<double>(), 4) << " (step " << (*first)["step"]
      << ") -> " << util::fixed((*last)[k].get<double>(), 4) << " (step " << (*last)["step"] << ")\n";
  }
  if (!evals.empty()) {
    double secs = 0;
    for (const auto& r : evals) secs += r["eval_seconds"].get<double>();
    s << "eval time        " << util::fixed(secs, 1) << " s over " << evals.size() << " evaluations\n";
  }
  if (auto v = column("tokens_per_s"); !v.empty()) s << "tokens/s         " << util::fixed(median(v), 0) << " (median)\n";
  if (auto v = column("mfu"); !v.empty()) s << "MFU              " << util::fixed(100 * median(v), 1) << "% (median)\n";
  if (auto v = column("peak_mem_mb"); !v.empty())
    s << "peak memory      " << util::fixed(*std::max_element(v.begin(), v.end()), 0) << " MB\n";
  std::string split;
  for (int p = 0; p < train::StepTimer::kNumParts; ++p) {
    const auto part = train::StepTimer::Part(p);
    const auto v = column(train::StepTimer::metric_key(part));
    if (!v.empty()) split += std::string(split.empty() ? "" : " / ") + train::StepTimer::name(part) + " " +
                             util::fixed(median(v), 1);
  }
  if (!split.empty()) s << "step time split  " << split << " ms (median of logged steps)\n";
  s << "checkpoints      " << checkpoints_line(run_dir) << "\n";
  fault_lines(run_dir, train, s);
  std::cout << s.str();
  if (!plot) return 0;

  const char* env_py = std::getenv("NNSTRAIN_PYTHON");
  const std::string python = env_py && *env_py ? env_py : NNSTRAIN_DEFAULT_PYTHON;
  const std::string script = std::string(NNSTRAIN_SCRIPTS_DIR) + "/plot_run.py";
  const int rc = run_program({python, script, run_dir, "--out", out});
  if (rc != 0) {
    std::cerr << "nnstrain report: the loss-curve plot failed (" << python << " " << script << " exited with "
              << rc << "); it needs matplotlib (scripts/setup.sh installs it; NNSTRAIN_PYTHON picks the Python), "
              << "or pass --no-plot\n";
    return 1;
  }
  std::cout << "plot             " << out << "\n";
  return 0;
}

}  // namespace nnstrain::cli
