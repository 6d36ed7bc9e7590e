// Training samples from Megatron indexed datasets (dataset.type: indexed), torch-free.
//
// Per dataset and epoch: the documents in a seeded order, each joined with EOS
// (after it) or BOS (before it) or nothing, into one token stream with no padding;
// sample k = stream tokens [k * T, k * T + T + 1) (T = seq_len, so consecutive
// samples share one token, as Megatron's GPTDataset), the tail that fills no
// sample dropped; the epoch's samples in a seeded order. Several datasets are
// blended by Megatron-Core's deterministic rule (build_blending_indices): sample
// i of the blend goes to the dataset d maximising w_d * max(i, 1) - given_d
// (weights normalised to sum 1, ties to the lowest d). Everything is a function
// of (seed, global sample index): the permutations are counter-based (a Feistel
// network over the index, cycle-walked), the blend's counts are memoised every
// 65,536 samples, and an epoch's document offsets are built when first needed.
// docs/data.md states the rule.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/indexed/indexed_file.h"

namespace nnstrain::indexed {

// PREFIX.manifest.json as `nnstrain prepare corpus` writes it (docs/data.md).
struct Manifest {
  std::string path;    // the manifest file
  std::string prefix;  // where .bin/.idx are: beside the manifest, never outside its folder
  std::string tokenizer_sha256, tokenizer_path;
  int64_t vocab_size = 0;
  std::optional<int64_t> eos_id, bos_id;
  // 1: plain documents; 2: prompt then response (instruction data); 0: any
  // number, alternating context and target (chat data, "alternating");
  // kPreferenceSequences: prompt, chosen, rejected ("preference": dataset.type preference only).
  int sequences_per_document = 1;
  // Chat data prepared with --max-tokens N (settings.max_tokens): no conversation
  // is longer than N tokens; 0: no cap recorded.
  int64_t max_tokens = 0;
  // Chat data: the SHA-256 of the template text it was rendered with and where that
  // text came from (settings.chat_template_sha256/_source); "" for other data.
  std::string chat_template_sha256, chat_template_source;
};
constexpr int kPreferenceSequences = 3;
// `path` is PREFIX or PREFIX.manifest.json. Throws std::runtime_error naming the file.
Manifest read_manifest(const std::string& path);

enum class Join { eos, bos, none };

// A bijection of [0, n) keyed by `key` (4-round Feistel network, cycle-walked).
uint64_t permute(uint64_t x, uint64_t n, uint64_t key);

// Megatron-Core's blending: for samples [0, n), the dataset of each and its
// index within that dataset. Weights need not sum to 1 (normalised here).
void blend(const std::vector<double>& weights, int64_t n, std::vector<int>* dataset,
           std::vector<int64_t>* dataset_sample);

// One sample: seq_len + 1 tokens and, per token, whether it belongs to a
// prompt (a context sequence: the even-numbered sequences 0, 2, ... of a
// document of two or more, i.e. an instruction's prompt or a conversation's
// text other than the assistant's) and which document of
// the sample it belongs to (0, 1, ...; a join token belongs to the document it ends (EOS) or starts (BOS)).
struct Sample {
  std::vector<int64_t> tokens;
  std::vector<uint8_t> prompt;
  std::vector<int32_t> doc;
};

class SampleStream {
 public:
  struct Source {
    Reader reader;
    double weight = 1.0;
    bool prompts = false;  // documents alternate (context, target, ...): flag the context tokens
  };
  // join_id: the token joining documents (ignored for Join::none). Throws
  // std::runtime_error naming the dataset if one epoch of it fills no sample.
  SampleStream(std::vector<Source> sources, int64_t seq_len, Join join, int64_t join_id, uint64_t seed);

  int64_t seq_len() const { return seq_len_; }
  size_t num_datasets() const { return src_.size(); }
  // Samples in one epoch of dataset i; the sum over datasets is the blend's epoch.
  int64_t samples_per_epoch(size_t i) const { return src_[i].samples; }
  int64_t samples_per_epoch() const;

  // Global samples [first, first + n): dataset and index within it (Megatron's blending).
  std::vector<std::pair<int, int64_t>> locate(int64_t first, int64_t n) const;
  // Sample j of dataset i (its epoch j / samples_per_epoch(i)).
  void read(size_t i, int64_t j, Sample* out) const;
  // Stream-start token of sample j of dataset i within its epoch's stream (for tests).
  int64_t sample_start(size_t i, int64_t j) const;
  // Dataset i, epoch e: the document at position p of the epoch's order.
  int64_t document_at(size_t i, int64_t e, int64_t p) const;

 private:
  struct Src {
    Reader reader;
    double weight;
    bool prompts;
    std::vector<int64_t> doc_len;  // per document
    int64_t epoch_tokens = 0, samples = 0;
  };
  // Unit = a document with its join token; offsets of the units in epoch e's order (size D + 1).
  std::shared_ptr<const std::vector<int64_t>> epoch_offsets(size_t i, int64_t e) const;
  uint64_t key(size_t i, int64_t e, uint64_t what) const;

  std::vector<Src> src_;
  std::vector<double> weights_;  // normalised
  int64_t seq_len_;
  Join join_;
  int64_t join_id_;
  uint64_t seed_;

  mutable std::mutex mu_;
  mutable std::map<std::pair<size_t, int64_t>, std::shared_ptr<const std::vector<int64_t>>> epochs_;  // a few, most recent
  mutable std::vector<std::pair<size_t, int64_t>> epoch_lru_;
  mutable std::vector<std::vector<int64_t>> blend_counts_;  // given_d before sample b * kBlock
};

}  // namespace nnstrain::indexed
