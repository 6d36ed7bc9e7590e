// Where checkpoints meet models. checkpoint/ stores ShardSpec'd tensors and
// knows no model; what needs both (rebuilding the model a checkpoint was saved
// from, its Hugging Face names for `merge --hf`) lives here.
#pragma once

#include <memory>

#include "trainer/checkpoint/merge.h"

namespace nnstrain::models {
class CausalLM;
}
namespace nnstrain::config {
struct TrainerArgs;
}
namespace nnstrain::checkpoint {
class Checkpoint;
}

namespace nnstrain::interop {

// The run's configuration as the checkpoint saved it (state "config"), loaded
// without touching the run's files. Throws CheckpointError naming manifest.json.
config::TrainerArgs saved_args(const checkpoint::Checkpoint& ck);

// The registered model a checkpoint was saved from, built from its resolved
// config (state "model_type" + "config") with fresh weights, not loaded.
std::shared_ptr<models::CausalLM> build_model(const checkpoint::Checkpoint& ck);

// Copies the checkpoint's model/* tensors into `model`'s parameters (one process, whole tensors).
void load_model_weights(const checkpoint::Checkpoint& ck, models::CausalLM& model);

// The model's Hugging Face names, layouts and config.json, for merge --hf.
checkpoint::HfExport hf_export(models::CausalLM& model);

// checkpoint::merge, with --hf's names taken from the checkpoint's own model.
// dtype: "" (as stored), "F32", "BF16" or "F16".
checkpoint::MergeReport merge(const std::string& ckpt_dir, const std::string& out_dir, bool hf,
                              const std::string& dtype = "");

}  // namespace nnstrain::interop
