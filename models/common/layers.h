// Building blocks shared by the models. Each layer that tensor parallelism may
// split carries an optional `override_forward` that trainer/parallel installs;
// the model itself computes local sizes from its (possibly sharded) weights and
// never asks how it is split.
#pragma once

#include <torch/torch.h>

#include <functional>

namespace nnstrain::models::common {

// y = x W^T + b, with W [out, in].
class LinearImpl : public torch::nn::Module {
 public:
  using Forward = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& weight,
                                              const torch::Tensor& bias)>;
  LinearImpl(int64_t in, int64_t out, bool bias);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;  // bias undefined when disabled
  Forward override_forward;    // set by trainer/parallel (e.g. row-parallel all-reduce)
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Module {
 public:
  using Forward = std::function<torch::Tensor(const torch::Tensor& idx, const torch::Tensor& weight)>;
  EmbeddingImpl(int64_t num, int64_t dim);
  torch::Tensor forward(const torch::Tensor& idx);
  torch::Tensor weight;
  Forward override_forward;    // vocab-parallel lookup
};
TORCH_MODULE(Embedding);

// LayerNorm with an optional bias (nanoGPT's `bias` option; LibTorch's has both or neither).
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, bool bias, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
  double eps;
};
TORCH_MODULE(LayerNorm);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// The LM head and next-token loss. `weight` is [vocab, dim] (tied to the token
// embedding or its own). The trainer's parallel layer may override the loss with
// a vocab-parallel cross-entropy that never gathers the full logits.
struct LmHead {
  using LossForward = std::function<torch::Tensor(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                  const torch::Tensor& targets)>;
  using LogitsForward = std::function<torch::Tensor(const torch::Tensor& hidden, const torch::Tensor& weight)>;
  LossForward override_loss;
  LogitsForward override_logits;
  // Mean cross-entropy of hidden [B, T, C] against targets [B, T]; chunk_size > 0
  // computes it over token chunks, recomputing logits in backward.
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& weight,
                     const torch::Tensor& targets, int64_t chunk_size = 0) const;
  torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& weight) const;
};

// Plain next-token cross-entropy: logits [N, V] float, targets [N]. Mean over N.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace nnstrain::models::common
