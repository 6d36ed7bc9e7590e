#include "base/config/fault_tolerance_args.h"

#include "base/config/arg_map.h"
#include "base/config/trainer_args.h"

namespace nnstrain::config {

void load_fault_tolerance(ArgMap& top, TrainerArgs& t) {
  auto& f = t.fault_tolerance;
  if (!top.has("fault_tolerance")) return;
  ArgMap ft = top.child("fault_tolerance");
  f.spike_factor = ft.get_float("spike_factor", 0.0, 0.0);
  if (f.spike_factor > 0 && f.spike_factor <= 1)
    ft.fail("spike_factor", "must be above 1 (a multiple of the rolling median), or 0 for no spike detection");
  f.spike_window = ft.get_int("spike_window", 20, 3, 100000);
  f.nonfinite_steps = ft.get_int("nonfinite_steps", 0, 0, 100000);
  f.on_spike = ft.get_string("on_spike", "log", {"log", "rewind", "stop"});
  f.skip_window = ft.get_int("skip_window", 1, 1, 1 << 30);
  f.rerun_check = ft.get_bool("rerun_check", false);
  f.checksum_every_n_steps = ft.get_int("checksum_every_n_steps", 0, 0);
  f.on_checksum_mismatch = ft.get_string("on_checksum_mismatch", "stop", {"stop", "rewind"});
  f.straggler_factor = ft.get_float("straggler_factor", 0.0, 0.0);
  if (f.straggler_factor > 0 && f.straggler_factor <= 1)
    ft.fail("straggler_factor", "must be above 1 (a multiple of the other ranks' median), or 0 for no straggler report");
  f.straggler_intervals = ft.get_int("straggler_intervals", 3, 1, 100000);
  f.flight_recorder_size = ft.get_int("flight_recorder_size", 2048, 0, 1 << 24);

  const bool rewinds = (f.detects_spikes() && f.on_spike == "rewind") ||
                       (f.checksum_every_n_steps > 0 && f.on_checksum_mismatch == "rewind");
  if (rewinds && t.checkpoint.save_dir.empty())
    ft.fail(f.on_spike == "rewind" ? "on_spike" : "on_checksum_mismatch",
            "rewind goes back to a checkpoint, but checkpoint.save_dir is not set");
  if (f.rerun_check && f.on_spike != "rewind")
    ft.fail("rerun_check", "true reruns from the last checkpoint before rewinding; it needs on_spike: rewind");
  if (f.on_spike != "log" && !f.detects_spikes())
    ft.fail("on_spike", f.on_spike + " acts on spikes, but neither spike_factor nor nonfinite_steps is set");
  if (f.detects_spikes() && t.compute_config.pipeline.post_validation)
    ft.fail(f.spike_factor > 0 ? "spike_factor" : "nonfinite_steps",
            "reads every step's loss, which optimizer post-validation (pas_config.pipeline_post_validation) "
            "leaves in flight; set one of them off");
  if (f.checksum_every_n_steps > 0 && t.compute_config.use_zero == 3)
    ft.fail("checksum_every_n_steps",
            "compares replicated parameters, but compute_config.use_zero: 3 shards them over the data-parallel ranks");
}

}  // namespace nnstrain::config
