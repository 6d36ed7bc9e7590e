// What the training loop does about faults that do not kill a process
// (config section fault_tolerance, docs/fault_tolerance.md):
//   - loss spikes and runs of non-finite steps: logged, or the run stops, or it
//     rewinds to the last checkpoint before the spike and skips the data steps
//     that preceded it, optionally after rerunning the spike step once from that
//     checkpoint (the same numbers again: the data or the optimisation; others:
//     a transient fault, nothing skipped);
//   - cross-replica checksums every K steps: the first parameter whose replicas
//     differ is named with its ranks and step; the run stops or rewinds;
//   - each rank's step time (compute and waiting), carried by the host
//     collective the logging step already makes, and the straggler named;
//   - the restart record: a run restarted by `nnstrain launch --max-restarts`
//     writes why and what the restart cost into run_dir/restarts.jsonl.
//
// Collectives (every rank issues them in the same order, as NCCL requires; no
// tags): with spike detection on, after every step the loss all-reduce over the
// pipeline (pp > 1) and over dp x cp, then one host all-reduce (max) of the
// decision on the CPU control group; every checksum step one all-reduce (max)
// over dp x cp (the dense parameters), one over edp when it has 2+ ranks (the
// expert shards: ep peers hold different experts, their replicas are the ranks
// holding the same ones) and one host all-reduce over the world. Every rank
// runs every step, so each takes part in the same ones. The step times add no
// collective.
//
// The data position stays one number: training step index s (0-based) reads
// data step data_step(s), which is s moved past every skipped window; the
// windows travel in the checkpoint's state (data_cursor.skipped), so a resume
// after a skip reads what the run that skipped read; a rewind that adds one
// writes it into the state of the checkpoint it went back to at once, so a
// crash before the next save does not train on the skipped data. The spike
// detector's history travels there too (fault_tolerance.history), so a resume
// is not blind for spike_window steps.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"

namespace nnstrain::dist {
class Runtime;
}
namespace nnstrain::parallel {
struct ParamShard;
}

namespace nnstrain::train {

class JsonlSink;

// Skipped data steps, as sorted, disjoint [first, end) windows.
using SkipWindows = std::vector<std::pair<int64_t, int64_t>>;

// The data step that training step index `s` (0-based) reads.
int64_t data_step(const SkipWindows& windows, int64_t s);
// `windows` with [first, end) added (merged where they touch).
SkipWindows add_window(SkipWindows windows, int64_t first, int64_t end);
// The windows a checkpoint's state records (none for a fresh start or an older checkpoint).
SkipWindows skipped_windows(const std::string& checkpoint_dir);
// The newest complete checkpoint under save_dir whose step is below `below` ("" if none); *step set.
std::string checkpoint_before(const std::string& save_dir, int64_t below, int64_t* step);
// What a run resumes from (RunOptions::resume) given the command's `requested`
// ("" / "last" / a folder). A restart (NNSTRAIN_RESTART_COUNT > 0, set by
// `nnstrain launch --max-restarts` and the job scripts) continues from the newest
// complete checkpoint under checkpoint.save_dir when it holds one, else from
// where the run started (--resume PATH, checkpoint.resume_from, or scratch);
// otherwise `requested` as it is.
std::string restart_source(const config::TrainerArgs& args, const std::string& requested);

// Where the loop goes back to.
struct Rewind {
  std::string dir;  // the checkpoint folder
  int64_t step = 0;
};

class FaultTolerance {
 public:
  // rt: null for one process; `pipeline`: the loss is on the last stage (pp > 1);
  // zero_stage: the plan's (checksums compare replicas, which ZeRO-3 does not
  // keep: refused, whatever chose the stage).
  FaultTolerance(const config::TrainerArgs& args, dist::Runtime* rt, int rank, int world, bool pipeline,
                 const std::string& device, const std::string& resumed_from, int64_t start_step, int zero_stage = 0);
  ~FaultTolerance();

