// The token_bin dataset: nanoGPT-format token files, memory-mapped, and the data-stream
// contract of DESIGN.md: the sample the model sees at step s, global-batch position p,
// depends only on (seed, s, p), never on how ranks split the global batch. So any rank
// can compute any sample, dp=2 sees the data dp=1 sees, and a resume under another plan
// continues the same stream. See docs/data.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "base/config/trainer_args.h"
#include "data/dataset.h"
#include "data/splitmix.h"

namespace nnstrain::data {

// A memory-mapped nanoGPT token file: a flat array of little-endian uint16 or uint32
// token ids, no header. Copies share the mapping. Errors name the file.
class TokenFile {
 public:
  TokenFile(const std::string& path, const std::string& dtype);  // dtype: uint16 | uint32
  const std::string& path() const;
  const std::string& dtype() const;
  int64_t size() const;  // tokens
  // Tokens [start, start + n) as int64; throws (naming the file) if out of range.
  void read(int64_t start, int64_t n, int64_t* out) const;
  // The largest token id in the file; scanned once on first call (for vocab-size checks).
  int64_t max_token() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Before training: every id in `file` must be below the model's vocabulary. Throws
// config::ConfigError (exit 2) naming `key`, the file, the largest id and the vocabulary.
void check_token_ids(const TokenFile& file, int64_t vocab_size, const std::string& key);

class TokenBinDataset : public Dataset {
 public:
  // Opens args.path; throws (naming the file) if it holds fewer than seq_len + 1 tokens.
  TokenBinDataset(const config::TokenBinArgs& args, uint64_t seed);

  const TokenFile& file() const { return file_; }
  int64_t seq_len() const override { return seq_len_; }
  int64_t num_tokens() const { return file_.size(); }
  uint64_t seed() const { return seed_; }
  // floor((num_tokens - 1) / seq_len): one epoch = that many samples (each sample
  // predicts seq_len tokens, so an epoch covers the file's targets once on average).
  int64_t samples_per_epoch() const override;

  // Start token of training sample (step, pos):
  //   splitmix64(splitmix64(splitmix64(seed) ^ step) ^ pos) mod (num_tokens - seq_len)
  // (nanoGPT draws randint(len(data) - block_size)). Pure: no state, no RNG.
  int64_t window_start(int64_t step, int64_t pos) const;

  // Global-batch positions [first, first + count) of training step `step`: [count, seq_len].
  Batch train_batch(int64_t step, int64_t first, int64_t count) const override;

  // Validation windows: the file cut into samples_per_epoch() non-overlapping windows
  // (window w starts at w * seq_len). Batch k starts at window
  // floor(radical_inverse_2(k) * num_windows) and position p takes the window p after it
  // (mod num_windows): the same every evaluation, independent of seed, step and ranks,
  // and spread over the file (for k < 2^m the batch starts are evenly spaced). Windows
  // of different batches do not overlap while (batches x global batch) stays within
  // about half the windows.
  Batch val_batch(int64_t k, int64_t first, int64_t count) const override;
  int64_t val_window(int64_t k, int64_t pos) const;  // the window index behind val_batch

 private:
  Batch gather(const std::vector<int64_t>& starts) const;  // x = tokens[s, s+T), y = [s+1, s+T+1)

  TokenFile file_;
  int64_t seq_len_;
  uint64_t seed_;
};

}  // namespace nnstrain::data
