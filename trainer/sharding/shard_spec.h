// ShardSpec: which piece of a global tensor a rank holds. Checkpoint save,
// dedup, merge, reshard-on-load and gradient-norm counting are written once
// against ShardSpecs and never know which model they serve.
//
// A piece is a rectangular slice of the global tensor (offsets + shape), or
// several such blocks stored one after another (a tensor-parallel shard of a
// fused QKV weight holds its rows of Q, of K and of V), and optionally only the
// flat range [flat_begin, flat_end) of that storage in row-major order (ZeRO
// partitions cut parameters at arbitrary elements).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nnstrain::sharding {

struct ShardSpec {
  std::string name;                   // global name, e.g. "model/h.0.attn.c_attn.weight"
  std::string dtype;                  // safetensors dtype name, e.g. "F32"
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;       // start of the slice in each dim
  std::vector<int64_t> shape;         // size of the slice in each dim
  struct Block {
    std::vector<int64_t> offsets, shape;
  };
  std::vector<Block> more_blocks;     // further blocks after the first (rarely used)
  int64_t flat_begin = 0;             // flat range within the slice;
  int64_t flat_end = -1;              // -1 = to the end of the slice
  std::vector<int> replica_ranks;     // every rank that holds this same piece (sorted)

  // The whole tensor as one piece.
  static ShardSpec full(std::string name, std::string dtype, std::vector<int64_t> shape);

  int64_t slice_numel() const;
  int64_t numel() const;              // elements held: flat range length
  int64_t end() const { return flat_end < 0 ? slice_numel() : flat_end; }
  bool is_full() const;               // the whole global tensor
  // The one rank that writes or counts this piece among its replicas (the lowest).
  int owner() const { return replica_ranks.empty() ? 0 : replica_ranks.front(); }
  std::string describe() const;       // "name[0:64, 128:256] flat[0:100]"
};

// Bounds from_json enforces on specs read from files (a tensor of 2^62 elements
// has no use; overflow-free arithmetic below it).
constexpr size_t kMaxRank = 16;
constexpr int64_t kMaxNumel = int64_t{1} << 62;

void to_json(nlohmann::json& j, const ShardSpec& s);
// Throws std::runtime_error (naming the tensor) for a spec out of bounds.
void from_json(const nlohmann::json& j, ShardSpec& s);

// A run of elements contiguous in the global tensor's row-major order.
struct Run {
  int64_t global_begin;  // flat index in the global tensor
  int64_t local_begin;   // flat index in the piece's own storage
  int64_t length;
};
// The piece as runs sorted by global_begin (one per row of the slice at most).
std::vector<Run> runs(const ShardSpec& s);

// Elements to copy from a stored piece into a wanted piece (both of one global tensor).
struct Copy {
  int64_t src;     // element offset in the stored piece
  int64_t dst;     // element offset in the wanted piece
  int64_t length;
};
std::vector<Copy> overlap(const ShardSpec& stored, const ShardSpec& wanted);
// Total elements of `wanted` covered by `pieces` (to check a load is complete).
int64_t covered(const std::vector<ShardSpec>& pieces, const ShardSpec& wanted);

}  // namespace nnstrain::sharding
