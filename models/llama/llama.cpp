#include "models/llama/llama.h"

#include <cmath>
#include <stdexcept>

#include "models/common/context_attention.h"
#include "models/common/kernels/kernels.h"


namespace F = torch::nn::functional;

namespace nnstrain::models::llama {

LlamaConfig LlamaConfig::resolved() const {
  LlamaConfig c = *this;
  if (c.num_key_value_heads == 0) c.num_key_value_heads = c.num_attention_heads;
  if (c.head_dim == 0) c.head_dim = c.hidden_size / c.num_attention_heads;
  return c;
}

// Mirrors transformers' op sequence (Python's `s / t` is t.reciprocal() * s) so
// the frequencies match it bit for bit in fp32.
torch::Tensor rope_inv_freq(const LlamaConfig& cfg) {
  const auto c = cfg.resolved();
  const int64_t dim = c.head_dim;
  const auto exponents = torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / dim;
  auto inv_freq = torch::pow(c.rope_theta, exponents).reciprocal();
  const auto& rs = c.rope_scaling;
  if (rs.rope_type != "llama3") return inv_freq;

  // Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
  const double old_context_len = static_cast<double>(rs.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / rs.low_freq_factor;
  const double high_freq_wavelen = old_context_len / rs.high_freq_factor;
  const auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
  auto inv_freq_llama = torch::where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq);
  const auto smooth_factor =
      (wavelen.reciprocal() * old_context_len - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
  const auto smoothed_inv_freq =
      torch::rsub(smooth_factor, 1) * inv_freq_llama / rs.factor + smooth_factor * inv_freq_llama;
  const auto is_medium_freq =
      (wavelen < high_freq_wavelen).logical_not().logical_and((wavelen > low_freq_wavelen).logical_not());
  return torch::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama);
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

AttentionImpl::AttentionImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx)
    : head_dim(cfg.head_dim),
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
  const bool b = cfg.attention_bias;
  q_proj = register_module("q_proj",
                           common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{q}, group * head_dim, b, init));
  k_proj = register_module("k_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{kv}, head_dim, b, init));
  v_proj = register_module("v_proj", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{kv}, head_dim, b, init));
  o_proj = register_module("o_proj", common::RowParallelLinear(ctx, q, C, group * head_dim, b, init));
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
  const auto y = common::cached_attention(q, K, V, past);
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
  self_attn = register_module("self_attn", Attention(cfg, ctx));
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
  inv_freq_ = rope_inv_freq(c);
  if (ctx.cp_comm) {
    cp_ = ctx.cp_comm->size();
    cp_rank_ = ctx.cp_comm->rank();
    cp_layout_ = ctx.cp_layout;
  }
}

const torch::Tensor& Llama::head_weight() const {
  return cfg_.tie_word_embeddings ? embed_tokens->weight : lm_head->weight;
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
    cos_ = emb.cos().to(device);
    sin_ = emb.sin().to(device);
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
  auto [cos, sin] = rotary(seq_len, x.device());
  torch::Tensor mask;
  if (docs.defined()) {
    // Packed documents: rotary angles of each token's position within its document, [B, 1, T, head_dim].
    torch::NoGradGuard no_grad;
    const auto freqs = docs.positions.to(torch::kFloat).unsqueeze(-1) * inv_freq_.to(x.device());
    const auto emb = torch::cat({freqs, freqs}, -1).unsqueeze(1);
    cos = emb.cos();
    sin = emb.sin();
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

nlohmann::json Llama::hf_config() const {
  const auto& c = cfg_;
  nlohmann::json rope_scaling = nullptr;
  if (c.rope_scaling.rope_type == "llama3")
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", c.rope_scaling.factor},
                    {"low_freq_factor", c.rope_scaling.low_freq_factor},
                    {"high_freq_factor", c.rope_scaling.high_freq_factor},
                    {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  // rope_theta + rope_scaling as Meta's Llama 3.1 config.json has them (transformers 4 and 5 read it).
  return {{"architectures", {"LlamaForCausalLM"}},
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
          {"rope_scaling", rope_scaling},
          {"attention_bias", c.attention_bias},
          {"attention_dropout", 0.0},
          {"mlp_bias", c.mlp_bias},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"pretraining_tp", 1},
          {"use_cache", true},
          {"torch_dtype", "float32"}};
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
  }
  auto& rs = c->rope_scaling;
  rs.rope_type = hf_get_or<std::string>(rope, "rope_type", hf_get_or<std::string>(rope, "type", "default"));
  if (rs.rope_type == "llama3") {
    rs.factor = require<double>(rope, "factor");
    rs.low_freq_factor = require<double>(rope, "low_freq_factor");
    rs.high_freq_factor = require<double>(rope, "high_freq_factor");
    rs.original_max_position_embeddings =
        hf_get_or<int64_t>(rope, "original_max_position_embeddings", c->max_position_embeddings);
  } else if (rs.rope_type != "default") {
    throw std::runtime_error(std::string("config.json: ") + rope_key + ".rope_type '" + rs.rope_type +
                             "' is not supported (only default and llama3)");
  }
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
    auto& rs = c->rope_scaling;
    rs.rope_type = rs_args.get_string("rope_type", std::nullopt, {"default", "llama3"});
    if (rs.rope_type == "llama3") {
      rs.factor = rs_args.get_float("factor", rs.factor, 1.0);
      rs.low_freq_factor = rs_args.get_float("low_freq_factor", rs.low_freq_factor, 0.0);
      rs.high_freq_factor = rs_args.get_float("high_freq_factor", rs.high_freq_factor, 0.0);
      rs.original_max_position_embeddings =
          rs_args.get_int("original_max_position_embeddings", rs.original_max_position_embeddings, 1);
      if (!(rs.high_freq_factor > rs.low_freq_factor) || rs.low_freq_factor <= 0)
        rs_args.fail("high_freq_factor", "need 0 < low_freq_factor < high_freq_factor, got " +
                                             std::to_string(rs.low_freq_factor) + " and " +
                                             std::to_string(rs.high_freq_factor));
    }
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

}  // namespace nnstrain::models::llama
