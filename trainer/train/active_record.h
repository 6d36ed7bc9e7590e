// The run's record of what actually ran, one file per rank:
// run_dir/active/rank<R>.json (docs/observability.md "What ran").
//
// plan.json says what the planner decided from the config; this record is
// written from the objects start-up built (the process groups' sizes, the
// training state, the model's loss, the pipeline this rank runs, the offload
// tiers) and completed with counts taken inside the code that ran during this
// process's first step and first evaluation: which kernel forms dispatched,
// which loss's forward ran how often, the dtype the gradients were reduced
// in, the pipeline's point-to-point sends. A parity test reads it to show that
// the feature it compares was on (a fused-kernel run and a composite one are
// bitwise equal on CPU; only this tells them apart).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "models/common/kernels/kernels.h"

namespace nnstrain::dist {
class Runtime;
}
namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::train {

struct Trainable;

// "float32", "bfloat16", "float16", ...: the record's names of dtypes.
std::string dtype_label(c10::ScalarType t);

// The start-up part, from the objects built: the process groups (sizes and
// this rank's place), ZeRO stage, dtypes, the model's loss and recompute, the
// kernel form asked for, the offload tiers, the pipeline this rank runs.
nlohmann::json startup_record(const models::CausalLM& model, const dist::Runtime* rt, Trainable& tr, int rank,
                              int world);

// The process-wide counters a part of the run moves (kernels, losses, the pipeline's sends).
struct RunCounts {
  models::common::kernels::KernelCalls kernels;
  int64_t plain_loss = 0, chunked_loss = 0, fused_loss = 0;  // models/common/lm_loss.h's LossForwards
  int64_t pp_sends = 0, pp_bytes = 0;
  int64_t ep_all_to_all = 0, ep_bytes = 0;  // expert parallelism's dispatch (counts exchanges included)
  int64_t optimizer_all_to_all = 0, optimizer_bytes = 0;  // the optimizer's collectives (Muon's matrix exchange)
  int64_t document_tiles = 0;  // document-masked attention tiles (models/common/context_attention.h)
  int64_t varlen_attention = 0;  // packed-document varlen attention calls (models/common/varlen_attention.h)

  static RunCounts now(const dist::Runtime* rt);
  // What ran between `before` and this, as the record's JSON.
  nlohmann::json since(const RunCounts& before) const;
};

class ActiveRecord {
 public:
  // Writes the start-up part (`startup`) to run_dir/active/rank<rank>.json.
  ActiveRecord(const std::string& run_dir, int rank, nlohmann::json startup);
  // Adds (or replaces) one part and writes the file again.
  void complete(const std::string& key, nlohmann::json part);
  bool has(const std::string& key) const { return record_.contains(key); }

 private:
  void write() const;
  std::string path_;
  nlohmann::json record_;
};

}  // namespace nnstrain::train
