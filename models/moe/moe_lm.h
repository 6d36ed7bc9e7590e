// Mixture-of-Experts language models on Llama's stack (models/llama): Llama's
// attention, rotary embeddings and decoder layers, with the MoE block
// (models/common/moe.h) in place of the dense MLP on the sparse layers.
//   qwen3_moe  Qwen3-MoE: GQA attention with per-head QK RMSNorm; MoE on the
//              layers decoder_sparse_step / mlp_only_layers name (module "mlp")
//   mixtral    Mixtral: Llama attention; MoE on every layer (module "block_sparse_moe")
//   deepseek_v3 DeepSeek-V3: multi-head latent attention (models/common/latent_attention.h),
//              the sigmoid router always, shared experts, dense first layers (module "mlp")
// Either takes DeepSeek-V3's router (scoring_func: sigmoid, n_group, topk_group,
// routed_scaling_factor, bias_update_speed), shared experts and
// first_k_dense_replace. Keys are named as transformers' Qwen3MoeConfig,
// MixtralConfig and DeepseekV3Config (docs/models.md lists them).
#pragma once

#include <string>
#include <vector>

#include "models/llama/llama.h"

namespace nnstrain::models::moe {

struct MoeLmConfig : llama::LlamaConfig {
  std::string model_type;  // "qwen3_moe", "mixtral" or "deepseek_v3"
  // Which layers are sparse (what sparse_layers was made from, for config.json).
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t first_k_dense_replace = 0;
};

class MoeLm : public llama::Llama {
 public:
  MoeLm(const MoeLmConfig& cfg, const common::ShardingContext& ctx = {});
  std::vector<MoeStats> take_moe_stats() override;
  // The DeepSeek-V3 router's selection bias, where a layer keeps one, as
  // DeepseekV3's `<layer>.gate.e_score_correction_bias` (the MoE monitor saves
  // it as moe/<layer>.expert_bias).
  std::vector<HfBuffer> hf_buffers() override;
  // Active parameters only: k of E routed experts (plus the shared ones) per sparse layer.
  double flops_per_token(int64_t seq_len) const override;
  ModelDims dims() const override;  // Llama's, with the MoE fields
  std::vector<HfTensor> hf_tensors() const override;
  nlohmann::json hf_config() const override;
  // Refuses (naming the key) what Qwen3MoeForCausalLM / MixtralForCausalLM cannot hold.
  std::string hf_export_refusal() const override;
  const MoeLmConfig& moe_config() const { return mcfg_; }

 private:
  bool holds_moe(size_t layer);  // layer `layer` has an MoE block this instance holds
  MoeLmConfig mcfg_;
};

// Which layers hold the MoE block: not in mlp_only_layers, (i + 1) a multiple
// of decoder_sparse_step, and i >= first_k_dense_replace.
std::vector<bool> sparse_layers(int64_t layers, int64_t decoder_sparse_step, const std::vector<int64_t>& mlp_only_layers,
                                int64_t first_k_dense_replace);

// A Hugging Face config.json of `model_type` -> our config; throws
// std::runtime_error naming the key it cannot represent.
std::shared_ptr<const MoeLmConfig> config_from_hf(const nlohmann::json& j, const std::string& model_type);

ModelEntry qwen3_moe_entry();
ModelEntry mixtral_entry();
ModelEntry deepseek_v3_entry();

}  // namespace nnstrain::models::moe
