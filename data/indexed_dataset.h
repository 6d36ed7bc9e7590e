// dataset.type: indexed. Megatron indexed datasets (.bin/.idx + manifest),
// blended, packed into seq_len + 1 token samples (data/indexed/sample_stream.h),
// as batches: prompt tokens' targets -100 under mask_prompt; per-token positions
// and document numbers under document_mask. Training sample (step, pos) is
// global sample step * global_batch + pos of the seeded stream; validation uses
// a stream of its own with seed 0 (docs/data.md).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/config/trainer_args.h"
#include "data/dataset.h"
#include "data/indexed/sample_stream.h"

namespace nnstrain::data {

class IndexedDataset : public Dataset {
 public:
  // Reads the manifests (checked at config load) and the indexes; `key` names
  // the config entry in errors ("dataset.train_args").
  IndexedDataset(const config::IndexedArgs& args, uint64_t seed, int64_t global_batch, const std::string& key);

  int64_t seq_len() const override { return stream_->seq_len(); }
  int64_t samples_per_epoch() const override { return stream_->samples_per_epoch(); }
  Batch train_batch(int64_t step, int64_t first, int64_t count) const override;
  // Batch k, position p: sample (floor(radical_inverse_2(k) * N) + p) mod N of the
  // validation stream, N = samples_per_epoch() (as token_bin's windows).
  Batch val_batch(int64_t k, int64_t first, int64_t count) const override;
  // Global samples [first, first + count) of the stream.
  Batch samples(int64_t first, int64_t count) const;

  // Before training: every dataset's tokenizer vocabulary and token ids fit the
  // model's (one scan of each .bin). ConfigError (exit 2) naming key.datasets[i].path.
  void check_vocab(int64_t model_vocab) const;
  const indexed::SampleStream& stream() const { return *stream_; }

 private:
  config::IndexedArgs args_;
  std::string key_;
  int64_t global_batch_;
  std::vector<indexed::Manifest> manifests_;
  std::vector<indexed::Reader> readers_;
  std::unique_ptr<indexed::SampleStream> stream_;
};

}  // namespace nnstrain::data
