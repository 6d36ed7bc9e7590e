#include "models/llama/llama.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "models/common/context_attention.h"
#include "models/common/kernels/kernels.h"
#include "models/common/kv_cache.h"


namespace F = torch::nn::functional;

namespace nnstrain::models::llama {

LlamaConfig LlamaConfig::resolved() const {
  LlamaConfig c = *this;
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.head_dim == 0) c.head_dim = c.hidden_size / c.num_attention_heads;
  return c;
}

// transformers' own op sequence (models/common/rope.h), so the frequencies match it bit for bit in fp32.
torch::Tensor rope_inv_freq(const LlamaConfig& cfg) {
  const auto c = cfg.resolved();
  return common::rope_frequencies(c.rope_scaling, c.rope_theta, c.rotary_dim(), c.max_position_embeddings).inv_freq;
}

namespace {

// scaled_dot_product_attention's optional mask: none for an undefined tensor.
std::optional<torch::Tensor> attn_mask(const torch::Tensor& mask) {
  return mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt;
}

// Hugging Face's pairing (the two halves of head_dim), in at least fp32 (as
// Meta's reference does), whatever dtype q/k arrive in. t is a view of its
// projection's output, which nothing else keeps: rotated in place where the
// kernel does so (models/common/kernels).
// cos/sin narrower than the head (phi3's partial_rotary_factor): its leading
// dimensions rotate, the rest pass, as transformers' apply_rotary_pos_emb.
torch::Tensor apply_rope(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto rot = cos.size(-1), dim = t.size(-1);
  if (rot == dim) return common::kernels::rotary_(t, cos, sin);
  return torch::cat({common::kernels::rotary_(t.narrow(-1, 0, rot).contiguous(), cos, sin), t.narrow(-1, rot, dim - rot)},
                    -1);
}

// Qwen3's per-head RMSNorm of queries or keys [B, heads, T, head_dim] (none: t).
torch::Tensor qk(common::RMSNorm& norm, const torch::Tensor& t) { return norm ? norm(t) : t; }


}  // namespace

