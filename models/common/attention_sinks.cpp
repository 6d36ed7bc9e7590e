#include "models/common/attention_sinks.h"

#include <cmath>
#include <limits>

namespace nnstrain::models::common {

AttentionSinksImpl::AttentionSinksImpl(const ShardingContext& ctx, int64_t heads, int64_t unit, InitRule init) {
  layouts_.push_back(column_layout("weight", ctx, {heads}, {heads}, unit, init));
  for (auto& l : layouts_) add_param(l, ctx.options), l.owner = this;
  rebind();
}

void AttentionSinksImpl::rebind() { weight = parameters_["weight"]; }

torch::Tensor sink_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& sinks, int64_t past, int64_t window, std::optional<double> scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), S = k.size(2);
  TORCH_CHECK(k.size(1) == H && sinks.numel() == H, "sink_attention: ", H, " query heads, ", k.size(1),
              " key heads, ", sinks.numel(), " sinks");
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto scores = torch::matmul(q, k.transpose(2, 3)) * s;
  // Query i (position past + i) sees keys past + i - window + 1 .. past + i.
  auto keep = torch::ones({T, S}, q.options().dtype(torch::kBool)).tril(past);
  if (window > 0) keep = keep.triu(past - window + 1);
  scores = scores.masked_fill(keep.logical_not(), -std::numeric_limits<float>::infinity());
  const auto sink = sinks.to(scores.dtype()).reshape({1, H, 1, 1}).expand({B, H, T, 1});
  auto logits = torch::cat({scores, sink}, -1);
  // transformers subtracts the row maximum first (bf16 / fp16 overflow); the softmax is the same.
  logits = logits - std::get<0>(logits.max(-1, true)).detach();
  const auto probs = torch::softmax(logits, -1).narrow(-1, 0, S);  // the sink's share dropped
  return torch::matmul(probs.to(v.dtype()), v);
}

}  // namespace nnstrain::models::common
