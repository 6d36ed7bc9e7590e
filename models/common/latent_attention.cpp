#include "models/common/latent_attention.h"

#include <cmath>

#include "models/common/context_attention.h"
#include "models/common/kernels/kernels.h"
#include "models/common/tp_ops.h"

namespace nnstrain::models::common {

double latent_attention_scale(int64_t qk_head_dim, const std::string& rope_type, double factor, double mscale_all_dim) {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim));
  if (rope_type != "default" && mscale_all_dim != 0 && factor > 1) {
    const double m = 0.1 * mscale_all_dim * std::log(factor) + 1.0;
    s *= m * m;
  }
  return s;
}

LatentAttentionImpl::LatentAttentionImpl(const LatentAttentionOptions& o, const ShardingContext& ctx)
    : o_(o), ctx_(ctx), heads_(ctx.local(o.num_heads, "num_attention_heads")) {
  const auto init = InitRule::normal(o.initializer_range);
  const int64_t C = o.hidden_size, H = o.num_heads, qk = o.qk_head_dim(), kv = o.qk_nope_head_dim + o.v_head_dim;
  if (o.q_lora_rank > 0) {
    q_a_proj = register_module("q_a_proj", Linear(C, o.q_lora_rank, o.attention_bias, init, ctx.options));
    q_a_layernorm = register_module("q_a_layernorm", RMSNorm(o.q_lora_rank, o.rms_norm_eps, ctx));
    q_b_proj = register_module("q_b_proj", ColumnParallelLinear(ctx, o.q_lora_rank, std::vector<int64_t>{H * qk}, qk,
                                                                false, init));
  } else {
    q_proj = register_module("q_proj", ColumnParallelLinear(ctx, C, std::vector<int64_t>{H * qk}, qk, false, init));
  }
  kv_a_proj_with_mqa = register_module(
      "kv_a_proj_with_mqa", Linear(C, o.kv_lora_rank + o.qk_rope_head_dim, o.attention_bias, init, ctx.options));
  kv_a_layernorm = register_module("kv_a_layernorm", RMSNorm(o.kv_lora_rank, o.rms_norm_eps, ctx));
  kv_b_proj = register_module("kv_b_proj", ColumnParallelLinear(ctx, o.kv_lora_rank, std::vector<int64_t>{H * kv}, kv,
                                                                false, init));
  o_proj = register_module("o_proj", RowParallelLinear(ctx, H * o.v_head_dim, C, o.v_head_dim, o.attention_bias, init));
}

torch::Tensor LatentAttentionImpl::a_proj(Linear& l, const torch::Tensor& x) {
  if (!ctx_.sp()) return l(x);  // the layer's own forward (its adapter, the zero-bubble split)
  // Under sequence parallelism each rank projects its own tokens with the same weights.
  TORCH_CHECK(!l->adapter, "latent attention: an adapter on a low-rank a-projection under sequence parallelism "
              "is not supported; set compute_config.sequence_parallel: false");
  auto [w, b] = sum_grads_over_tp(l->weight, l->bias, ctx_.comm);
  return torch::nn::functional::linear(x, w, b);
}

torch::Tensor LatentAttentionImpl::rope(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin) const {
  // Interleaved pairs (x0, x1), (x2, x3), ... are the halves [x0, x2, ..] and [x1, x3, ..] rotated by
  // halves: transformers' apply_rotary_pos_emb_interleave, whose output is laid out the same way.
  const auto h = o_.rope_interleave ? torch::cat({t.slice(-1, 0, c10::nullopt, 2), t.slice(-1, 1, c10::nullopt, 2)}, -1)
                                    : t;
  return kernels::rotary(h, cos, sin);
}

torch::Tensor LatentAttentionImpl::queries(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto q = q_proj ? q_proj(x) : q_b_proj(q_a_layernorm(a_proj(q_a_proj, x)));  // all T tokens, this rank's heads
  const auto B = q.size(0), T = q.size(1);
  q = q.view({B, T, heads_, o_.qk_head_dim()}).transpose(1, 2);
  const auto nope = q.narrow(-1, 0, o_.qk_nope_head_dim);
  return torch::cat({nope, rope(q.narrow(-1, o_.qk_nope_head_dim, o_.qk_rope_head_dim), cos, sin)}, -1);
}