AttentionImpl::AttentionImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx, int64_t layer)
    : head_dim(cfg.head_dim),
      window(cfg.window(layer)),
      kv_heads(ctx.local(cfg.num_key_value_heads, "num_key_value_heads")),
      cp_comm(ctx.cp_comm),
      cp_comm_type(ctx.cp_comm_type),
      cp_layout(ctx.cp_layout) {
  // The query heads of one key/value head stay together: Q and the output
  // projection split in units of a whole group, on the same ranks as K and V.
  const int64_t group = cfg.num_attention_heads / cfg.num_key_value_heads;
  heads = kv_heads * group;
  const int64_t C = cfg.hidden_size, q = cfg.num_attention_heads * head_dim, kv = cfg.num_key_value_heads * head_dim;
  const auto init = common::InitRule::normal(cfg.initializer_range);
  const bool b = cfg.attention_bias || cfg.qkv_bias;
  q_proj = register_module("q_proj",
                           common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{q}, group * head_dim, b, init));
  k_proj = register_module("k_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{kv}, head_dim, b, init));
  v_proj = register_module("v_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{kv}, head_dim, b, init));
  o_proj = register_module("o_proj",
                           common::RowParallelLinear(ctx, q, C, group * head_dim, cfg.attention_bias, init));
  if (cfg.qk_norm) {
    // Each tensor-parallel rank normalises only its heads, so the (replicated)
    // weights' gradients are partial: summed over the group, as a sequence-parallel norm's.
    auto heads_ctx = ctx;
    heads_ctx.sequence_parallel = true;
    q_norm = register_module("q_norm", common::RMSNorm(head_dim, cfg.rms_norm_eps, heads_ctx, cfg.norm_unit_offset));
    k_norm = register_module("k_norm", common::RMSNorm(head_dim, cfg.rms_norm_eps, heads_ctx, cfg.norm_unit_offset));
  }
  if (cfg.query_pre_attn_scalar > 0) scale = 1.0 / std::sqrt(cfg.query_pre_attn_scalar);
  if (cfg.attention_sinks) {
    if (ctx.cp_comm)  // the loader refuses it first, naming the key
      throw std::invalid_argument("model.args.attention_sinks: context parallelism has no attention sinks");
    sinks = register_module("sinks", common::AttentionSinks(ctx, cfg.num_attention_heads, group, init));
  }

}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& mask) {
  auto q = q_proj(x), k = k_proj(x), v = v_proj(x);  // all T tokens under sequence parallelism too
  const auto B = q.size(0), T = q.size(1);
  auto split = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
  q = apply_rope(qk(q_norm, split(q, heads)), cos, sin);
  k = apply_rope(qk(k_norm, split(k, kv_heads)), cos, sin);
  v = split(v, kv_heads);
  // mask [B, T] (Documents::attention_input): segments, masked by tiles.
  const bool by_tiles = mask.defined() && mask.dim() == 2;
  if (cp_comm) {  // this rank's tokens of a sequence split over cp ranks; GQA taken as it is
    common::CpAttentionOptions o;
    o.comm_type = cp_comm_type;
    o.layout = cp_layout;
    o.scale = scale;
    if (by_tiles) o.segments = mask;
    if (window > 0 && window < T * cp_comm->size()) o.window = window;  // the masked tiles, windowed
    auto y = common::context_parallel_attention(q, k, v, /*causal=*/true, cp_comm, o);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  TORCH_CHECK(window == 0 || !mask.defined(),
              "model.args.sliding_window: packed documents (dataset document_mask) have no sliding-window attention");
  TORCH_CHECK(!sinks || !mask.defined(),
              "model.args.attention_sinks: packed documents (dataset document_mask) have no sink attention");
  if (sinks) {  // the math form on every device (attention_sinks.h: no fused kernel takes a sink)
    if (heads != kv_heads) k = k.repeat_interleave(heads / kv_heads, 1), v = v.repeat_interleave(heads / kv_heads, 1);
    auto y = common::sink_attention(q, k, v, sinks->weight, 0, window, scale);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  if (by_tiles) {
    auto y = common::document_attention(q, k, v, mask, scale);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  // GQA: flash attention on CUDA takes the KV heads as they are; elsewhere
  // enable_gqa would fall back to the math kernel, so repeat them (as HF's repeat_kv).
  bool native_gqa = false;
  if (heads != kv_heads) {
    native_gqa = q.is_cuda() && (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16);
    if (!native_gqa) {
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
  }
  if (window > 0 && window < T) {  // each query sees itself and the window - 1 before it (transformers' overlay)
    const auto band = torch::ones({T, T}, q.options().dtype(torch::kBool)).tril().triu(1 - window);
    auto y = at::scaled_dot_product_attention(q, k, v, band, 0.0, false, scale, native_gqa);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  auto y = at::scaled_dot_product_attention(q, k, v, attn_mask(mask), /*dropout_p=*/0.0,
                                            /*is_causal=*/!mask.defined(), scale, native_gqa);
  return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

torch::Tensor AttentionImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                            common::KvCache& cache, size_t layer) {
  auto q = q_proj(x), k = k_proj(x), v = v_proj(x);
  const auto B = q.size(0), T = q.size(1);
  auto split = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
  q = apply_rope(qk(q_norm, split(q, heads)), cos, sin);
  const auto past = cache.length();
  // The cache keeps the KV heads unrepeated; the query groups share them here.
  auto [K, V] = cache.append(layer, apply_rope(qk(k_norm, split(k, kv_heads)), cos, sin), split(v, kv_heads));
  if (heads != kv_heads) {
    K = K.repeat_interleave(heads / kv_heads, 1);
    V = V.repeat_interleave(heads / kv_heads, 1);
  }
  const auto y = sinks ? common::sink_attention(q, K, V, sinks->weight, past, window, scale)
                       : common::cached_attention(q, K, V, past, window, scale);
  return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

MlpImpl::MlpImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx) {
  const int64_t C = cfg.hidden_size, I = cfg.intermediate_size;
  const auto init = common::InitRule::normal(cfg.initializer_range);
  gate_proj = register_module("gate_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{I}, 1, cfg.mlp_bias, init));
  up_proj = register_module("up_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{I}, 1, cfg.mlp_bias, init));
  down_proj = register_module("down_proj", common::RowParallelLinear(ctx, I, C, 1, cfg.mlp_bias, init));
  gelu = cfg.hidden_act == "gelu_pytorch_tanh";
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (gelu) return down_proj(F::gelu(gate_proj(x), F::GELUFuncOptions().approximate("tanh")) * up_proj(x));
  return down_proj(common::kernels::swiglu(gate_proj(x), up_proj(x)));
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx, int64_t index,
                                   std::shared_ptr<common::AuxLossScale> aux_scale) {
  if (cfg.latent)
    latent_attn = register_module("self_attn", common::LatentAttention(*cfg.latent, ctx));
  else
    self_attn = register_module("self_attn", Attention(cfg, ctx, index));
  if (cfg.sparse(index))
    moe = register_module(cfg.moe_module, common::Moe(*cfg.moe, ctx, "layers." + std::to_string(index) + "." +
                                                                          cfg.moe_module, std::move(aux_scale)));
  else
    mlp = register_module("mlp", Mlp(cfg, ctx));
  auto norm = [&](const char* name) {
    return register_module(name, common::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx, cfg.norm_unit_offset));
  };
  input_layernorm = norm("input_layernorm");
  post_attention_layernorm = norm("post_attention_layernorm");
  if (cfg.sandwich_norms) {
    pre_feedforward_layernorm = norm("pre_feedforward_layernorm");
    post_feedforward_layernorm = norm("post_feedforward_layernorm");
  }
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& mask) {
  if (pre_feedforward_layernorm) {  // Gemma: a norm on each branch's output too
    auto h = x + post_attention_layernorm(attention(input_layernorm(x), cos, sin, mask));
    return h + post_feedforward_layernorm(feed_forward(pre_feedforward_layernorm(h)));
  }
  auto h = x + attention(input_layernorm(x), cos, sin, mask);
  return h + feed_forward(post_attention_layernorm(h));
}

torch::Tensor DecoderLayerImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos,
                                               const torch::Tensor& sin, common::KvCache& cache, size_t layer) {
  if (pre_feedforward_layernorm) {
    auto h = x + post_attention_layernorm(attention_cached(input_layernorm(x), cos, sin, cache, layer));
    return h + post_feedforward_layernorm(feed_forward(pre_feedforward_layernorm(h)));
  }
  auto h = x + attention_cached(input_layernorm(x), cos, sin, cache, layer);
  return h + feed_forward(post_attention_layernorm(h));
}

// As transformers' LlamaPreTrainedModel: N(0, initializer_range) for every
// matrix (the layers' InitRule), zero biases, unit norm weights.
Llama::Llama(const LlamaConfig& cfg, const common::ShardingContext& ctx) : cfg_(cfg.resolved()) {
  const auto& c = cfg_;
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "llama: num_attention_heads ",
              c.num_attention_heads, " is not divisible by num_key_value_heads ", c.num_key_value_heads);
  TORCH_CHECK(c.rotary_dim() % 2 == 0 && c.rotary_dim() > 0, "llama: the rotary dimension ", c.rotary_dim(),
              " must be even and positive");
  const auto init = common::InitRule::normal(c.initializer_range);
  embed_tokens = register_module("embed_tokens", common::VocabParallelEmbedding(ctx, c.vocab_size, c.hidden_size, init));
  layers = register_module("layers", torch::nn::ModuleList());
  if (c.moe) aux_scale_ = std::make_shared<common::AuxLossScale>();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c, ctx, i, aux_scale_));
  norm = register_module("norm", common::RMSNorm(c.hidden_size, c.rms_norm_eps, ctx, c.norm_unit_offset));
  lm_head = common::ParallelLmHead(ctx, c.vocab_size, c.hidden_size, !c.tie_word_embeddings, init);
  lm_head->softcap = c.final_logit_softcapping;
  if (!c.tie_word_embeddings) register_module("lm_head", lm_head);
  TORCH_CHECK(c.layer_windows.empty() || int64_t(c.layer_windows.size()) == c.num_hidden_layers,
              "llama: ", c.layer_windows.size(), " layer windows for ", c.num_hidden_layers, " layers");
  const auto f = common::rope_frequencies(c.rope_scaling, c.rope_theta, c.rotary_dim(), c.max_position_embeddings);
  inv_freq_ = f.inv_freq;
  rope_scale_ = f.attention_scaling;
  if (c.rope_local_base_freq > 0)  // plain rope (transformers' sliding_attention default)
    local_inv_freq_ = common::rope_frequencies({}, c.rope_local_base_freq, c.rotary_dim(), c.max_position_embeddings).inv_freq;
  if (ctx.cp_comm) {
    cp_ = ctx.cp_comm->size();
    cp_rank_ = ctx.cp_comm->rank();
    cp_layout_ = ctx.cp_layout;
  }
}

const torch::Tensor& Llama::head_weight() const {
  return cfg_.tie_word_embeddings ? embed_tokens->weight : lm_head->weight;
}

void Llama::rope_for(int64_t seq_len) {
  // longrope's factors depend on the sequence (transformers: the largest position + 1 of the call).
  if (!common::rope_depends_on_length(cfg_.rope_scaling)) return;
  const auto f = common::rope_frequencies(cfg_.rope_scaling, cfg_.rope_theta, cfg_.rotary_dim(),
                                          cfg_.max_position_embeddings, seq_len);
  if (!torch::equal(f.inv_freq, inv_freq_)) cos_ = torch::Tensor();
  inv_freq_ = f.inv_freq;
}

std::pair<torch::Tensor, torch::Tensor> Llama::rotary(int64_t T, const torch::Device& device, bool local) {
  auto& cos = local ? local_cos_ : cos_;
  auto& sin = local ? local_sin_ : sin_;
  const double scale = local ? 1.0 : rope_scale_;
  if (!cos.defined() || cos.size(0) != T || cos.device() != device) {
    torch::NoGradGuard no_grad;
    // transformers: freqs = position * inv_freq, emb = cat(freqs, freqs), in fp32.
    // Under context parallelism the tokens' global positions.
    const auto pos = cp_ > 1 ? torch::tensor(common::cp_position_ids(T * cp_, cp_, cp_rank_, cp_layout_), torch::kLong)
                             : torch::arange(T, torch::kLong);
    const auto freqs = pos.to(torch::kFloat).unsqueeze(-1) * (local ? local_inv_freq_ : inv_freq_);
    const auto emb = torch::cat({freqs, freqs}, -1);
    cos = (scale == 1.0 ? emb.cos() : emb.cos() * scale).to(device);
    sin = (scale == 1.0 ? emb.sin() : emb.sin() * scale).to(device);
  }
  return {cos, sin};
}

torch::Tensor Llama::scaled_embed(const torch::Tensor& idx) {
  auto x = embed_tokens(idx);
  if (!cfg_.embed_scale) return x;
  // transformers: a float32 sqrt(hidden_size) cast to the weight's dtype, then the product.
  const auto scale = torch::tensor(std::sqrt(static_cast<double>(cfg_.hidden_size)), torch::kFloat);
  return x * scale.to(x.options());
}

torch::Tensor Llama::embed(const torch::Tensor& idx, const Documents&) {
  const auto T = idx.size(1);
  TORCH_CHECK(T * cp_ <= cfg_.max_position_embeddings, "sequence of ", T * cp_, " tokens exceeds max_position_embeddings ",
              cfg_.max_position_embeddings);
  return scaled_embed(idx);
}

torch::Tensor Llama::blocks(const torch::Tensor& input, int64_t begin, int64_t end, int64_t seq_len,
                            const Documents& docs) {
  auto x = input;
  rope_for(seq_len * cp_);
  auto [cos, sin] = rotary(seq_len, x.device());
  torch::Tensor local_cos, local_sin;  // the sliding layers' (rope_local_base_freq)
  if (local_inv_freq_.defined()) std::tie(local_cos, local_sin) = rotary(seq_len, x.device(), /*local=*/true);
  torch::Tensor mask;
  if (docs.defined()) {
    // Packed documents: rotary angles of each token's position within its document, [B, 1, T, head_dim].
    torch::NoGradGuard no_grad;
    auto angles = [&](const torch::Tensor& inv_freq, double scale) {
      const auto freqs = docs.positions.to(torch::kFloat).unsqueeze(-1) * inv_freq.to(x.device());
      const auto emb = torch::cat({freqs, freqs}, -1).unsqueeze(1);
      return std::make_pair(emb.cos() * scale, emb.sin() * scale);
    };
    std::tie(cos, sin) = angles(inv_freq_, rope_scale_);
    if (local_inv_freq_.defined()) std::tie(local_cos, local_sin) = angles(local_inv_freq_, 1.0);
    mask = docs.attention_input(/*by_tiles=*/true);  // segments: common::document_attention picks the kernel
  }
  for (auto i = static_cast<size_t>(begin); i < static_cast<size_t>(end); ++i) {
    auto layer = layers->ptr<DecoderLayerImpl>(i);
    const bool local = cfg_.local_rope(static_cast<int64_t>(i));
    const auto& c = local ? local_cos : cos;
    const auto& s = local ? local_sin : sin;
    x = run_block(i, [layer, cos = c, sin = s, mask](const torch::Tensor& t) { return layer->forward(t, cos, sin, mask); },
                  x, nullptr);
  }
  return x;
}

torch::Tensor Llama::head_loss(const torch::Tensor& h, const torch::Tensor& targets) {
  // MoE balancing losses' gradients are scaled by the one this mean receives (models/common/moe.h).
  return common::record_loss_grad(
      lm_head->loss(norm(h), head_weight(), targets, runtime_.loss, runtime_.loss_chunk_size), aux_scale_);
}

std::vector<std::string> Llama::head_ties() const {
  return cfg_.tie_word_embeddings ? std::vector<std::string>{"embed_tokens.weight"} : std::vector<std::string>{};
}

torch::Tensor Llama::hidden(const torch::Tensor& idx, const Documents& docs) {
  return norm(blocks(embed(idx, docs), 0, cfg_.num_hidden_layers, idx.size(1), docs));
}

torch::Tensor Llama::loss(const torch::Tensor& idx, const torch::Tensor& targets) { return loss(idx, targets, {}); }

torch::Tensor Llama::loss(const torch::Tensor& idx, const torch::Tensor& targets, const Documents& docs) {
  return head_loss(blocks(embed(idx, docs), 0, cfg_.num_hidden_layers, idx.size(1), docs), targets);
}

torch::Tensor Llama::logits(const torch::Tensor& idx) { return lm_head->logits(hidden(idx), head_weight()); }

torch::Tensor Llama::head_logits(const torch::Tensor& h) { return lm_head->logits(norm(h), head_weight()); }

torch::Tensor Llama::decode_logits(const torch::Tensor& idx, common::KvCache& cache) {
  const auto past = cache.length(), T = idx.size(1);
  TORCH_CHECK(past + T <= cfg_.max_position_embeddings, "position ", past + T, " exceeds max_position_embeddings ",
              cfg_.max_position_embeddings);
  auto x = scaled_embed(idx);
  rope_for(past + T);  // transformers' choice per call: the positions it holds
  // The tables for the cache's whole span (kept by rotary() across steps), at the new positions.
  const auto [cos_all, sin_all] = rotary(cache.capacity(), x.device());
  const auto cos = cos_all.narrow(0, past, T), sin = sin_all.narrow(0, past, T);
  torch::Tensor local_cos, local_sin;
  if (local_inv_freq_.defined()) {
    const auto [lc, ls] = rotary(cache.capacity(), x.device(), /*local=*/true);
    local_cos = lc.narrow(0, past, T), local_sin = ls.narrow(0, past, T);
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    const bool local = cfg_.local_rope(static_cast<int64_t>(i));
    x = layers->ptr<DecoderLayerImpl>(i)->forward_cached(x, local ? local_cos : cos, local ? local_sin : sin, cache, i);
  }
  cache.advance(T);
  return lm_head->logits(norm(x), head_weight());
}

double Llama::flops_per_token(int64_t seq_len) const {
  const auto& c = cfg_;
  const double C = c.hidden_size, q = static_cast<double>(c.num_attention_heads) * c.head_dim,
               kv = static_cast<double>(c.num_key_value_heads) * c.head_dim;
  // Matmul parameters: q, k, v, o, gate, up, down per layer, and the LM head
  // (the embedding lookup does no matmul), 6 FLOPs each per token; plus attention.
  const double per_layer = C * q * 2 + C * kv * 2 + 3.0 * C * c.intermediate_size;
  const double n = c.num_hidden_layers * per_layer + static_cast<double>(c.vocab_size) * C;
  // 12 x width x T per layer for causal attention (the planner takes half off), windows counted.
  return 6 * n + 12.0 * q * c.attention_span(seq_len);
}

double LlamaConfig::attention_span(int64_t seq_len) const {
  // Twice the mean keys a query sees, so the planner's causal half is right for a sliding layer too.
  // Sink attention's math form (attention_sinks.h) computes the whole T x T square and masks it
  // afterwards, window or not: 2T, so that half is the whole square. (The sink itself is one more
  // logit per query and head, no matmul.)
  const double T = static_cast<double>(seq_len);
  if (attention_sinks) return 2 * T * num_hidden_layers;
  double span = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const double w = static_cast<double>(window(i));
    span += w > 0 && w < T ? 2 * w - w * (w - 1) / T : T;
  }
  return span;
}

ModelDims Llama::dims() const {
  ModelDims d{cfg_.hidden_size,         cfg_.num_hidden_layers, cfg_.num_attention_heads,
              cfg_.num_key_value_heads, cfg_.intermediate_size, cfg_.vocab_size,
              cfg_.max_position_embeddings, cfg_.tie_word_embeddings};
  d.materialised_scores = cfg_.attention_sinks;  // sink attention's math form
  return d;
}

std::vector<HfTensor> Llama::hf_tensors() const {
  const auto& c = cfg_;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  // Phi-3's checkpoints fuse q, k, v (in that order) and gate, up: our module -> (theirs, first row).
  const std::vector<std::tuple<std::string, std::string, int64_t>> fused = {
      {"self_attn.q_proj.weight", "self_attn.qkv_proj.weight", 0},
      {"self_attn.k_proj.weight", "self_attn.qkv_proj.weight", q},
      {"self_attn.v_proj.weight", "self_attn.qkv_proj.weight", q + kv},
      {"mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0},
      {"mlp.up_proj.weight", "mlp.gate_up_proj.weight", c.intermediate_size}};
  std::vector<HfTensor> t;
  for (const auto& p : named_parameters()) {
    const auto& ours = p.key();
    HfTensor h{ours, ours == "lm_head.weight" ? ours : "model." + ours, false};
    if (c.model_type == "phi3")
      for (const auto& [part, whole, offset] : fused) {
        const auto at = ours.size() - part.size();
        if (ours.size() > part.size() && ours.compare(at, part.size(), part) == 0 && ours[at - 1] == '.') {
          h.theirs = "model." + ours.substr(0, at) + whole;
          h.fused_offset = offset;
        }
      }
    t.push_back(h);
  }
  return t;
}

bool Llama::rebuild_cache(int64_t cached, int64_t length) const {
  // transformers' Phi3ForCausalLM.prepare_inputs_for_generation, whatever the rope kind.
  const auto orig = cfg_.original_max_position_embeddings;
  return cfg_.model_type == "phi3" && orig > 0 && length >= orig + 1 && cached <= orig;
}

namespace {

// Each layer's attention kind as transformers' layer_types names it.
std::vector<std::string> layer_kinds(const LlamaConfig& c) {
  std::vector<std::string> t;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool sliding = c.layer_types.empty()
                             ? c.use_sliding_window && c.sliding_window > 0 && i >= c.max_window_layers
                             : c.layer_types[i] == "sliding_attention";
    t.push_back(sliding ? "sliding_attention" : "full_attention");
  }
  return t;
}

}  // namespace

nlohmann::json Llama::hf_config() const {
  const auto& c = cfg_;
  // rope_theta + rope_scaling as Meta's Llama 3.1 config.json has them (transformers 4 and 5 read it).
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_dim},
                      {"hidden_act", "silu"},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"initializer_range", c.initializer_range},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", common::rope_scaling_to_hf(c.rope_scaling)},
                      {"attention_bias", c.attention_bias},
                      {"attention_dropout", 0.0},
                      {"mlp_bias", c.mlp_bias},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"pretraining_tp", 1},
                      {"use_cache", true},
                      {"torch_dtype", "float32"}};
  const auto& t = c.model_type;
  if (t == "llama") return j;
  // The families' config classes: their own keys, none of Llama's they lack.
  j["model_type"] = t;
  j.erase("pretraining_tp");
  j.erase("mlp_bias");
  if (t != "qwen3") j.erase("attention_bias");
  if (t == "qwen2" || t == "qwen3") {
    j["architectures"] = {t == "qwen2" ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM"};
    j["use_sliding_window"] = c.use_sliding_window;
    j["sliding_window"] = c.use_sliding_window ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
    j["max_window_layers"] = c.max_window_layers;
    j["layer_types"] = layer_kinds(c);
  } else if (t == "mistral") {
    j["architectures"] = {"MistralForCausalLM"};
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  } else if (t == "phi3") {
    j["architectures"] = {"Phi3ForCausalLM"};
    j.erase("head_dim");  // Phi3Config derives it (hidden_size / num_attention_heads)
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
    j["original_max_position_embeddings"] = c.original_max_position_embeddings;
    j["partial_rotary_factor"] = c.partial_rotary_factor;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    // Phi3Config's token ids (bos 1, eos and pad 32000) where the vocabulary holds them, else none:
    // transformers refuses a padding id outside the embedding.
    for (const auto& [key, id] : {std::pair<const char*, int64_t>{"bos_token_id", 1}, {"eos_token_id", 32000},
                                  {"pad_token_id", 32000}})
      j[key] = id < c.vocab_size ? nlohmann::json(id) : nlohmann::json(nullptr);
  } else if (t == "gemma3") {
    auto cap = [](double v) { return v > 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
    j["architectures"] = {"Gemma3ForCausalLM"};
    j["model_type"] = "gemma3_text";
    j.erase("hidden_act");
    j["hidden_activation"] = c.hidden_act;
    j["attention_bias"] = c.attention_bias;
    // Gemma3TextConfig types it int (strictly checked); a fractional one is kept as it is.
    const auto qpas = c.query_pre_attn_scalar;
    j["query_pre_attn_scalar"] = qpas == std::floor(qpas) ? nlohmann::json(static_cast<int64_t>(qpas)) : nlohmann::json(qpas);
    j["sliding_window"] = c.sliding_window;
    j["layer_types"] = layer_kinds(c);
    j["rope_local_base_freq"] = c.rope_local_base_freq;
    j["attn_logit_softcapping"] = nullptr;  // refused when set (kGemma3NoAttnCap)
    j["final_logit_softcapping"] = cap(c.final_logit_softcapping);
    j["use_bidirectional_attention"] = false;
  }
  return j;
}

namespace {


template <typename T>
T require(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || j.at(key).is_null())
    throw std::runtime_error(std::string("config.json: required key '") + key + "' is missing");
  return hf_get_or<T>(j, key, T{});
}

}  // namespace

