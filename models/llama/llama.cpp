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
  return common::rope_frequencies(c.rope_scaling, c.rope_theta, c.head_dim, c.max_position_embeddings).inv_freq;
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
torch::Tensor apply_rope(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin) {
  return common::kernels::rotary_(t, cos, sin);
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
  // Ring attention has no window: refused here (the loader refuses it first, naming the key).
  if (window > 0 && ctx.cp_comm)
    throw std::invalid_argument("model.args.sliding_window: context parallelism has no sliding-window attention");
  if (cfg.qk_norm) {
    // Each tensor-parallel rank normalises only its heads, so the (replicated)
    // weights' gradients are partial: summed over the group, as a sequence-parallel norm's.
    auto heads_ctx = ctx;
    heads_ctx.sequence_parallel = true;
    q_norm = register_module("q_norm", common::RMSNorm(head_dim, cfg.rms_norm_eps, heads_ctx));
    k_norm = register_module("k_norm", common::RMSNorm(head_dim, cfg.rms_norm_eps, heads_ctx));
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
    if (by_tiles) o.segments = mask;
    auto y = common::context_parallel_attention(q, k, v, /*causal=*/true, cp_comm, o);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  TORCH_CHECK(window == 0 || !mask.defined(),
              "model.args.sliding_window: packed documents (dataset document_mask) have no sliding-window attention");
  if (by_tiles) {
    auto y = common::document_attention(q, k, v, mask);
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
    auto y = at::scaled_dot_product_attention(q, k, v, band, 0.0, false, std::nullopt, native_gqa);
    return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
  }
  auto y = at::scaled_dot_product_attention(q, k, v, attn_mask(mask), /*dropout_p=*/0.0,
                                            /*is_causal=*/!mask.defined(), /*scale=*/std::nullopt, native_gqa);
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
  const auto y = common::cached_attention(q, K, V, past, window);
  return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

MlpImpl::MlpImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx) {
  const int64_t C = cfg.hidden_size, I = cfg.intermediate_size;
  const auto init = common::InitRule::normal(cfg.initializer_range);
  gate_proj = register_module("gate_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{I}, 1, cfg.mlp_bias, init));
  up_proj = register_module("up_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{I}, 1, cfg.mlp_bias, init));
  down_proj = register_module("down_proj", common::RowParallelLinear(ctx, I, C, 1, cfg.mlp_bias, init));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(common::kernels::swiglu(gate_proj(x), up_proj(x)));
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx, int64_t index,
                                   std::shared_ptr<common::AuxLossScale> aux_scale) {
  self_attn = register_module("self_attn", Attention(cfg, ctx, index));
  if (cfg.sparse(index))
    moe = register_module(cfg.moe_module, common::Moe(*cfg.moe, ctx, "layers." + std::to_string(index) + "." +
                                                                          cfg.moe_module, std::move(aux_scale)));
  else
    mlp = register_module("mlp", Mlp(cfg, ctx));
  input_layernorm =
      register_module("input_layernorm", common::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx));
  post_attention_layernorm =
      register_module("post_attention_layernorm", common::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& mask) {
  auto h = x + self_attn->forward(input_layernorm(x), cos, sin, mask);
  return h + feed_forward(post_attention_layernorm(h));
}

torch::Tensor DecoderLayerImpl::forward_cached(const torch::Tensor& x, const torch::Tensor& cos,
                                               const torch::Tensor& sin, common::KvCache& cache, size_t layer) {
  auto h = x + self_attn->forward_cached(input_layernorm(x), cos, sin, cache, layer);
  return h + feed_forward(post_attention_layernorm(h));
}

// As transformers' LlamaPreTrainedModel: N(0, initializer_range) for every
// matrix (the layers' InitRule), zero biases, unit norm weights.
Llama::Llama(const LlamaConfig& cfg, const common::ShardingContext& ctx) : cfg_(cfg.resolved()) {
  const auto& c = cfg_;
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "llama: num_attention_heads ",
              c.num_attention_heads, " is not divisible by num_key_value_heads ", c.num_key_value_heads);
  TORCH_CHECK(c.head_dim % 2 == 0, "llama: head_dim ", c.head_dim, " must be even for rotary embeddings");
  const auto init = common::InitRule::normal(c.initializer_range);
  embed_tokens = register_module("embed_tokens", common::VocabParallelEmbedding(ctx, c.vocab_size, c.hidden_size, init));
  layers = register_module("layers", torch::nn::ModuleList());
  if (c.moe) aux_scale_ = std::make_shared<common::AuxLossScale>();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c, ctx, i, aux_scale_));
  norm = register_module("norm", common::RMSNorm(c.hidden_size, c.rms_norm_eps, ctx));
  lm_head = common::ParallelLmHead(ctx, c.vocab_size, c.hidden_size, !c.tie_word_embeddings, init);
  if (!c.tie_word_embeddings) register_module("lm_head", lm_head);
  TORCH_CHECK(c.layer_windows.empty() || int64_t(c.layer_windows.size()) == c.num_hidden_layers,
              "llama: ", c.layer_windows.size(), " layer windows for ", c.num_hidden_layers, " layers");
  const auto f = common::rope_frequencies(c.rope_scaling, c.rope_theta, c.head_dim, c.max_position_embeddings);
  inv_freq_ = f.inv_freq;
  rope_scale_ = f.attention_scaling;
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
  const auto f = common::rope_frequencies(cfg_.rope_scaling, cfg_.rope_theta, cfg_.head_dim,
                                          cfg_.max_position_embeddings, seq_len);
  if (!torch::equal(f.inv_freq, inv_freq_)) cos_ = torch::Tensor();
  inv_freq_ = f.inv_freq;
}

