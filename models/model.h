// The interface every registered model implements. A model is plain LibTorch
// modules plus declarations: how its layers may be split (for the planner and
// trainer/parallel), how its weights map to Hugging Face names, and its FLOPs.
// Model code holds no collective calls, no YAML and no knowledge of ranks.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/common/layers.h"

namespace nnstrain::models {

// How trainer/parallel may split a parameter over tensor-parallel ranks (Megatron style).
enum class SplitStyle {
  Replicate,  // every rank holds all of it
  Column,     // output features split (dim 0 of a [out, in] weight, and its bias)
  Row,        // input features split (dim 1 of a [out, in] weight; bias replicated)
  Vocab,      // embedding / LM head rows split by vocabulary
};

struct ParamSplit {
  std::string param;        // parameter name as in named_parameters()
  SplitStyle style = SplitStyle::Replicate;
  int64_t unit = 1;         // split only in multiples of this (e.g. head_dim for QKV)
  // Column splits of fused projections (QKV, gate/up): the sizes of the fused
  // parts along dim 0; each part is split separately so every rank gets its slice of each.
  std::vector<int64_t> fused_parts;
};

// One tensor's name in a Hugging Face checkpoint.
struct HfTensor {
  std::string ours;         // our parameter name
  std::string theirs;       // e.g. "transformer.h.0.attn.c_attn.weight"
  bool transpose = false;   // GPT-2's Conv1D stores [in, out]
};

// The shape facts the planner's cost model needs (FLOPs, activation memory).
struct ModelDims {
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, max_seq = 0;
  bool tied_embeddings = true;
};

// Per-run options the trainer or planner sets on a built model.
struct RuntimeOptions {
  std::vector<bool> recompute_layers;  // activation checkpointing per block (empty = none)
  bool chunked_loss = false;           // LM head + loss over token chunks, logits never whole
  int64_t loss_chunk_size = 4096;
};

class CausalLM : public torch::nn::Module {
 public:
  // Mean next-token cross-entropy over every position. idx, targets: [B, T] int64.
  virtual torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets) = 0;
  // Full logits [B, T, vocab] (evaluation, export checks).
  virtual torch::Tensor logits(const torch::Tensor& idx) = 0;

  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_seq_len() const = 0;
  virtual int64_t num_layers() const = 0;
  // Training FLOPs per token (forward + backward) at sequence length T, PaLM-style 6N + attention.
  virtual double flops_per_token(int64_t seq_len) const = 0;

  virtual ModelDims dims() const { return {}; }
  // The output head, for trainer/parallel to install a vocab-parallel loss.
  virtual common::LmHead* output_head() { return nullptr; }
  virtual std::vector<ParamSplit> split_declaration() const { return {}; }
  virtual std::vector<HfTensor> hf_tensors() const { return {}; }
  virtual nlohmann::json hf_config() const { return nlohmann::json::object(); }

  virtual void set_runtime_options(const RuntimeOptions& opts) { runtime_ = opts; }
  const RuntimeOptions& runtime_options() const { return runtime_; }

 protected:
  RuntimeOptions runtime_;
};

}  // namespace nnstrain::models
