// What the trainer reads batches from: token_bin's flat token files
// (token_bin.h) or Megatron indexed datasets (indexed_dataset.h). Both keep the
// data-stream contract of docs/data.md: training sample (step, pos) is a fixed
// function of (seed, step, pos) and the config, so any rank computes any sample.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace nnstrain::data {

// A target not counted in the loss (prompt tokens, padding): PyTorch's ignore_index.
constexpr int64_t kIgnoreTarget = -100;

struct Batch {
  at::Tensor x, y;  // [B, T] int64; y[b, t] = token after x[b, t], or -100 (not counted in the loss)
  // Document masking only (else undefined), [B, T] int64: each token's position
  // within its document and its document's number within the sample.
  at::Tensor positions, segments;
  // Preference batches only (dataset.type preference, docs/alignment.md), [P]
  // int64: the pairs' indices in the dataset; rows [0, P) of x and y are their
  // chosen completions, rows [P, 2P) their rejected ones, in the same order.
  at::Tensor pair_index;
  int64_t pairs() const { return pair_index.defined() ? pair_index.size(0) : 0; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t seq_len() const = 0;
  // Samples in one epoch (max_epochs counts these in whole global batches).
  virtual int64_t samples_per_epoch() const = 0;
  // Global-batch positions [first, first + count) of training step `step`.
  virtual Batch train_batch(int64_t step, int64_t first, int64_t count) const = 0;
  // Validation batch k: the same at every evaluation, independent of seed, step and ranks.
  virtual Batch val_batch(int64_t k, int64_t first, int64_t count) const = 0;
};

}  // namespace nnstrain::data
