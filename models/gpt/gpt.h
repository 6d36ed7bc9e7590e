// nanoGPT's GPT: token + position embeddings, pre-LayerNorm blocks with causal
// self-attention and a GELU MLP, LM head tied to the token embedding. Under
// context parallelism (ShardingContext::cp_comm) a rank holds its tokens of each
// sequence: attention is context_parallel_attention and the learned position
// embedding takes the tokens' global positions.
#pragma once

#include "models/common/layers.h"
#include "models/common/parallel_rng.h"
#include "models/model.h"
#include "models/registry.h"

namespace nnstrain::models::gpt {

struct GptConfig : config::ModelConfig {
  int64_t vocab_size = 50304;
  int64_t block_size = 1024;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double dropout = 0.0;
  bool bias = true;
  std::pair<std::string, double> attention_dropout() const override { return {"dropout", dropout}; }
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const GptConfig& cfg, const common::ShardingContext& ctx);
  // mask: Documents::attention_mask() (undefined: causal over the whole sequence).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask = {});
  // Generation: attention of the new tokens over the cache (block `layer`'s entry), no dropout.
  torch::Tensor forward_cached(const torch::Tensor& x, common::KvCache& cache, size_t layer);
  common::ColumnParallelLinear c_attn{nullptr};  // Q, K, V: this rank's heads of each
  common::RowParallelLinear c_proj{nullptr};
  int64_t head_dim, heads;  // heads: this rank's
  double dropout;
  common::ShardingContext ctx;  // its rng: attention dropout on this rank's heads (tp > 1)
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const GptConfig& cfg, const common::ShardingContext& ctx);
  torch::Tensor forward(const torch::Tensor& x);
  common::ColumnParallelLinear c_fc{nullptr};
  common::RowParallelLinear c_proj{nullptr};
  double dropout;
  common::ShardingContext ctx;
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& cfg, const common::ShardingContext& ctx);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask = {});
  torch::Tensor forward_cached(const torch::Tensor& x, common::KvCache& cache, size_t layer);
  common::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

class Gpt : public CausalLM {
 public:
  // Parameters on ctx.options (meta: materialise them, models/common/init.h).
  explicit Gpt(const GptConfig& cfg, const common::ShardingContext& ctx = {});
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) override;
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const Documents& docs) override;
  torch::Tensor logits(const torch::Tensor& idx) override;
  torch::Tensor decode_logits(const torch::Tensor& idx, common::KvCache& cache) override;
  torch::Tensor embed(const torch::Tensor& idx, const Documents& docs) override;
  torch::Tensor blocks(const torch::Tensor& x, int64_t begin, int64_t end, int64_t seq_len,
                       const Documents& docs) override;
  torch::Tensor head_loss(const torch::Tensor& h, const torch::Tensor& targets) override;
  torch::Tensor head_logits(const torch::Tensor& h) override;
  std::vector<std::string> head_ties() const override { return {"wte.weight"}; }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_seq_len() const override { return cfg_.block_size; }
  int64_t num_layers() const override { return cfg_.n_layer; }
  std::string blocks_name() const override { return "h"; }
  double flops_per_token(int64_t seq_len) const override;
  ModelDims dims() const override;
  std::vector<HfTensor> hf_tensors() const override;
  nlohmann::json hf_config() const override;

  common::VocabParallelEmbedding wte{nullptr};
  common::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  common::LayerNorm ln_f{nullptr};
  common::ParallelLmHead lm_head{nullptr};  // weight tied to wte (not a module of its own)
  common::ParallelLmHeadImpl* lm_head_module() override { return lm_head.get(); }

 private:
  torch::Tensor hidden(const torch::Tensor& idx, const Documents& docs = {});
  GptConfig cfg_;
  common::ShardingContext ctx_;
};

ModelEntry registry_entry();

}  // namespace nnstrain::models::gpt
