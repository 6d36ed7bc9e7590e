// GPT-OSS (transformers' GptOssForCausalLM, model_type gpt_oss) on Llama's
// stack: grouped-query attention with biases on q, k, v and o and a learned
// sink logit per head (models/common/attention_sinks.h), layers alternating
// sliding-window and full attention (layer_types), YaRN rotary scaling, and on
// every layer the MoE block (models/common/moe.h) with a biased softmax top-k
// router (module "router") and biased experts running the clamped SwiGLU
// (swiglu_alpha, swiglu_limit), gate and up interleaved in gate_up_proj as the
// checkpoints store them. Keys are GptOssConfig's; parameter names are
// transformers' (without "model."), so folders load and merge --hf writes them
// back one to one.
#pragma once

#include "models/moe/moe_lm.h"

namespace nnstrain::models::moe {

class GptOss : public MoeLm {
 public:
  using MoeLm::MoeLm;
  std::vector<HfTensor> hf_tensors() const override;
  nlohmann::json hf_config() const override;
  std::string hf_export_refusal() const override { return {}; }
};

// A GptOssConfig config.json -> our config; throws std::runtime_error naming the key.
std::shared_ptr<const MoeLmConfig> gpt_oss_config_from_hf(const nlohmann::json& j);

ModelEntry gpt_oss_entry();

}  // namespace nnstrain::models::moe