std::shared_ptr<const LlamaConfig> config_from_hf(const nlohmann::json& j) {
  auto c = std::make_shared<LlamaConfig>();
  c->vocab_size = require<int64_t>(j, "vocab_size");
  c->hidden_size = require<int64_t>(j, "hidden_size");
  c->intermediate_size = require<int64_t>(j, "intermediate_size");
  c->num_hidden_layers = require<int64_t>(j, "num_hidden_layers");
  c->num_attention_heads = require<int64_t>(j, "num_attention_heads");
  c->num_key_value_heads = hf_get_or<int64_t>(j, "num_key_value_heads", c->num_attention_heads);
  c->head_dim = hf_get_or<int64_t>(j, "head_dim", c->hidden_size / c->num_attention_heads);
  c->max_position_embeddings = hf_get_or<int64_t>(j, "max_position_embeddings", c->max_position_embeddings);
  c->rms_norm_eps = hf_get_or<double>(j, "rms_norm_eps", c->rms_norm_eps);
  c->tie_word_embeddings = hf_get_or<bool>(j, "tie_word_embeddings", c->tie_word_embeddings);
  c->attention_bias = hf_get_or<bool>(j, "attention_bias", c->attention_bias);
  c->mlp_bias = hf_get_or<bool>(j, "mlp_bias", c->mlp_bias);
  c->initializer_range = hf_get_or<double>(j, "initializer_range", c->initializer_range);
  // Gemma 3 names its activation hidden_activation (a hidden_act beside it must agree).
  const bool gemma = hf_get_or<std::string>(j, "model_type", "") == "gemma3_text";
  const auto act = gemma ? hf_get_or<std::string>(j, "hidden_activation", "gelu_pytorch_tanh")
                         : hf_get_or<std::string>(j, "hidden_act", "silu");
  if (gemma && hf_get_or<std::string>(j, "hidden_act", act) != act)
    throw std::runtime_error("config.json: hidden_act '" + hf_get_or<std::string>(j, "hidden_act", act) +
                             "' disagrees with hidden_activation '" + act + "'");
  const std::string supported = gemma ? "gelu_pytorch_tanh" : "silu";
  if (act != supported)
    throw std::runtime_error(std::string("config.json: ") + (gemma ? "hidden_activation" : "hidden_act") + " '" + act +
                             "' is not supported (only " + supported + ")");
  c->hidden_act = act;
  if (c->num_key_value_heads < 1 || c->num_attention_heads % c->num_key_value_heads != 0)
    throw std::runtime_error("config.json: num_attention_heads " + std::to_string(c->num_attention_heads) +
                             " is not divisible by num_key_value_heads " + std::to_string(c->num_key_value_heads));

  // transformers 5 writes `rope_parameters` (theta inside); 4 writes `rope_theta` + `rope_scaling`.
  const char* rope_key = "rope_scaling";
  nlohmann::json rope = nlohmann::json::object();
  c->rope_theta = hf_get_or<double>(j, "rope_theta", c->rope_theta);
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object()) {
    rope_key = "rope_parameters";
    rope = j.at("rope_parameters");
    c->rope_theta = hf_get_or<double>(rope, "rope_theta", c->rope_theta);
  } else if (j.contains("rope_scaling") && j.at("rope_scaling").is_object()) {
    rope = j.at("rope_scaling");
  } else if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
    throw std::runtime_error("config.json: rope_scaling is not a mapping: " + j.at("rope_scaling").dump().substr(0, 100));
  }
  // Phi-3: rope_parameters' (transformers 5) or the top-level partial_rotary_factor; others have none.
  const auto partial = rope.contains("partial_rotary_factor") ? rope : j;
  c->partial_rotary_factor = hf_get_or<double>(partial, "partial_rotary_factor", 1.0);
  if (!(c->partial_rotary_factor > 0 && c->partial_rotary_factor <= 1))
    throw std::runtime_error("config.json: partial_rotary_factor " + std::to_string(c->partial_rotary_factor) +
                             " is not in (0, 1]");
  if (c->partial_rotary_factor != 1.0 && hf_get_or<std::string>(j, "model_type", "") != "phi3")
    throw std::runtime_error("config.json: partial_rotary_factor " + std::to_string(c->partial_rotary_factor) +
                             ": only phi3 rotates part of each head here");
  if (c->rotary_dim() % 2 != 0 || c->rotary_dim() < 2)
    throw std::runtime_error("config.json: head_dim " + std::to_string(c->head_dim) + " x partial_rotary_factor " +
                             std::to_string(c->partial_rotary_factor) + " is not an even rotary dimension");
  c->rope_scaling = common::rope_scaling_from_hf(rope, rope_key, j, c->max_position_embeddings, c->rotary_dim());
  return c;
}