std::pair<torch::Tensor, torch::Tensor> Llama::rotary(int64_t T, const torch::Device& device) {
  if (!cos_.defined() || cos_.size(0) != T || cos_.device() != device) {
    torch::NoGradGuard no_grad;
    // transformers: freqs = position * inv_freq, emb = cat(freqs, freqs), in fp32.
    // Under context parallelism the tokens' global positions.
    const auto pos = cp_ > 1 ? torch::tensor(common::cp_position_ids(T * cp_, cp_, cp_rank_, cp_layout_), torch::kLong)
                             : torch::arange(T, torch::kLong);
    const auto freqs = pos.to(torch::kFloat).unsqueeze(-1) * inv_freq_;
    const auto emb = torch::cat({freqs, freqs}, -1);
    cos_ = (rope_scale_ == 1.0 ? emb.cos() : emb.cos() * rope_scale_).to(device);
    sin_ = (rope_scale_ == 1.0 ? emb.sin() : emb.sin() * rope_scale_).to(device);
  }
  return {cos_, sin_};
}

torch::Tensor Llama::embed(const torch::Tensor& idx, const Documents&) {
  const auto T = idx.size(1);
  TORCH_CHECK(T * cp_ <= cfg_.max_position_embeddings, "sequence of ", T * cp_, " tokens exceeds max_position_embeddings ",
              cfg_.max_position_embeddings);
  return embed_tokens(idx);
}

