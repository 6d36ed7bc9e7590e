// Llama (2, 3, 3.1): RMSNorm pre-norm decoder layers, rotary position
// embeddings (with Llama 3.1's frequency scaling), grouped-query attention, a
// SwiGLU MLP, and an LM head tied to the token embedding or its own. Argument
// and parameter names follow Hugging Face's LlamaConfig / LlamaForCausalLM
// (parameters without the "model." prefix), so checkpoints map one to one.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "models/common/attention_sinks.h"
#include "models/common/latent_attention.h"
#include "models/common/layers.h"
#include "models/common/moe.h"
#include "models/common/rope.h"
#include "models/model.h"
#include "models/registry.h"

namespace nnstrain::models::llama {

// Hugging Face's `rope_scaling` (transformers 5: `rope_parameters`): every kind
// transformers computes (models/common/rope.h).
using RopeScaling = common::RopeScaling;

// Defaults are LlamaConfig's (Llama 2 7B), so a bare config.json reads the same.
struct LlamaConfig : config::ModelConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 0;  // 0 = num_attention_heads (no GQA)
  int64_t head_dim = 0;             // 0 = hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  double initializer_range = 0.02;

  // The families that are configurations of this decoder (registered by
  // model_type: llama, qwen2, qwen3, mistral; docs/models.md's table).
  // qkv_bias: biases on q, k, v but not o (Qwen2). layer_windows: each layer's
  // sliding window (0: full causal attention; empty: all full), made from the
  // family's keys below, which config.json round-trips.
  std::string model_type = "llama";
  bool qkv_bias = false;
  std::vector<int64_t> layer_windows;
  bool use_sliding_window = false;           // qwen2, qwen3
  int64_t sliding_window = 4096;             // qwen2, qwen3, mistral (mistral: 0 = none)
  int64_t max_window_layers = 28;            // qwen2, qwen3: layers from here slide (without layer_types)
  std::vector<std::string> layer_types;      // qwen2, qwen3: full_attention | sliding_attention per layer
  // phi3: the first int(head_dim x partial_rotary_factor) dimensions of each head
  // rotate (the rest pass); original_max_position_embeddings: where generation
  // rebuilds its cache (longrope's switch, CausalLM::rebuild_cache); 0: none.
  // Its checkpoints fuse q/k/v into qkv_proj and gate/up into gate_up_proj
  // (hf_tensors' fused_offset); the modules stay Llama's.
  double partial_rotary_factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  // gemma3 (Gemma3ForCausalLM, model_type gemma3_text): norms scaled by (1 + w)
  // (norm_unit_offset, q/k norms included), sandwich_norms (post_attention_layernorm
  // on the attention's output, pre_/post_feedforward_layernorm around the MLP),
  // hidden_act gelu_pytorch_tanh (GeGLU), embed_scale (embeddings times
  // sqrt(hidden_size) in their dtype), scores times query_pre_attn_scalar^-0.5
  // (0: head_dim's), the sliding layers' own rope theta (rope_local_base_freq, 0:
  // none), tanh soft-capping of the logits (0: none; of the scores: refused, as
  // transformers' Gemma 3 does not apply attn_logit_softcapping).
  bool norm_unit_offset = false, sandwich_norms = false, embed_scale = false;
  std::string hidden_act = "silu";
  double query_pre_attn_scalar = 0, rope_local_base_freq = 0;
  double final_logit_softcapping = 0;
  int64_t sliding_window_pattern = 6;  // gemma3 without layer_types: every sliding_window_pattern-th layer is global
  bool local_rope(int64_t layer) const { return rope_local_base_freq > 0 && window(layer) > 0; }
  int64_t rotary_dim() const {
    return static_cast<int64_t>((head_dim ? head_dim : hidden_size / num_attention_heads) * partial_rotary_factor);
  }
  int64_t window(int64_t layer) const { return layer < int64_t(layer_windows.size()) ? layer_windows[layer] : 0; }
  bool windowed() const {
    for (auto w : layer_windows)
      if (w > 0) return true;
    return false;
  }
  // The keys the queries of a seq_len sequence see, summed over the layers, times two (a
  // sliding layer's 2w - w(w - 1) / T, a full one's T): the planner's causal halving gives the work.
  // Under attention_sinks every layer's 2T: the math form computes the whole square.
  double attention_span(int64_t seq_len) const;
  // gpt_oss: a learned sink logit per query head in every layer's softmax (models/common/attention_sinks.h).
  bool attention_sinks = false;