namespace {

}  // namespace

void parse_llama_args(config::ArgMap& a, LlamaConfig* out) {
  auto* c = out;
  c->vocab_size = a.get_int("vocab_size", c->vocab_size, 1);
  c->hidden_size = a.get_int("hidden_size", c->hidden_size, 1);
  c->intermediate_size = a.get_int("intermediate_size", c->intermediate_size, 1);
  c->num_hidden_layers = a.get_int("num_hidden_layers", c->num_hidden_layers, 1);
  c->num_attention_heads = a.get_int("num_attention_heads", c->num_attention_heads, 1);
  c->num_key_value_heads = a.get_int("num_key_value_heads", c->num_attention_heads, 1);
  if (c->num_attention_heads % c->num_key_value_heads != 0)
    a.fail("num_key_value_heads", "num_attention_heads " + std::to_string(c->num_attention_heads) +
                                      " is not divisible by num_key_value_heads " +
                                      std::to_string(c->num_key_value_heads));
  // transformers' LlamaConfig demands this even with an explicit head_dim.
  if (c->hidden_size % c->num_attention_heads != 0)
    a.fail("hidden_size", "hidden_size " + std::to_string(c->hidden_size) +
                              " is not divisible by num_attention_heads " + std::to_string(c->num_attention_heads));
  // A head_dim set before (deepseek_v3: its rope part) is the default; else hidden / heads.
  c->head_dim = a.get_int("head_dim", c->head_dim > 0 ? c->head_dim : c->hidden_size / c->num_attention_heads, 1);
  if (c->head_dim % 2 != 0)
    a.fail("head_dim", "head_dim " + std::to_string(c->head_dim) + " must be even for rotary embeddings");
  c->max_position_embeddings = a.get_int("max_position_embeddings", c->max_position_embeddings, 1);
  c->rope_theta = a.get_float("rope_theta", c->rope_theta, 1.0);
  if (a.has("rope_scaling")) {
    auto rs_args = a.child("rope_scaling");
    c->rope_scaling = common::parse_rope_scaling(rs_args, c->max_position_embeddings, c->rotary_dim());
  }
  c->rms_norm_eps = a.get_float("rms_norm_eps", c->rms_norm_eps, 0.0);
  c->tie_word_embeddings = a.get_bool("tie_word_embeddings", c->tie_word_embeddings);
  c->attention_bias = a.get_bool("attention_bias", c->attention_bias);
  c->mlp_bias = a.get_bool("mlp_bias", c->mlp_bias);
  c->initializer_range = a.get_float("initializer_range", c->initializer_range, 0.0, 1.0);
}

