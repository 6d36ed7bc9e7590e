// Attention sinks (GPT-OSS): a learned logit per query head that joins every
// query's softmax denominator and has no value, so a head can attend "nowhere":
//   p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))
// An attention option a decoder declares (models/llama's Attention holds one
// where LlamaConfig::attention_sinks is set). The parameter is [heads], split
// over tensor-parallel ranks as the query heads are (whole groups of a KV head).
//
// Kernel rule: neither flash nor cuDNN (scaled_dot_product_attention's fused
// kernels) takes a sink logit, on CUDA or elsewhere, so sink attention always
// runs the math form below (scores materialised, [B, H, T, keys]), in the order
// transformers' eager_attention_forward computes it; it never dispatches to a
// fused kernel that would drop the sink. Context parallelism (ring attention
// merges per-block softmaxes without a sink) and packed-document masks are
// refused by the caller, naming the key.
#pragma once

#include <torch/torch.h>

#include <optional>

#include "models/common/layers.h"

namespace nnstrain::models::common {

class AttentionSinksImpl : public ShardedModule {
 public:
  // `heads`: the query heads (global); `unit`: the heads split together (a KV head's group).
  AttentionSinksImpl(const ShardingContext& ctx, int64_t heads, int64_t unit, InitRule init);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight;  // [this rank's heads]

 private:
  void rebind() override;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(AttentionSinks);

// Causal attention of q [B, H, T, D] (positions past..past+T-1) over k, v
// [B, H, past+T, D] (KV heads already repeated to H) with per-head sinks [H];
// `window` > 0: each query sees itself and the window - 1 keys before it.
torch::Tensor sink_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& sinks, int64_t past = 0, int64_t window = 0,
                             std::optional<double> scale = std::nullopt);

}  // namespace nnstrain::models::common
