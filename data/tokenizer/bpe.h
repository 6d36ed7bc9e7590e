// Byte-pair encoding of one pre-tokenized piece: start from its bytes, repeatedly
// merge the adjacent pair of lowest rank (the leftmost of equals), as Hugging Face
// `tokenizers` and tiktoken do. Tokens are raw byte strings here (the GPT-2 byte-to-
// character mapping is undone at load), so encoding never maps characters.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer/flat_map.h"

namespace nnstrain::tok {

struct BpeMerge {
  uint32_t rank;
  int32_t id;  // the merged token
};

class BpeModel {
 public:
  // Building. add_token: returns false if the id or the bytes are already taken.
  bool add_token(std::string_view bytes, int32_t id);
  // The merge (a, b) -> merged at `rank`; a later merge of the same pair replaces it.
  void add_merge(int32_t a, int32_t b, uint32_t rank, int32_t merged);
  void set_ignore_merges(bool v) { ignore_merges_ = v; }
  // Room for n tokens / merges, so that loading does not rehash as it goes.
  void reserve(size_t n) { vocab_.reserve(n); }
  void reserve_merges(size_t n) { merges_.reserve(n); }

  // The id of a whole byte string, or -1.
  int32_t find(std::string_view bytes) const {
    const int32_t* v = vocab_.find(bytes);
    return v ? *v : -1;
  }
  bool has_id(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < present_.size() && present_[id]; }
  std::string_view bytes(int32_t id) const { return id_bytes_[id]; }
  int32_t byte_id(unsigned char b) const { return byte_ids_[b]; }
  // The first byte value with no single-byte token, or -1 when all 256 have one.
  int missing_byte() const;
  size_t size() const { return vocab_.size(); }
  size_t merges() const { return merges_.size(); }
  int32_t max_id() const { return static_cast<int32_t>(id_bytes_.size()) - 1; }
  bool ignore_merges() const { return ignore_merges_; }

  // The longest piece encode() takes: the merge loop numbers a piece's bytes with
  // int32 (16 bytes of state per byte: a longer piece would need over 32 GiB).
  static constexpr size_t kMaxPiece = 0x7FFFFFFF;
  // Appends the ids of `piece` (non-empty, at most kMaxPiece bytes) to out.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

 private:
  const BpeMerge* merge(int32_t a, int32_t b) const {
    return merges_.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
  }
  void encode_short(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_long(std::string_view piece, std::vector<int32_t>& out) const;

  StringMap<int32_t> vocab_;
  std::vector<std::string> id_bytes_;
  std::vector<bool> present_;
  int32_t byte_ids_[256] = {};
  bool byte_set_[256] = {};
  U64Map<BpeMerge> merges_;
  bool ignore_merges_ = false;
};

}  // namespace nnstrain::tok