namespace {

std::shared_ptr<const config::ModelConfig> parse_args(config::ArgMap& a) {
  auto c = std::make_shared<LlamaConfig>();
  parse_llama_args(a, c.get());
  return c;
}

}  // namespace

ModelEntry registry_entry() {
  return {"llama", parse_args,
          nullptr,  // registry: build_sharded + fresh initialisation
          [](const config::ModelConfig& c, const common::ShardingContext& ctx) -> std::shared_ptr<CausalLM> {
            return std::make_shared<Llama>(dynamic_cast<const LlamaConfig&>(c), ctx);
          },
          [](const nlohmann::json& j) -> std::shared_ptr<const config::ModelConfig> { return config_from_hf(j); }};
}

namespace {

const std::vector<std::string> kLayerKinds = {"full_attention", "sliding_attention"};
// transformers' Gemma3Attention never passes it to the attention (Gemma 2's did): refused, not ignored.
const char* const kGemma3NoAttnCap = "is set, but transformers' Gemma 3 does not apply it; leave it null (0)";

// Each layer's window from the family's keys, as transformers' configs derive them.
void make_windows(LlamaConfig& c) {
  c.layer_windows.assign(c.num_hidden_layers, 0);
  if (c.model_type == "mistral" || c.model_type == "phi3") {
    for (auto& w : c.layer_windows) w = c.sliding_window;
    return;
  }
  if (c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "gemma3") return;
  const auto kinds = layer_kinds(c);
  // Without use_sliding_window transformers sets sliding_window to None: every layer full (Qwen).
  const bool slides = c.use_sliding_window || c.model_type == "gemma3";
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.layer_windows[i] = slides && kinds[i] == "sliding_attention" ? c.sliding_window : 0;
}

bool qwen(const std::string& t) { return t == "qwen2" || t == "qwen3"; }

// What the family fixes, and the keys it does not have.
std::optional<std::pair<std::string, std::string>> family_problem(const LlamaConfig& c) {
  const auto& t = c.model_type;
  if (c.mlp_bias) return {{"mlp_bias", "true: " + t + " has no MLP biases"}};
  if (c.attention_bias && t != "qwen3" && t != "gemma3")
    return {{"attention_bias", "true: " + t + (t == "qwen2" ? " has biases on q, k and v only (always)" : " has no attention biases")}};
  if ((qwen(t) || t == "gemma3") && !c.layer_types.empty() && int64_t(c.layer_types.size()) != c.num_hidden_layers)
    return {{"layer_types", "has " + std::to_string(c.layer_types.size()) + " entries for num_hidden_layers " +
                                std::to_string(c.num_hidden_layers)}};
  for (const auto& k : c.layer_types)
    if (std::find(kLayerKinds.begin(), kLayerKinds.end(), k) == kLayerKinds.end())
      return {{"layer_types", "'" + k + "' is not full_attention or sliding_attention"}};
  if (t == "phi3") {
    if (c.head_dim != c.hidden_size / c.num_attention_heads)
      return {{"head_dim", std::to_string(c.head_dim) + ": phi3's is hidden_size / num_attention_heads (" +
                               std::to_string(c.hidden_size / c.num_attention_heads) + ")"}};
    const auto& r = c.rope_scaling.rope_type;
    if (r != "default" && r != "longrope")
      return {{"rope_scaling.rope_type", r + ": Phi3Config takes default or longrope only"}};
  }
  return std::nullopt;
}

void finish_family(LlamaConfig& c) {
  const bool gemma = c.model_type == "gemma3";
  c.qkv_bias = c.model_type == "qwen2";
  c.qk_norm = c.model_type == "qwen3" || gemma;
  c.norm_unit_offset = c.sandwich_norms = c.embed_scale = gemma;
  if (gemma && c.layer_types.empty())  // Gemma3TextConfig's pattern: every sliding_window_pattern-th layer global
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back((i + 1) % c.sliding_window_pattern ? "sliding_attention" : "full_attention");
  make_windows(c);
}

std::shared_ptr<const config::ModelConfig> parse_family(config::ArgMap& a, const std::string& type) {
  auto c = std::make_shared<LlamaConfig>();
  c->model_type = type;
  if (type == "phi3") {  // before the rope scaling, whose factors cover the rotary dimension
    c->partial_rotary_factor = a.get_float("partial_rotary_factor", 1.0, 0.0, 1.0);
    if (c->partial_rotary_factor == 0.0) a.fail("partial_rotary_factor", "0: nothing would rotate");
  }
  parse_llama_args(a, c.get());
  if (c->rotary_dim() % 2 != 0)
    a.fail("partial_rotary_factor", "head_dim " + std::to_string(c->head_dim) + " x " +
                                        std::to_string(c->partial_rotary_factor) + " is not an even rotary dimension");
  if (qwen(type)) {
    c->use_sliding_window = a.get_bool("use_sliding_window", false);
    c->sliding_window = a.get_int("sliding_window", 4096, 1);
    c->max_window_layers = a.get_int("max_window_layers", 28, 0);
    c->layer_types = a.get_string_list("layer_types", std::vector<std::string>{});
  } else if (type == "mistral") {
    c->sliding_window = a.get_int("sliding_window", 4096, 0);  // 0: none (config.json's null)
  } else if (type == "gemma3") {
    c->hidden_act = a.get_string("hidden_activation", "gelu_pytorch_tanh", {"gelu_pytorch_tanh"});
    c->sliding_window = a.get_int("sliding_window", 4096, 1);
    c->layer_types = a.get_string_list("layer_types", std::vector<std::string>{});
    c->sliding_window_pattern = a.get_int("sliding_window_pattern", 6, 1);
    c->query_pre_attn_scalar = a.get_float("query_pre_attn_scalar", 256.0, 1e-9);
    c->rope_local_base_freq = a.get_float("rope_local_base_freq", 10000.0, 1.0);
    if (a.get_float("attn_logit_softcapping", 0.0, 0.0) > 0)  // 0: none (config.json's null)
      a.fail("attn_logit_softcapping", kGemma3NoAttnCap);
    c->final_logit_softcapping = a.get_float("final_logit_softcapping", 0.0, 0.0);
    if (a.get_bool("use_bidirectional_attention", false))
      a.fail("use_bidirectional_attention", "true: nnstrain trains causal language models only");
  } else if (type == "phi3") {
    c->sliding_window = a.get_int("sliding_window", 0, 0);  // 0: none (config.json's null)
    c->original_max_position_embeddings = a.get_int("original_max_position_embeddings", 4096, 1);
    // transformers gives Phi-3's top-level value priority over the rope scaling's own.
    c->rope_scaling.original_max_position_embeddings = c->original_max_position_embeddings;
    for (const char* k : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
      if (a.get_float(k, 0.0, 0.0, 1.0) != 0.0) a.fail(k, "phi3 is trained here without dropout; set it to 0");
  }
  if (const auto p = family_problem(*c)) a.fail(p->first, p->second);
  finish_family(*c);
  return c;
}

// Phi3Config reads the rope types "su" and "yarn" as longrope.
nlohmann::json phi3_rope_names(nlohmann::json j) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(key) || !j.at(key).is_object()) continue;
    auto& r = j.at(key);
    for (const char* k : {"rope_type", "type"})
      if (r.contains(k) && (r.at(k) == "su" || r.at(k) == "yarn")) r[k] = "longrope";
  }
  return j;
}

