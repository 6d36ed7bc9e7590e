#include "models/common/layers.h"

#include "models/common/lm_loss.h"

namespace nnstrain::models::common {

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) {
  weight = register_parameter("weight", torch::empty({out, in}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out}));
  torch::nn::init::normal_(weight, 0.0, 0.02);
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (override_forward) return override_forward(x, weight, bias);
  return torch::nn::functional::linear(x, weight, bias);
}

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim) {
  weight = register_parameter("weight", torch::empty({num, dim}));
  torch::nn::init::normal_(weight, 0.0, 0.02);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& idx) {
  if (override_forward) return override_forward(idx, weight);
  return torch::embedding(weight, idx);
}

LayerNormImpl::LayerNormImpl(int64_t dim, bool with_bias, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {weight.size(0)}, weight, bias, eps);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // Normalise in fp32 as Hugging Face's LlamaRMSNorm does, then cast back.
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), targets);
}

torch::Tensor LmHead::logits(const torch::Tensor& hidden, const torch::Tensor& weight) const {
  if (override_logits) return override_logits(hidden, weight);
  return torch::nn::functional::linear(hidden, weight);
}

torch::Tensor LmHead::loss(const torch::Tensor& hidden, const torch::Tensor& weight,
                           const torch::Tensor& targets, int64_t chunk_size) const {
  if (override_loss) return override_loss(hidden, weight, targets);
  auto h = hidden.reshape({-1, hidden.size(-1)});
  auto t = targets.reshape({-1});
  if (chunk_size > 0) return chunked_linear_cross_entropy(h, weight, t, chunk_size);
  return cross_entropy(torch::nn::functional::linear(h, weight), t);
}

}  // namespace nnstrain::models::common
