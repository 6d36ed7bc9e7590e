// Multi-head latent attention (DeepSeek-V2/V3's MLA), an attention kind a
// decoder declares in place of grouped-query attention (models/llama's layer
// takes it where its config sets LlamaConfig::latent). Names and arithmetic are
// transformers' DeepseekV3Attention:
//   q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   (q_lora_rank 0: q_proj(x))
//            per head [qk_nope_head_dim | qk_rope_head_dim]
//   c, k_r = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
//   k, v   = per head [k_nope | k_r], v  from kv_b_proj(kv_a_layernorm(c))
// The rope part k_r is one head shared by all (rotated once); rope_interleave
// takes the rotary dimensions as DeepSeek's interleaved pairs. After the
// projections q, k, v are ordinary heads (k and q of qk_head_dim, v of
// v_head_dim), so causal, document-masked and context-parallel attention take
// them (the last two with v padded to one head width, which changes nothing).
//
// Tensor parallelism: heads split (q_b_proj / q_proj and kv_b_proj by whole
// heads, o_proj by v heads); the low-rank a-projections and their norms are
// replicated. Without sequence parallelism every rank holds every token, and
// k_r's gradient (each rank's heads' share) is summed by copy_to_tp. Under
// sequence parallelism the a-projections run on this rank's tokens (their
// weights' gradients summed over the group, as a sequence-parallel norm's),
// the b-projections gather the compressed latents, and k_r is gathered itself.
//
// Generation caches the compression, not the heads: per layer c (normed,
// kv_lora_rank) and the rotated k_r, one head each, expanded by kv_b_proj on
// every read (transformers' cache holds the same two tensors).
#pragma once

#include <torch/torch.h>

#include <optional>

#include "models/common/kv_cache.h"
#include "models/common/layers.h"
#include "models/common/sharding.h"

namespace nnstrain::models::common {

struct LatentAttentionOptions {
  int64_t hidden_size = 0, num_heads = 0;
  int64_t q_lora_rank = 0;  // 0: one q_proj (transformers' null)
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool attention_bias = false;  // on q_a_proj, kv_a_proj_with_mqa and o_proj (as transformers)
  bool rope_interleave = true;
  double rms_norm_eps = 1e-6, initializer_range = 0.02;
  double scale = 0;  // of the scores; 0: qk_head_dim^-0.5
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// transformers' softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2
// where a scaled rope sets mscale_all_dim (yarn_get_mscale: 0.1 m ln(factor) + 1, 1 at factor <= 1).
double latent_attention_scale(int64_t qk_head_dim, const std::string& rope_type, double factor, double mscale_all_dim);

// The K/V cache of one layer per token, in elements (c and k_r), for the planner.
inline int64_t latent_cache_width(const LatentAttentionOptions& o) { return o.kv_lora_rank + o.qk_rope_head_dim; }

class LatentAttentionImpl : public torch::nn::Module {
 public:
  LatentAttentionImpl(const LatentAttentionOptions& o, const ShardingContext& ctx = {});
  // cos/sin: the rotary tables of qk_rope_head_dim ([T, d] or per token [B, 1, T, d]); mask as
  // Llama's attention takes it (undefined: causal; [B, T]: document segments; else a dense mask).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  // Generation: the new tokens over block `layer` of the cache (which holds c and k_r).
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               KvCache& cache, size_t layer);

  ColumnParallelLinear q_proj{nullptr}, q_b_proj{nullptr}, kv_b_proj{nullptr};
  Linear q_a_proj{nullptr}, kv_a_proj_with_mqa{nullptr};
  RMSNorm q_a_layernorm{nullptr}, kv_a_layernorm{nullptr};
  RowParallelLinear o_proj{nullptr};

 private:
  torch::Tensor queries(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  // (normed c, rotated k_r), both [B, 1, T, width], over this rank's tokens (gathered where needed).
  std::pair<torch::Tensor, torch::Tensor> latents(const torch::Tensor& x, const torch::Tensor& cos,
                                                  const torch::Tensor& sin);
  std::pair<torch::Tensor, torch::Tensor> expand(const torch::Tensor& c, const torch::Tensor& k_rot);
  torch::Tensor a_proj(Linear& l, const torch::Tensor& x);  // replicated, gradients summed under sp
  torch::Tensor rope(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin) const;
  torch::Tensor out(const torch::Tensor& y);  // [B, heads, T, v] -> o_proj

  LatentAttentionOptions o_;
  ShardingContext ctx_;
  int64_t heads_;  // this rank's
};
TORCH_MODULE(LatentAttention);

}  // namespace nnstrain::models::common