// Gemma3TextConfig's defaults where they are not Llama's, and transformers 5's
// rope_parameters by layer kind as one rope (full attention) and rope_local_base_freq.
nlohmann::json gemma3_as_flat(nlohmann::json j) {
  const std::pair<const char*, nlohmann::json> defaults[] = {
      {"head_dim", 256}, {"max_position_embeddings", 131072}, {"tie_word_embeddings", true},
      {"query_pre_attn_scalar", 256}, {"sliding_window", 4096}, {"rope_local_base_freq", 10000.0}};
  for (const auto& [k, v] : defaults)
    if (!j.contains(k)) j[k] = v;
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object() &&
      j.at("rope_parameters").contains("full_attention")) {
    const auto by_kind = j.at("rope_parameters");
    j["rope_parameters"] = by_kind.at("full_attention").is_object() ? by_kind.at("full_attention") : nlohmann::json::object();
    if (!j["rope_parameters"].contains("rope_theta")) j["rope_parameters"]["rope_theta"] = 1000000.0;
    const auto local = by_kind.value("sliding_attention", nlohmann::json());
    if (local.is_object()) {
      if (local.value("rope_type", std::string("default")) != "default")
        throw std::runtime_error("config.json: rope_parameters.sliding_attention.rope_type '" +
                                 local.value("rope_type", std::string()) + "' is not supported (only default)");
      if (local.contains("rope_theta")) j["rope_local_base_freq"] = local.at("rope_theta");
    }
  } else if (!j.contains("rope_theta") && !(j.contains("rope_parameters") && j.at("rope_parameters").is_object())) {
    j["rope_theta"] = 1000000.0;
  }
  return j;
}

