// Incremental decoding: the keys and values every block has computed for the
// tokens seen so far, so that each new token costs one position's work instead
// of the whole context's (CausalLM::decode_logits, models/generate.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace nnstrain::models::common {

class KvCache {
 public:
  // `capacity`: the most tokens it will hold (at most the model's max_seq_len()).
  explicit KvCache(int64_t capacity) : capacity_(capacity) {}

  int64_t length() const { return length_; }  // tokens cached (the next token's position)
  int64_t capacity() const { return capacity_; }
  void reset() { length_ = 0; }  // storage is kept and overwritten

  // Block `layer`'s keys and values of the new tokens, [B, heads, T, head_dim],
  // written at positions length()..length()+T; returns all of them so far
  // ([B, heads, length()+T, head_dim], views of the cache). length() moves only
  // with advance(), once every block has appended.
  std::pair<at::Tensor, at::Tensor> append(size_t layer, const at::Tensor& k, const at::Tensor& v);
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  int64_t capacity_, length_ = 0;
  std::vector<at::Tensor> k_, v_;  // per block, [B, heads, capacity, head_dim], allocated on first use
};

// Causal attention of new queries q [B, H, T, D] (positions past..past+T-1)
// against cached keys/values k, v [B, H, past+T, D]: query i sees keys up to
// past + i. Without a past this is plain causal attention; one new token sees all.
// `window` > 0: query i sees only keys past + i - window + 1 .. past + i (sliding window).
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                            int64_t window = 0, std::optional<double> scale = std::nullopt);

}  // namespace nnstrain::models::common
