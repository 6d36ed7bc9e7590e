// The interface every registered model implements. A model is built from its
// config and a ShardingContext (models/common/sharding.h) out of the typed
// layers of models/common/layers.h, usually on the meta device, then
// materialised (models/common/init.h). It declares how its weights map to
// Hugging Face names and its FLOPs; how it may be split is what its layers
// declare. Model code holds no collective calls, no YAML and no knowledge of ranks.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/common/block_runner.h"
#include "models/common/context_attention.h"
#include "models/common/kv_cache.h"
#include "models/common/layers.h"
#include "models/model_dims.h"

namespace nnstrain::models {

// One tensor's name in a Hugging Face checkpoint.
struct HfTensor {
  std::string ours;         // our parameter name
  std::string theirs;       // e.g. "transformer.h.0.attn.c_attn.weight"
  bool transpose = false;   // GPT-2's Conv1D stores [in, out]
  // >= 0: `theirs` is one expert of a stacked [E, ...] parameter, ours[expert]
  // (MoE checkpoints name each expert's weights on their own); one entry per expert.
  int64_t expert = -1;
  // >= 0: ours is rows [fused_offset, fused_offset + its rows) of `theirs`, a
  // tensor Hugging Face fuses from several of ours (Phi-3's qkv_proj and
  // gate_up_proj): split on import, concatenated again by merge --hf.
  int64_t fused_offset = -1;
};

// State outside the parameters that Hugging Face checkpoints hold too
// (DeepSeek-V3's router selection bias, `e_score_correction_bias`): its name in
// nnstrain's checkpoints, its Hugging Face name, and the tensor itself
// (model.init_from fills it in place; merge --hf writes it under `theirs`).
struct HfBuffer {
  std::string ours;    // e.g. "moe/layers.1.mlp.expert_bias"
  std::string theirs;  // e.g. "model.layers.1.mlp.gate.e_score_correction_bias"
  at::Tensor tensor;
};

// Per-run options the trainer or planner sets on a built model.
struct RuntimeOptions {
  std::vector<bool> recompute_layers;  // activation checkpointing per block (empty = none)
  // The LM head's loss (model.loss): plain, or over token chunks of
  // loss_chunk_size (chunked: logits recomputed in backward; fused: gradients made in forward).
  common::LossKind loss = common::LossKind::Plain;
  int64_t loss_chunk_size = 4096;
  std::shared_ptr<common::BlockHooks> block_hooks;  // the trainer's, around every block (ZeRO-3)
};

// Packed documents (dataset document_mask): per token, [B, T] int64, its position
// within its document and its document's number within the sample. Undefined:
// one document per sample, positions 0..T-1. Under context parallelism
// positions are this rank's tokens' and segments the whole sequence's.
struct Documents {
  torch::Tensor positions, segments;
  bool defined() const { return segments.defined(); }
  // For scaled_dot_product_attention: [B, 1, T, T] bool, true where query i may
  // attend key j (j <= i, same document): block-diagonal causal.
  torch::Tensor attention_mask() const { return common::document_causal_mask(segments); }
  // What attention layers take: the segments themselves ([B, T]: masked by
  // tiles in common::document_attention and context-parallel attention, which
  // skip what is masked) when by_tiles, else the dense attention_mask().
  torch::Tensor attention_input(bool by_tiles) const { return by_tiles ? segments : attention_mask(); }
};

// One Mixture-of-Experts layer's statistics since the trainer last took them
// (CausalLM::take_moe_stats): forwards that build the graph (training), each
// micro-batch once (a recomputed forward does not count again).
struct MoeStats {
  std::string layer;                       // its module, e.g. "layers.3.mlp"
  std::vector<int64_t> tokens_per_expert;  // this rank's kept assignments per global expert
  int64_t dropped = 0;                     // assignments dropped by capacity_factor
  // Balancing losses added (coefficients applied), summed: a scalar on the
  // model's device, read by the trainer only when it logs (no host sync per step); undefined: none.
  at::Tensor aux_loss;
  // DeepSeek-V3's aux-loss-free balancing: the router's selection bias [E]
  // (undefined: none) and its speed; the trainer updates it in place after
  // each step from the load summed over the data-parallel ranks.
  at::Tensor expert_bias;
  double bias_update_speed = 0;
  // Sequence parallelism: each tensor-parallel rank routed its own 1/tp of the
  // tokens, so the counts (and drops) are summed over the tp group too.
  bool tokens_split_over_tp = false;
};

class CausalLM : public torch::nn::Module {
 public:
  // Mean next-token cross-entropy over every position whose target is not -100.
  // idx, targets: [B, T] int64.
  virtual torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) = 0;
  // The same with attention kept within documents and positions restarting at
  // each (a model without it refuses defined `docs`).
  virtual torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const Documents& docs) {
    TORCH_CHECK(!docs.defined(), "this model does not support document masking (dataset document_mask)");
    return loss(idx, targets);
  }
  // Full logits [B, T, vocab] (evaluation, export checks).
  virtual torch::Tensor logits(const torch::Tensor& idx) = 0;

  // Pipeline parallelism runs the model in pieces, in this order: embed (the
  // tokens to the first block's input), blocks [begin, end), head_loss (the
  // final norm, the LM head and loss()'s loss). loss(idx, targets, docs) is
  // exactly head_loss(blocks(embed(idx, docs), 0, num_layers(), T, docs), targets);
  // seq_len is idx's T (a block's input holds fewer tokens under sequence
  // parallelism). Models without them refuse pipeline parallelism.
  virtual torch::Tensor embed(const torch::Tensor& idx, const Documents& docs);
  virtual torch::Tensor blocks(const torch::Tensor& x, int64_t begin, int64_t end, int64_t seq_len,
                               const Documents& docs);
  virtual torch::Tensor head_loss(const torch::Tensor& h, const torch::Tensor& targets);
  // The final norm and the LM head's logits [B, T, vocab] of the last block's
  // output: logits(idx) is head_logits(blocks(embed(idx, {}), 0, num_layers(), T, {}))
  // (the pipeline's last stage in evaluation, trainer/eval/).
  virtual torch::Tensor head_logits(const torch::Tensor& h);
  // Parameters outside the head that head_loss reads (a head tied to the token embedding).
  virtual std::vector<std::string> head_ties() const { return {}; }
  // The LM head loss() ends in (the trainer sets a sequence objective on it,
  // trainer/align/); null: the model has none and cannot be aligned.
  virtual common::ParallelLmHeadImpl* lm_head_module() { return nullptr; }

  // What this instance holds (pipeline parallelism: a rank's stages): the
  // parameters before the blocks (embed), some blocks, those after (head) and
  // head_ties() with the head. The rest stay on meta and are left out of
  // param_layouts(), so nothing materialises, trains or saves them here.
  struct HeldPieces {
    bool embed = true, head = true;
    std::vector<bool> blocks;  // per block; empty: every block
  };
  void hold_only(const HeldPieces& pieces);
  bool holds(const std::string& param_name) const;
  // The parameters `pieces` cover, in registration order.
  std::vector<std::string> params_of(const HeldPieces& pieces) const;

  // Incremental decoding (generation; no dropout, no tensor parallelism): logits
  // [B, T, vocab] of new tokens idx [B, T] at positions cache.length().., each
  // attending to the cached tokens and the new ones before it; appends their
  // keys and values to the cache. Equal to logits() on the whole sequence at
  // those positions. Models without it throw.
  virtual torch::Tensor decode_logits(const torch::Tensor& idx, common::KvCache& cache);
  // Whether generation must rebuild the cache from the whole sequence before
  // decoding to `length` tokens from `cached` ones, as transformers does for
  // the model (Phi-3: once, when the sequence first passes
  // original_max_position_embeddings and its rope switches to the long factors).
  virtual bool rebuild_cache(int64_t cached, int64_t length) const { return false; }

  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_seq_len() const = 0;
  virtual int64_t num_layers() const = 0;
  // Training FLOPs per token (forward + backward) at sequence length T, PaLM-style 6N + attention.
  virtual double flops_per_token(int64_t seq_len) const = 0;

  virtual ModelDims dims() const { return {}; }
  // Mixture-of-Experts layers' statistics since the last call, reset by it (none: a dense model).
  virtual std::vector<MoeStats> take_moe_stats() { return {}; }
  // The gradient the current micro-batch's mean LM loss receives in backward
  // (the trainer's weight of it x the loss scale), for a pipeline stage that
  // does not compute that loss; set before the stage's backward. MoE balancing
  // losses are scaled by it (models/common/moe.h); dense models ignore it.
  virtual void set_loss_grad(const at::Tensor& g) {}
  // Every parameter as its layer declares it (split, global shape, this rank's
  // blocks, init), in named_parameters() order. Throws if a parameter does not
  // belong to a layer that declares it.
  std::vector<common::ParamLayout> param_layouts() const;
  // How the model may be split: the non-replicated entries of param_layouts().
  // Derived from the layers that compute the splits, so it cannot drift from them.
  std::vector<ParamSplit> split_declaration() const;
  virtual std::vector<HfTensor> hf_tensors() const { return {}; }
  virtual std::vector<HfBuffer> hf_buffers() { return {}; }
  virtual nlohmann::json hf_config() const { return nlohmann::json::object(); }
  // Why the architecture hf_config() names cannot represent this model (merge
  // --hf refuses, naming it); empty: it can.
  virtual std::string hf_export_refusal() const { return {}; }

  virtual void set_runtime_options(const RuntimeOptions& opts) { runtime_ = opts; }
  const RuntimeOptions& runtime_options() const { return runtime_; }
  // The name of the module list holding the transformer blocks ("h.3.attn..."
  // is block 3's): ZeRO-3 makes each block one unit of parameters.
  virtual std::string blocks_name() const = 0;
  // The block a parameter belongs to ("h.3.attn.c_attn.weight" -> 3), -1 outside the blocks.
  int block_of(const std::string& param_name) const;

 protected:
  // Block i of the model's stack, as the runtime options say (recompute, hooks).
  torch::Tensor run_block(size_t i, const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                          const torch::Tensor& x, common::ParallelRng* rng) {
    const auto& r = runtime_.recompute_layers;
    return common::run_block(i, fn, x, i < r.size() && r[i] && is_training(), runtime_.block_hooks.get(), rng);
  }

  RuntimeOptions runtime_;

 private:
  std::optional<std::vector<std::string>> held_;  // sorted; none: everything
};

}  // namespace nnstrain::models