  // The Mixture-of-Experts models built on Llama (models/moe: qwen3_moe,
  // mixtral) set these; plain Llama leaves them. qk_norm: Qwen3's RMSNorm of
  // each query and key head before the rotation. moe: the MoE block, on the
  // layers sparse_layers marks (module name moe_module), the dense MLP elsewhere.
  bool qk_norm = false;
  std::shared_ptr<const common::MoeOptions> moe;
  std::vector<bool> sparse_layers;
  std::string moe_module = "mlp";
  bool sparse(int64_t layer) const { return moe && layer < int64_t(sparse_layers.size()) && sparse_layers[layer]; }
  // DeepSeek-V3 (models/moe): multi-head latent attention in every layer in place of Attention
  // (null: grouped-query attention); head_dim is then its rope part, which the rotary tables cover.
  std::shared_ptr<const common::LatentAttentionOptions> latent;

  std::pair<std::string, std::string> context_parallel_refusal() const override {
    if (attention_sinks) return {"attention_sinks", "attention sinks (gpt_oss: a learned logit per head in the softmax)"};
    // (Sliding windows run: context-parallel attention's masked tiles take the window.)
    return {"", ""};
  }

  // The same config with the 0 = derived fields filled in.
  LlamaConfig resolved() const;
};

// Inverse rotary frequencies [head_dim / 2], fp32, exactly as transformers
// computes them (its default and `_compute_llama3_parameters`).
torch::Tensor rope_inv_freq(const LlamaConfig& cfg);

class AttentionImpl : public torch::nn::Module {
 public:
  // `layer`: its place in the stack (its sliding window).
  AttentionImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx = {}, int64_t layer = 0);
  // cos/sin (Hugging Face's rotate_half layout): [T, head_dim] or, per token, [B, 1, T, head_dim]; mask: Documents::attention_mask()
  // (undefined: causal over the whole sequence).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  // Generation: the new tokens (cos, sin at their positions) over the cache's block `layer`.
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               common::KvCache& cache, size_t layer);
  common::ColumnParallelLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  common::RowParallelLinear o_proj{nullptr};
  common::RMSNorm q_norm{nullptr}, k_norm{nullptr};  // qk_norm only
  common::AttentionSinks sinks{nullptr};              // attention_sinks only
  int64_t head_dim, heads, kv_heads;  // this rank's heads
  int64_t window = 0;                 // sliding window (0: full causal)
  std::optional<double> scale;        // of the scores (none: 1 / sqrt(head_dim))
  c10::intrusive_ptr<common::CpComm> cp_comm;  // context parallelism (null at cp 1)
  common::CpCommType cp_comm_type = common::CpCommType::P2P;
  common::CpLayout cp_layout = common::CpLayout::Zigzag;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx = {});
  torch::Tensor forward(const torch::Tensor& x);  // down(act(gate(x)) * up(x)), act silu or tanh GELU
  common::ColumnParallelLinear gate_proj{nullptr}, up_proj{nullptr};
  common::RowParallelLinear down_proj{nullptr};
  bool gelu = false;
};
TORCH_MODULE(Mlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  // `index`: its place in the stack (which feed-forward it has); `aux_scale`:
  // the model's, for an MoE block's balancing losses.
  DecoderLayerImpl(const LlamaConfig& cfg, const common::ShardingContext& ctx = {}, int64_t index = 0,
                   std::shared_ptr<common::AuxLossScale> aux_scale = nullptr);
  // cos/sin: [T, head_dim] or, per token, [B, 1, T, head_dim]; mask: Documents::attention_mask()
  // (undefined: causal over the whole sequence).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  torch::Tensor forward_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               common::KvCache& cache, size_t layer);
  common::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  common::RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};  // sandwich_norms only
  Attention self_attn{nullptr};
  common::LatentAttention latent_attn{nullptr};  // cfg.latent's, registered as "self_attn" in its place
  Mlp mlp{nullptr};         // the dense feed-forward, or
  common::Moe moe{nullptr};  // the MoE one (registered as cfg.moe_module)

 private:
  torch::Tensor feed_forward(const torch::Tensor& x) { return moe ? moe(x) : mlp(x); }
  torch::Tensor attention(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& mask) {
    return latent_attn ? latent_attn(x, cos, sin, mask) : self_attn(x, cos, sin, mask);
  }
  torch::Tensor attention_cached(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 common::KvCache& cache, size_t layer) {
    return latent_attn ? latent_attn->forward_cached(x, cos, sin, cache, layer)
                       : self_attn->forward_cached(x, cos, sin, cache, layer);
  }
};
TORCH_MODULE(DecoderLayer);

