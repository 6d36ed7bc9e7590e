// `nnstrain merge` (its CLI: trainer/interop/merge_command.h): one full checkpoint from a sharded or
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
// (renamed, Conv1D weights transposed, as the caller's HfExport says) and
// config.json is added, so transformers' from_pretrained(DIR) loads it; the
// manifest maps those entries back, so the folder still resumes. This module
// knows no model: trainer/interop builds the HfExport from the model's
// declaration and runs the CLI.
//
// Tensors are streamed: each global tensor is assembled from its stored pieces,
// appended to its output file and freed before the next, so the peak memory is
// about the largest tensor, not the model.
// The output is written to DIR.tmp and published by rename.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace nnstrain::checkpoint {

// One model tensor's Hugging Face name and layout.
struct HfName {
  std::string theirs;      // e.g. "transformer.h.0.attn.c_attn.weight"
  bool transpose = false;  // stored [in, out] (GPT-2's Conv1D)
  // A stacked [E, ...] parameter (MoE experts) written as one tensor per
  // expert: experts[e] names ours[e] (then `theirs` is unused).
  std::vector<std::string> experts;
  // >= 0: ours is rows [fused_offset, ..) of `theirs`, one tensor written from
  // the parts naming it, concatenated in row order (Phi-3's qkv_proj).
  int64_t fused_offset = -1;
};

// What --hf needs from the model: every parameter's HF name (by our name,
// without "model/"), and config.json.
struct HfExport {
  std::map<std::string, HfName> names;
  nlohmann::json config;
};

struct MergeOptions {
  std::optional<HfExport> hf;  // Hugging Face names, layouts and config.json
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

}  // namespace nnstrain::checkpoint
