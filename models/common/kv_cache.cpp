#include "models/common/kv_cache.h"

#include <torch/torch.h>

namespace nnstrain::models::common {

std::pair<at::Tensor, at::Tensor> KvCache::append(size_t layer, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = k.size(2);
  TORCH_CHECK(length_ + T <= capacity_, "KV cache: ", length_, " + ", T, " tokens exceed its capacity ", capacity_);
  if (k_.size() <= layer) k_.resize(layer + 1), v_.resize(layer + 1);
  auto& K = k_[layer];
  auto& V = v_[layer];
  if (!K.defined() || K.size(0) != k.size(0) || K.size(1) != k.size(1) || K.size(3) != k.size(3) ||
      K.scalar_type() != k.scalar_type() || K.device() != k.device()) {
    K = torch::empty({k.size(0), k.size(1), capacity_, k.size(3)}, k.options());
    V = torch::empty({v.size(0), v.size(1), capacity_, v.size(3)}, v.options());
  }
  K.narrow(2, length_, T).copy_(k);
  V.narrow(2, length_, T).copy_(v);
  return {K.narrow(2, 0, length_ + T), V.narrow(2, 0, length_ + T)};
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                            int64_t window, std::optional<double> scale) {
  const int64_t T = q.size(2), S = k.size(2);
  if (window > 0 && window < S) {  // a band: the diagonal moved right by `past`, window keys wide
    const auto band = torch::ones({T, S}, q.options().dtype(torch::kBool)).tril(past).triu(past - window + 1);
    return at::scaled_dot_product_attention(q, k, v, band, 0.0, /*is_causal=*/false, scale);
  }
  if (past == 0) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale);
  if (T == 1) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/false, scale);
  // SDPA's is_causal aligns the mask top-left (query i sees keys <= i); with a
  // past the diagonal moves right by `past`.
  const auto mask = torch::ones({T, S}, q.options().dtype(torch::kBool)).tril(past);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/false, scale);
}

}  // namespace nnstrain::models::common