torch::Tensor Llama::blocks(const torch::Tensor& input, int64_t begin, int64_t end, int64_t seq_len,
                            const Documents& docs) {
  auto x = input;
  rope_for(seq_len * cp_);
  auto [cos, sin] = rotary(seq_len, x.device());
  torch::Tensor mask;
  if (docs.defined()) {
    // Packed documents: rotary angles of each token's position within its document, [B, 1, T, head_dim].
    torch::NoGradGuard no_grad;
    const auto freqs = docs.positions.to(torch::kFloat).unsqueeze(-1) * inv_freq_.to(x.device());
    const auto emb = torch::cat({freqs, freqs}, -1).unsqueeze(1);
    cos = emb.cos() * rope_scale_;
    sin = emb.sin() * rope_scale_;
    mask = docs.attention_input(/*by_tiles=*/true);  // segments: common::document_attention picks the kernel
  }
  for (auto i = static_cast<size_t>(begin); i < static_cast<size_t>(end); ++i) {
    auto layer = layers->ptr<DecoderLayerImpl>(i);
    x = run_block(i, [layer, cos = cos, sin = sin, mask](const torch::Tensor& t) { return layer->forward(t, cos, sin, mask); },
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

torch::Tensor Llama::decode_logits(const torch::Tensor& idx, common::KvCache& cache) {
  const auto past = cache.length(), T = idx.size(1);
  TORCH_CHECK(past + T <= cfg_.max_position_embeddings, "position ", past + T, " exceeds max_position_embeddings ",
              cfg_.max_position_embeddings);
  auto x = embed_tokens(idx);
  rope_for(past + T);  // transformers' choice per call: the positions it holds
  // The tables for the cache's whole span (kept by rotary() across steps), at the new positions.
  const auto [cos_all, sin_all] = rotary(cache.capacity(), x.device());
  const auto cos = cos_all.narrow(0, past, T), sin = sin_all.narrow(0, past, T);
  for (size_t i = 0; i < layers->size(); ++i) x = layers->ptr<DecoderLayerImpl>(i)->forward_cached(x, cos, sin, cache, i);
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
  return 6 * n + 12.0 * c.num_hidden_layers * q * seq_len;
}

ModelDims Llama::dims() const {
  return {cfg_.hidden_size,         cfg_.num_hidden_layers, cfg_.num_attention_heads,
          cfg_.num_key_value_heads, cfg_.intermediate_size, cfg_.vocab_size,
          cfg_.max_position_embeddings, cfg_.tie_word_embeddings};
}

std::vector<HfTensor> Llama::hf_tensors() const {
  std::vector<HfTensor> t;
  for (const auto& p : named_parameters()) {
    const auto& ours = p.key();
    t.push_back({ours, ours == "lm_head.weight" ? ours : "model." + ours, false});
  }
  return t;
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
  const auto act = hf_get_or<std::string>(j, "hidden_act", "silu");
  if (act != "silu") throw std::runtime_error("config.json: hidden_act '" + act + "' is not supported (only silu)");
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
  c->rope_scaling = common::rope_scaling_from_hf(rope, rope_key, j, c->max_position_embeddings, c->head_dim);
  if (c->head_dim % 2 != 0) throw std::runtime_error("config.json: head_dim " + std::to_string(c->head_dim) + " is odd");
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
  c->head_dim = a.get_int("head_dim", c->hidden_size / c->num_attention_heads, 1);
  if (c->head_dim % 2 != 0)
    a.fail("head_dim", "head_dim " + std::to_string(c->head_dim) + " must be even for rotary embeddings");
  c->max_position_embeddings = a.get_int("max_position_embeddings", c->max_position_embeddings, 1);
  c->rope_theta = a.get_float("rope_theta", c->rope_theta, 1.0);
  if (a.has("rope_scaling")) {
    auto rs_args = a.child("rope_scaling");
    c->rope_scaling = common::parse_rope_scaling(rs_args, c->max_position_embeddings, c->head_dim);
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

// Each layer's window from the family's keys, as transformers' configs derive them.
void make_windows(LlamaConfig& c) {
  c.layer_windows.assign(c.num_hidden_layers, 0);
  if (c.model_type == "mistral") {
    for (auto& w : c.layer_windows) w = c.sliding_window;
    return;
  }
  if (c.model_type != "qwen2" && c.model_type != "qwen3") return;
  const auto kinds = layer_kinds(c);
  // Without use_sliding_window transformers sets sliding_window to None: every layer full.
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.layer_windows[i] = c.use_sliding_window && kinds[i] == "sliding_attention" ? c.sliding_window : 0;
}

bool qwen(const std::string& t) { return t == "qwen2" || t == "qwen3"; }

// What the family fixes, and the keys it does not have.
std::optional<std::pair<std::string, std::string>> family_problem(const LlamaConfig& c) {
  const auto& t = c.model_type;
  if (c.mlp_bias) return {{"mlp_bias", "true: " + t + " has no MLP biases"}};
  if (c.attention_bias && t != "qwen3")
    return {{"attention_bias", "true: " + t + (t == "qwen2" ? " has biases on q, k and v only (always)" : " has no attention biases")}};
  if (qwen(t) && !c.layer_types.empty() && int64_t(c.layer_types.size()) != c.num_hidden_layers)
    return {{"layer_types", "has " + std::to_string(c.layer_types.size()) + " entries for num_hidden_layers " +
                                std::to_string(c.num_hidden_layers)}};
  for (const auto& k : c.layer_types)
    if (std::find(kLayerKinds.begin(), kLayerKinds.end(), k) == kLayerKinds.end())
      return {{"layer_types", "'" + k + "' is not full_attention or sliding_attention"}};
  return std::nullopt;
}

void finish_family(LlamaConfig& c) {
  c.qkv_bias = c.model_type == "qwen2";
  c.qk_norm = c.model_type == "qwen3";
  make_windows(c);
}

std::shared_ptr<const config::ModelConfig> parse_family(config::ArgMap& a, const std::string& type) {
  auto c = std::make_shared<LlamaConfig>();
  c->model_type = type;
  parse_llama_args(a, c.get());
  if (qwen(type)) {
    c->use_sliding_window = a.get_bool("use_sliding_window", false);
    c->sliding_window = a.get_int("sliding_window", 4096, 1);
    c->max_window_layers = a.get_int("max_window_layers", 28, 0);
    c->layer_types = a.get_string_list("layer_types", std::vector<std::string>{});
  } else if (type == "mistral") {
    c->sliding_window = a.get_int("sliding_window", 4096, 0);  // 0: none (config.json's null)
  }
  if (const auto p = family_problem(*c)) a.fail(p->first, p->second);
  finish_family(*c);
  return c;
}

std::shared_ptr<const config::ModelConfig> family_from_hf(const nlohmann::json& j, const std::string& type) {
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
  if (type == "mistral")  // config.json's null window is model.args' 0
    e.args_of_hf = [](nlohmann::json j) {
      if (j.value("sliding_window", nlohmann::json()).is_null()) j["sliding_window"] = 0;
      return j;
    };
  return e;
}

}  // namespace nnstrain::models::llama