class Llama : public CausalLM {
 public:
  // Parameters on ctx.options (meta: materialise them, models/common/init.h).
  explicit Llama(const LlamaConfig& cfg, const common::ShardingContext& ctx = {});
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) override;
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const Documents& docs) override;
  torch::Tensor logits(const torch::Tensor& idx) override;
  torch::Tensor decode_logits(const torch::Tensor& idx, common::KvCache& cache) override;
  torch::Tensor embed(const torch::Tensor& idx, const Documents& docs) override;
  torch::Tensor blocks(const torch::Tensor& x, int64_t begin, int64_t end, int64_t seq_len,
                       const Documents& docs) override;
  torch::Tensor head_loss(const torch::Tensor& h, const torch::Tensor& targets) override;
  torch::Tensor head_logits(const torch::Tensor& h) override;
  std::vector<std::string> head_ties() const override;
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_seq_len() const override { return cfg_.max_position_embeddings; }
  int64_t num_layers() const override { return cfg_.num_hidden_layers; }
  std::string blocks_name() const override { return "layers"; }
  double flops_per_token(int64_t seq_len) const override;
  ModelDims dims() const override;
  std::vector<HfTensor> hf_tensors() const override;
  bool rebuild_cache(int64_t cached, int64_t length) const override;
  nlohmann::json hf_config() const override;
  void set_loss_grad(const at::Tensor& g) override {
    if (aux_scale_) aux_scale_->grad = g;
  }
  const LlamaConfig& config() const { return cfg_; }

  common::VocabParallelEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  common::RMSNorm norm{nullptr};
  // Loss and logits on head_weight(); the module "lm_head" with its own weight
  // when untied, a head on embed_tokens' weight (no module) when tied.
  common::ParallelLmHead lm_head{nullptr};
  common::ParallelLmHeadImpl* lm_head_module() override { return lm_head.get(); }

  const torch::Tensor& head_weight() const;

 protected:
  // The gradient each micro-batch's LM loss receives, for MoE balancing losses (null: dense).
  std::shared_ptr<common::AuxLossScale> aux_scale_;

 private:
  torch::Tensor hidden(const torch::Tensor& idx, const Documents& docs = {});
  // The rotary tables of T positions; `local`: the sliding layers' (rope_local_base_freq).
  std::pair<torch::Tensor, torch::Tensor> rotary(int64_t T, const torch::Device& device, bool local = false);
  torch::Tensor scaled_embed(const torch::Tensor& idx);  // embed_tokens, times sqrt(hidden_size) under embed_scale
  void rope_for(int64_t seq_len);  // longrope: the frequencies for a sequence of seq_len
  LlamaConfig cfg_;
  // Context parallelism: this rank's tokens sit at global positions (rotary).
  int cp_ = 1, cp_rank_ = 0;
  common::CpLayout cp_layout_ = common::CpLayout::Zigzag;
  torch::Tensor inv_freq_;  // on the CPU; not a parameter or buffer (transformers: non-persistent)
  double rope_scale_ = 1.0;  // cos and sin times this (yarn, longrope)
  torch::Tensor cos_, sin_;  // cache for the last (T, device)
  torch::Tensor local_inv_freq_, local_cos_, local_sin_;  // rope_local_base_freq's (undefined: none)
};

// A Hugging Face config.json (LlamaForCausalLM; transformers 4 `rope_theta` +
// `rope_scaling` or transformers 5 `rope_parameters`) -> LlamaConfig. Throws
// std::runtime_error naming the key on what it cannot represent.
std::shared_ptr<const LlamaConfig> config_from_hf(const nlohmann::json& j);

// model.args keys shared with the models built on Llama (models/moe), read into *c.
void parse_llama_args(config::ArgMap& a, LlamaConfig* c);

// config.json's j[key] if present and not null, else def; a value of the wrong
// type throws std::runtime_error naming the key (MoE models read theirs with it too).
template <typename T>
T hf_get_or(const nlohmann::json& j, const char* key, T def) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::runtime_error(std::string("config.json: '") + key + "' has an unexpected type: " + it->dump());
  }
}

ModelEntry registry_entry();
// The families that are configurations of this decoder: "qwen2", "qwen3", "mistral", "phi3", "gemma3".
ModelEntry family_entry(const std::string& model_type);

}  // namespace nnstrain::models::llama
