// Megatron-LM's indexed dataset files (.bin + .idx), written and read without
// LibTorch. Format (Megatron-Core, datasets/indexed_dataset.py):
//
//   .bin  the token ids of every sequence, back to back, little-endian, one dtype
//   .idx  "MMIDIDX\0\0", u64 version (1), u8 dtype code (8: uint16, 4: int32),
//         u64 sequence count S, u64 document-index count D (= documents + 1),
//         i32 lengths[S], i64 byte pointers[S], i64 document_indices[D]
//
// A document is one or more consecutive sequences: document d holds sequences
// [document_indices[d], document_indices[d+1]). nnstrain writes one sequence per
// document, or two (prompt, response) for instruction data. The dtype is Megatron's
// choice: uint16 for vocabularies under 65,500 ids, else int32.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace nnstrain::indexed {

enum class DType : uint8_t { int32 = 4, uint16 = 8 };
DType dtype_for_vocab(int64_t vocab_size);  // Megatron's DType.optimal_dtype
const char* dtype_name(DType d);

// A sequence the format cannot hold (over 2^31 - 1 tokens: .idx lengths are int32).
struct IndexLimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Streams documents into PREFIX.bin.tmp and PREFIX.idx.tmp; commit() fsyncs and
// renames them to PREFIX.bin / PREFIX.idx. Destroyed uncommitted: the temporaries go.
class Writer {
 public:
  Writer(std::string prefix, DType dtype);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // One document made of the given sequences (ids must fit the dtype; throws if not;
  // IndexLimitError, before writing anything, for a sequence over 2^31 - 1 tokens).
  void add_document(const std::vector<const std::vector<int32_t>*>& sequences);
  void add_document(const std::vector<int32_t>& ids) { add_document({&ids}); }
  void commit();

  int64_t documents() const { return static_cast<int64_t>(doc_index_.size()) - 1; }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  DType dtype_;
  std::ofstream bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_index_{0};
  int64_t tokens_ = 0;
  bool committed_ = false;
  std::vector<char> buf_;
};

// A memory-mapped .bin/.idx pair, validated before use (header, version, dtype,
// counts against the file sizes, pointers and document indices consistent).
// Errors name the file. Copies share the mapping.
class Reader {
 public:
  explicit Reader(const std::string& prefix);
  const std::string& prefix() const;
  DType dtype() const;
  int64_t sequences() const;
  int64_t documents() const;
  int64_t tokens() const;
  // Sequences of document d: [doc_begin(d), doc_begin(d + 1)).
  int64_t doc_begin(int64_t d) const;
  int32_t seq_length(int64_t s) const;
  int64_t seq_offset(int64_t s) const;  // in tokens from the start of .bin
  // Tokens [start, start + n) of the .bin as int64 (start, n in tokens).
  void read(int64_t start, int64_t n, int64_t* out) const;
  int64_t max_token() const;  // scanned once

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace nnstrain::indexed
