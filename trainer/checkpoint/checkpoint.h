// Checkpoints: one folder per saved step, tensors in safetensors files (one per
// writing rank), and manifest.json listing every stored piece's ShardSpec plus
// the trainer state. Written into a temporary folder, fsynced, manifest last,
// published by rename; only then the `latest` pointer moves and old ones go.
// Loading reads, for each wanted local piece, the parts of stored pieces that
// overlap it, so a checkpoint loads under any plan. See docs/checkpoint.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/checkpoint/manifest.h"
#include "trainer/sharding/shard_spec.h"
#include "trainer/sharding/state_tensor.h"

namespace nnstrain::checkpoint {

using sharding::StateTensor;

// How this rank takes part in a collective save or load.
struct SaveContext {
  int rank = 0;
  int world_size = 1;
  std::function<void()> barrier;  // all ranks; empty when world_size == 1
  // Rank 0 learns whether every rank succeeded (true) before publishing.
  std::function<bool(bool ok)> all_ok;
};

struct SaveOptions {
  std::string save_dir;
  std::string save_type = "sharded";  // sharded | deduped
  int keep_last = 0;                  // 0 = keep all
};

// The folder name of a step's checkpoint: "step-00000020".
std::string step_dir_name(int64_t step);

// Saves, publishes, points `latest` at it and prunes. `state` is the trainer
// state JSON (step, cursor, scheduler...), stored in the manifest by rank 0;
// `rank_state` is per-rank JSON (e.g. RNG) stored by each rank. Returns the folder.
std::string save(const SaveOptions& opts, const SaveContext& ctx, int64_t step,
                 const std::vector<StateTensor>& tensors, const nlohmann::json& state,
                 const nlohmann::json& rank_state);

// The phases of save(), for the asynchronous saver (async_save.h), which runs them
// on a background thread and agrees through the store instead of collectives.
// Rank 0: a fresh, empty save_dir/.tmp-step-N.
void begin_save(const SaveOptions& opts, int64_t step);
// Every rank: its safetensors file and ShardSpec list into the temporary folder,
// fsynced. Returns the tensor bytes written.
uint64_t write_rank_files(const SaveOptions& opts, int rank, int64_t step, const std::vector<StateTensor>& tensors,
                          const nlohmann::json& rank_state);
// Rank 0, after every rank has written: manifest last, rename, `latest`, prune. Returns the folder.
std::string publish(const SaveOptions& opts, int world_size, int64_t step, const nlohmann::json& state);
// Rank 0, after some rank failed: the temporary folder goes.
void abandon_save(const SaveOptions& opts, int64_t step);

// A published checkpoint folder, opened and checked.
class Checkpoint {
 public:
  explicit Checkpoint(std::string dir);  // reads and validates manifest.json
  const std::string& dir() const { return dir_; }
  const nlohmann::json& manifest() const { return manifest_; }
  const nlohmann::json& state() const { return manifest_.at("state"); }
  // Per-rank JSON saved by `rank`, if that rank saved one.
  std::optional<nlohmann::json> rank_state(int rank) const;
  bool has(const std::string& name) const;
  // Fills `want` (its tensor already allocated with the right dtype and numel)
  // from the stored pieces; errors name the tensor, file and fault.
  void load_into(StateTensor& want) const;
  // All stored pieces of one global tensor.
  std::vector<std::pair<ShardSpec, std::string /*file*/>> pieces(const std::string& name) const;
  std::vector<std::string> names() const;

  // Where a piece's bytes are. A manifest entry may carry "key" (the tensor's
  // name inside the file when it is not the global name, e.g. a Hugging Face
  // name) and "transposed" (a full 2-d tensor stored as its transpose, as
  // GPT-2's Conv1D weights are); merged --hf checkpoints use both.
  using Stored = ManifestEntry;

 private:
  std::string dir_;
  nlohmann::json manifest_;
  std::map<std::string, std::vector<Stored>> index_;
  mutable std::map<std::string, std::shared_ptr<class SafetensorsReader>> readers_;  // opened on first use
};

// The newest complete checkpoint (step folder with a manifest) under save_dir, for
// --resume; if none is complete, the folder `latest` names (loading it reports the
// fault); "" when there is neither.
std::string latest(const std::string& save_dir);

// Writes a small file durably: a temporary name, fsync, rename over `path`.
void write_file_durable(const std::string& path, const std::string& text);

// `rm -rf path` (nothing if absent). Not std::filesystem::remove_all: libtorch.so
// exports its own copy of it, which crashes when it wins symbol resolution (pytorch#133437).
void remove_tree(const std::string& path);

// Deletes a published step folder without ever showing a half-deleted "step-*"
// (which --resume and restarts would pick): renamed out of sight first (atomic),
// then removed. A crash leaves a ".tmp-step-*", which the next save clears.
void discard_step(const std::string& step_folder);

// Rank 0: edits the trainer state stored in a published checkpoint's manifest
// (rewritten durably: a crash leaves the old manifest or the new one).
void rewrite_state(const std::string& checkpoint_dir, const std::function<void(nlohmann::json& state)>& edit);

}  // namespace nnstrain::checkpoint