  // Called by the loader's prefetch thread while the loop may add a window.
  int64_t data_step(int64_t s) const {
    std::lock_guard<std::mutex> lock(skipped_mu_);
    return train::data_step(skipped_, s);
  }
  // The first non-finite step is this component's (nonfinite_steps > 0), not the loop's stop.
  bool handles_nonfinite() const { return args_.nonfinite_steps > 0; }
  void set_sink(JsonlSink* jsonl) { jsonl_ = jsonl; }
  // Pipelines: the parameters held on the first and the last stage alike (the
  // head's tied embedding, CausalLM::head_ties), compared by the checksums too.
  void set_tied(std::vector<std::string> names) { tied_ = std::move(names); }
  // Waits for this rank's checkpoint saves in flight (before a rewind picks one).
  void set_save_wait(std::function<void()> wait) { wait_saves_ = std::move(wait); }

  // After step `step` (1-based): the restart record, the checksum check, spike
  // detection. Returns where to rewind to when the loop must go back.
  std::optional<Rewind> after_step(int64_t step, const at::Tensor& loss_share, const at::Tensor& grad_norm,
                                   const std::vector<parallel::ParamShard>& params);
  // The loop has loaded `r` (every rank) and reopened the metrics sink (set_sink):
  // checkpoints after it are removed and the decisions recorded again (rank 0).
  void rewound(const Rewind& r);
  // Into a checkpoint's state: the skipped windows (data_cursor.skipped) and
  // the spike detector's history (fault_tolerance.history).
  void annotate(nlohmann::json& state) const;

  // Step times at a logging step: this rank's compute and waiting (ms, from the
  // step-time split; negative: not measured) appended to `values` as its slots of
  // the host maximum that step already makes; read back from it after.
  void add_step_times(std::vector<int64_t>& values, const std::array<double, 6>& split_ms, bool measured);
  void read_step_times(const std::vector<int64_t>& values, nlohmann::json& record, int64_t step);

 private:
  struct Values {
    double loss, grad_norm;
  };
  std::optional<Rewind> check_spike(int64_t step, const Values& v);
  std::optional<Rewind> check_replicas(int64_t step, const std::vector<parallel::ParamShard>& params);
  void record_restart(int64_t step);
  void event(int64_t step, nlohmann::json what, const std::string& line);
  int agree(int action);                 // the largest action any rank proposes (0: none)
  Rewind checkpoint_for(int64_t below);  // the newest checkpoint below step `below`, agreed by every rank
  std::string where(int rank);

  const config::FaultToleranceArgs args_;
  const std::string save_dir_, run_dir_;
  dist::Runtime* rt_;
  const int rank_, world_;
  const bool pipeline_;
  const int64_t start_step_;
  JsonlSink* jsonl_ = nullptr;
  std::function<void()> wait_saves_;
  const bool scaler_;  // a loss scaler (fp16): its overflow steps are its own, not faults
  mutable std::mutex skipped_mu_;  // skipped_: read by the prefetch thread
  SkipWindows skipped_;
  bool skipped_changed_ = false;   // a rewind added a window: written into the checkpoint it went back to
  std::vector<std::string> tied_;  // pipelines: names held by the first and the last stage
  bool restart_recorded_ = false;
  std::map<int64_t, Values> history_;  // ordinary steps' values, for the rolling median
  int64_t nonfinite_run_ = 0;          // non-finite steps in a row
  struct Rerun {
    int64_t step;
    Values seen;
    int64_t run;  // its non-finite steps in a row (1 for a spike): all of them are skipped if reproduced
  };
  std::optional<Rerun> rerun_;  // a spike step awaiting its rerun
  std::set<int64_t> skipped_at_;  // spike steps rewound with a skip (a second spike there stops the run)
  std::vector<nlohmann::json> events_;  // rank 0's decisions so far (written again after a rewind)
  size_t times_offset_ = 0;     // where this rank's step times sit in the logging step's host maximum
  std::vector<int64_t> slow_intervals_;  // per rank: logging intervals in a row above the factor
};

}  // namespace nnstrain::train
