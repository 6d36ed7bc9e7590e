// Reading checkpoint metadata without LibTorch: bounded JSON, the manifest's
// index of stored pieces, and the rule for file names that come from data (a
// manifest, a Hugging Face index, the `latest` pointer): a plain name inside its
// folder, never a path that leaves it. Kept torch-free so the fuzzers
// (tests/fuzz/) exercise exactly the code the loader runs.
#pragma once

#include <cstddef>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/sharding/shard_spec.h"

namespace nnstrain::checkpoint {

using sharding::ShardSpec;  // checkpoints are written against ShardSpecs (trainer/sharding)

struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// manifest.json's "format" and "version".
constexpr const char* kCheckpointFormat = "nnstrain-checkpoint";
constexpr int kCheckpointVersion = 1;

// Bounds on JSON read from a checkpoint or a Hugging Face folder. A manifest of a
// 70B model on 1024 ranks is tens of MB and nests about 8 deep.
constexpr size_t kMaxJsonBytes = size_t{256} << 20;
constexpr int kMaxJsonDepth = 64;

// Parses `text` (named `where` in errors), refusing nesting deeper than kMaxJsonDepth.
nlohmann::json parse_json_bounded(const std::string& text, const std::string& where);
// A file's bytes, refusing one over kMaxJsonBytes (or not a regular file) before reading it.
std::string read_file_bounded(const std::string& path);
// read_file_bounded + parse_json_bounded.
nlohmann::json read_json_bounded(const std::string& path);

// Throws CheckpointError(`what` + ...) unless `name` is a plain file name: not
// empty, no '/', no NUL, not "." or "..".
void check_plain_name(const std::string& name, const std::string& what);
// dir/name after check_plain_name, refusing a symbolic link whose target lies
// outside `dir`. A missing file is returned as is (the caller reports it).
std::string confined_path(const std::string& dir, const std::string& name, const std::string& what);

// One stored piece as manifest.json lists it.
struct ManifestEntry {
  ShardSpec spec;
  std::string file;  // a plain name inside the checkpoint folder
  std::string key;   // the tensor's name inside the file (the spec's name unless given)
  bool transposed = false;
  // >= 0: the piece is elements [key_offset, key_offset + numel) of a larger
  // tensor `key` (merge --hf's fused tensors); -1: the whole tensor.
  int64_t key_offset = -1;
};

// manifest.json, validated (no file opened): format and version, plain shard
// names, ShardSpecs in bounds, pieces of one tensor agreeing on shape and dtype,
// `state` and `rank_states` present. `where` names the manifest in errors.
struct Manifest {
  nlohmann::json json;
  std::map<std::string, std::vector<ManifestEntry>> index;  // global name -> pieces
  std::vector<std::string> files;                           // shard files, as listed
};
Manifest parse_manifest(const std::string& text, const std::string& where);

}  // namespace nnstrain::checkpoint