std::pair<torch::Tensor, torch::Tensor> LatentAttentionImpl::latents(const torch::Tensor& x, const torch::Tensor& cos,
                                                                     const torch::Tensor& sin) {
  const auto ckv = a_proj(kv_a_proj_with_mqa, x);
  const auto c = kv_a_layernorm(ckv.narrow(-1, 0, o_.kv_lora_rank));
  auto k_rot = ckv.narrow(-1, o_.kv_lora_rank, o_.qk_rope_head_dim);
  // Every rank's heads use all of k_r: its gradient is their sum.
  if (ctx_.sp())
    k_rot = gather_from_seq(k_rot.contiguous(), ctx_.tp, ctx_.comm);
  else if (ctx_.parallel())
    k_rot = copy_to_tp(k_rot, ctx_.comm);
  const auto B = k_rot.size(0), T = k_rot.size(1);
  k_rot = rope(k_rot.view({B, 1, T, o_.qk_rope_head_dim}), cos, sin);
  return {c.unsqueeze(1), k_rot};
}

std::pair<torch::Tensor, torch::Tensor> LatentAttentionImpl::expand(const torch::Tensor& c, const torch::Tensor& k_rot) {
  auto kv = kv_b_proj(c.squeeze(1));  // gathers c's tokens under sequence parallelism
  const auto B = kv.size(0), T = kv.size(1);
  kv = kv.view({B, T, heads_, o_.qk_nope_head_dim + o_.v_head_dim}).transpose(1, 2);
  const auto k = torch::cat({kv.narrow(-1, 0, o_.qk_nope_head_dim),
                             k_rot.expand({B, heads_, T, o_.qk_rope_head_dim})}, -1);
  return {k, kv.narrow(-1, o_.qk_nope_head_dim, o_.v_head_dim)};
}

torch::Tensor LatentAttentionImpl::out(const torch::Tensor& y) {
  const auto B = y.size(0), T = y.size(2);
  return o_proj(y.transpose(1, 2).reshape({B, T, heads_ * o_.v_head_dim}));
}

torch::Tensor LatentAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                           const torch::Tensor& mask) {
  const auto q = queries(x, cos, sin);
  const auto [c, k_rot] = latents(x, cos, sin);
  auto [k, v] = expand(c, k_rot);
  const double scale = o_.scale > 0 ? o_.scale : 1.0 / std::sqrt(static_cast<double>(o_.qk_head_dim()));
  const bool by_tiles = mask.defined() && mask.dim() == 2;
  if (ctx_.cp_comm || by_tiles) {
    // These kernels take one head width: v padded with zeros to q's (its extra outputs are zero, then cut).
    const int64_t d = o_.qk_head_dim(), dv = o_.v_head_dim;
    TORCH_CHECK(dv <= d, "latent attention: v_head_dim ", dv, " over qk_head_dim ", d,
                " under context parallelism or packed documents");
    const auto vp = dv < d ? torch::constant_pad_nd(v, {0, d - dv}) : v;
    torch::Tensor y;
    if (ctx_.cp_comm) {
      CpAttentionOptions co;
      co.comm_type = ctx_.cp_comm_type;
      co.layout = ctx_.cp_layout;
      co.scale = scale;
      if (by_tiles) co.segments = mask;
      y = context_parallel_attention(q, k, vp, /*causal=*/true, ctx_.cp_comm, co);
    } else {
      y = document_attention(q, k, vp, mask, scale);
    }
    return out(y.narrow(-1, 0, dv));
  }
  const auto m = mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt;
  return out(at::scaled_dot_product_attention(q, k, v, m, 0.0, /*is_causal=*/!mask.defined(), scale));
}

torch::Tensor LatentAttentionImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos,
                                                  const torch::Tensor& sin, KvCache& cache, size_t layer) {
  const auto q = queries(x, cos, sin);
  const auto past = cache.length();
  const auto [c, k_rot] = latents(x, cos, sin);
  const auto [C, K_rot] = cache.append(layer, c, k_rot);  // the compression of every token so far
  const auto [k, v] = expand(C, K_rot);
  const double scale = o_.scale > 0 ? o_.scale : 1.0 / std::sqrt(static_cast<double>(o_.qk_head_dim()));
  return out(cached_attention(q, k, v, past, 0, scale));
}

}  // namespace nnstrain::models::common
