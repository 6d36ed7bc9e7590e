// Preference pairs for alignment (dataset.type preference; docs/alignment.md):
// the documents `prepare corpus --format preference` writes, three sequences
// each (prompt, chosen completion, rejected completion). A batch of P pairs is
// 2P rows, chosen first, as TRL's concatenated forward: row = prompt then
// completion, cut to seq_len from its start (TRL's max_length, keep_start),
// padded; targets only on the completion's tokens. With pack: one row per pair,
// chosen and rejected two documents of it (segments 0 and 1, padding 2), each
// cut to seq_len / 2. Pair order: global pair
// g = step x global_batch + position is pair permute(g mod N, N, key(seed,
// epoch)) of the N pairs (the file's order without shuffle), so any rank
// computes any batch (the data-stream contract of docs/data.md).
#pragma once

#include <cstdint>
#include <string>

#include "base/config/trainer_args.h"
#include "data/dataset.h"
#include "data/indexed/indexed_file.h"
#include "data/indexed/sample_stream.h"

namespace nnstrain::data {

class PreferenceDataset : public Dataset {
 public:
  // Reads and checks the manifest and index; `key` names the config entry in
  // errors ("dataset.train_args"), which are ConfigErrors (exit 2).
  PreferenceDataset(const config::PreferenceArgs& args, uint64_t seed, int64_t global_batch, const std::string& key);

  int64_t seq_len() const override { return args_.seq_len; }
  int64_t samples_per_epoch() const override { return pairs_; }  // a sample is a pair
  Batch train_batch(int64_t step, int64_t first, int64_t count) const override;
  // Batch k: pairs (k x global_batch + first + i) mod N in the file's order.
  Batch val_batch(int64_t k, int64_t first, int64_t count) const override;
  // Pairs [first, first + count) in the file's order (the reference pass).
  Batch pairs(int64_t first, int64_t count) const;

  void check_vocab(int64_t model_vocab) const;
  const indexed::Manifest& manifest() const { return manifest_; }

 private:
  Batch rows(const std::vector<int64_t>& pair_ids) const;

  config::PreferenceArgs args_;
  std::string key_;
  uint64_t seed_;
  int64_t global_batch_, pairs_ = 0;
  indexed::Manifest manifest_;
  indexed::Reader reader_;
  int64_t pad_id_ = 0;
};

}  // namespace nnstrain::data
