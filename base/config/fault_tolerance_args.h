// fault_tolerance: what a long run does about loss spikes, non-finite steps,
// stragglers, silent divergence between replicas, and what each rank keeps of
// its last collectives (docs/config.md, "fault_tolerance"). Every key is
// optional; the defaults detect nothing and keep the flight recorder on.
#pragma once

#include <cstdint>
#include <string>

namespace nnstrain::config {

struct FaultToleranceArgs {
  // A loss or gradient norm above spike_factor x the median of the last
  // spike_window ordinary steps is a spike (0: no spike detection).
  double spike_factor = 0;
  int64_t spike_window = 20;
  // This many non-finite steps in a row (0: none; without a loss scaler the
  // first non-finite step then stops the run, as before).
  int64_t nonfinite_steps = 0;
  std::string on_spike = "log";  // log | rewind | stop
  // Rewind: data steps skipped, the spike step's and those before it.
  int64_t skip_window = 1;
  bool rerun_check = false;  // rewind once without skipping to tell a transient fault from the data
  int64_t checksum_every_n_steps = 0;         // 0: no cross-replica checksums
  std::string on_checksum_mismatch = "stop";  // stop | rewind
  double straggler_factor = 0;                // 0: no straggler report
  int64_t straggler_intervals = 3;
  int64_t flight_recorder_size = 2048;        // collectives kept per rank (0: off)

  bool detects_spikes() const { return spike_factor > 0 || nonfinite_steps > 0; }
};

class ArgMap;
struct TrainerArgs;
// Reads the fault_tolerance section of `top` into t.fault_tolerance, after the
// checkpoint and compute_config sections (the checks combine them); a wrong
// key or value is a ConfigError naming it.
void load_fault_tolerance(ArgMap& top, TrainerArgs& t);

}  // namespace nnstrain::config