std::shared_ptr<const config::ModelConfig> family_from_hf(const nlohmann::json& j_in, const std::string& type) {
  const auto j = type == "phi3" ? phi3_rope_names(j_in) : type == "gemma3" ? gemma3_as_flat(j_in) : j_in;
  auto c = std::make_shared<LlamaConfig>(*config_from_hf(j));
  c->model_type = type;
  auto window_of = [&](int64_t def) {
    if (!j.contains("sliding_window") || j.at("sliding_window").is_null()) return def;
    const auto w = hf_get_or<int64_t>(j, "sliding_window", def);
    if (w < 1) throw std::runtime_error("config.json: sliding_window " + std::to_string(w) + " must be at least 1 (or null)");
    return w;
  };
  if (qwen(type)) {
    c->sliding_window = window_of(4096);
    // transformers: no sliding_window (null) means no sliding layer, whatever use_sliding_window says.
    c->use_sliding_window = hf_get_or<bool>(j, "use_sliding_window", false) && j.contains("sliding_window") &&
                            !j.at("sliding_window").is_null();
    c->max_window_layers = hf_get_or<int64_t>(j, "max_window_layers", 28);
    c->layer_types = hf_get_or<std::vector<std::string>>(j, "layer_types", {});
  } else if (type == "mistral") {
    c->sliding_window = window_of(0);
    if (j.contains("layer_types") && !j.at("layer_types").is_null())
      throw std::runtime_error("config.json: layer_types: transformers' Mistral has none (a Ministral folder?)");
  } else if (type == "gemma3") {
    if (j.at("sliding_window").is_null())
      throw std::runtime_error("config.json: sliding_window is null: gemma3's sliding layers need one");
    c->sliding_window = window_of(4096);
    c->layer_types = hf_get_or<std::vector<std::string>>(j, "layer_types", {});
    c->sliding_window_pattern = hf_get_or<int64_t>(j, "sliding_window_pattern", 6);
    if (c->sliding_window_pattern < 1) throw std::runtime_error("config.json: sliding_window_pattern must be at least 1");
    c->query_pre_attn_scalar = hf_get_or<double>(j, "query_pre_attn_scalar", 256.0);
    c->rope_local_base_freq = hf_get_or<double>(j, "rope_local_base_freq", 10000.0);
    if (hf_get_or<double>(j, "attn_logit_softcapping", 0.0) > 0)
      throw std::runtime_error(std::string("config.json: attn_logit_softcapping ") + kGemma3NoAttnCap);
    c->final_logit_softcapping = hf_get_or<double>(j, "final_logit_softcapping", 0.0);
    for (const char* k : {"query_pre_attn_scalar", "rope_local_base_freq", "attn_logit_softcapping", "final_logit_softcapping"})
      if (hf_get_or<double>(j, k, 0.0) < 0) throw std::runtime_error(std::string("config.json: ") + k + " is negative");
    if (c->query_pre_attn_scalar <= 0 || c->rope_local_base_freq <= 0)
      throw std::runtime_error("config.json: query_pre_attn_scalar and rope_local_base_freq must be positive");
    if (hf_get_or<bool>(j, "use_bidirectional_attention", false))
      throw std::runtime_error("config.json: use_bidirectional_attention true: nnstrain trains causal language models only");
  } else if (type == "phi3") {
    c->sliding_window = window_of(0);
    if (j.contains("layer_types") && !j.at("layer_types").is_null())
      throw std::runtime_error("config.json: layer_types: transformers' Phi3 has none (every layer is alike)");
    c->original_max_position_embeddings = hf_get_or<int64_t>(j, "original_max_position_embeddings", 4096);
    if (c->original_max_position_embeddings < 1)
      throw std::runtime_error("config.json: original_max_position_embeddings must be at least 1");
    c->rope_scaling.original_max_position_embeddings = c->original_max_position_embeddings;
    for (const char* k : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
      if (hf_get_or<double>(j, k, 0.0) != 0.0)
        throw std::runtime_error(std::string("config.json: ") + k + " " + std::to_string(hf_get_or<double>(j, k, 0.0)) +
                                 ": phi3 is trained here without dropout");
  }
  if (const auto p = family_problem(*c)) throw std::runtime_error("config.json: " + p->first + " " + p->second);
  finish_family(*c);
  return c;
}

}  // namespace

ModelEntry family_entry(const std::string& type) {
  ModelEntry e{type, [type](config::ArgMap& a) { return parse_family(a, type); },
               nullptr,  // registry: build_sharded + fresh initialisation
               [](const config::ModelConfig& c, const common::ShardingContext& ctx) -> std::shared_ptr<CausalLM> {
                 return std::make_shared<Llama>(dynamic_cast<const LlamaConfig&>(c), ctx);
               },
               [type](const nlohmann::json& j) -> std::shared_ptr<const config::ModelConfig> {
                 return family_from_hf(j, type);
               }};
  if (type == "gemma3") e.hf_model_type = "gemma3_text";  // Gemma3ForCausalLM's config
  if (type == "mistral" || type == "phi3")  // config.json's null window is model.args' 0
    e.args_of_hf = [](nlohmann::json j) {
      if (j.value("sliding_window", nlohmann::json()).is_null()) j["sliding_window"] = 0;
      return j;
    };
  return e;
}

}  // namespace nnstrain::models::llama
