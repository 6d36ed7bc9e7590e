// `nnstrain merge CKPT --out DIR [--hf]`: one full checkpoint from a sharded or
// deduped one. The result is itself an nnstrain checkpoint (manifest.json of
// whole-tensor ShardSpecs, world_size 1), so `--resume DIR` works under any plan,
// laid out for humans and other tools:
//
//   manifest.json           what the trainer reads (files, ShardSpecs, state)
//   model.safetensors       model/* tensors, named without "model/"
//   optimizer.safetensors   optim/* tensors, named without "optim/"
//   state.safetensors       anything else (per-rank RNG states), full names
//   trainer_state.json      the trainer state (step, data cursor, scheduler, plan...)
//   config.yaml             the resolved configuration of the run
//
// With --hf, model.safetensors holds Hugging Face names and layouts instead
// (models::CausalLM::hf_tensors(): renamed, Conv1D weights transposed) and
// config.json is added, so transformers' from_pretrained(DIR) loads it; the
// manifest maps those entries back, so the folder still resumes.
//
// Tensors are streamed: each global tensor is assembled from its stored pieces,
// appended to its output file and freed before the next, so the peak memory is
// about the largest tensor, not the model. --hf additionally builds the model
// once, to learn its Hugging Face names, and frees it before streaming.
// The output is written to DIR.tmp and published by rename.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::checkpoint {

class Checkpoint;

struct MergeOptions {
  bool hf = false;    // Hugging Face names, layouts and config.json
  std::string dtype;  // safetensors name ("F32", "BF16", "F16") of the weights written; "" = as stored
};

struct MergeReport {
  std::string out_dir;
  int64_t tensors = 0;
  int64_t bytes = 0;          // tensor bytes written
  int64_t largest_bytes = 0;  // the largest single tensor
};

// Throws CheckpointError (or SafetensorsError) naming the file and the fault;
// leaves no DIR behind on failure. Refuses an existing DIR.
MergeReport merge(const std::string& ckpt_dir, const std::string& out_dir, const MergeOptions& opts = {});

// The CLI: args are what follows "merge". Returns the exit status (0, 1 error, 2 usage).
int merge_main(const std::vector<std::string>& args);

// The registered model a checkpoint was saved from, built from its resolved
// config (state "model_type" + "config") with fresh weights, not loaded.
std::shared_ptr<models::CausalLM> build_model(const Checkpoint& ck);

// Copies the checkpoint's model/* tensors into `model`'s parameters (one process, whole tensors).
void load_model_weights(const Checkpoint& ck, models::CausalLM& model);

}  // namespace nnstrain::checkpoint
