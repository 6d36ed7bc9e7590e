// Building blocks shared by the models, built from a ShardingContext. The
// tensor-parallel ones (column, row, vocab-parallel embedding, parallel LM head)
// allocate only this rank's piece and communicate through the context's TpComm;
// at tp == 1 each is a plain layer (no autograd function, no communication).
//
// Every layer declares, for each parameter it registers, a ParamLayout: how it
// may be split, the global tensor, this rank's blocks of it and its init rule.
// A model's split declaration is derived from these (CausalLM::split_declaration),
// so the layer that computes a split is the only place that states it: the
// declaration cannot drift from what runs.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "models/common/sequence_objective.h"
#include "models/common/sharding.h"

namespace nnstrain::models::common {

// How a fresh parameter is filled. materialise() applies it so that every
// slice is the same at any tp degree (models/common/init.h).
struct InitRule {
  enum class Kind { Normal, Zeros, Ones };
  Kind kind = Kind::Zeros;
  double std = 0.0;
  static InitRule normal(double s) { return {Kind::Normal, s}; }
  static InitRule zeros() { return {Kind::Zeros, 0.0}; }
  static InitRule ones() { return {Kind::Ones, 0.0}; }
};

struct Block {
  std::vector<int64_t> offsets, shape;  // a rectangle of the global tensor
};

class ShardedModule;

// What a model converter attaches to a linear layer (LoRA, models/lora/): the
// weight the layer computes with (a quantized base dequantized; by default the
// stored one) and a term added to its output. A column-parallel layer hands
// delta() its input as it arrives (replicated, or this rank's tokens under
// sequence parallelism) and adds this rank's output columns; a row-parallel one
// hands it this rank's input columns and adds a partial output, reduced over
// the group with its own. An undefined delta adds nothing (adapters off).
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  virtual at::Tensor weight(const at::Tensor& stored) const { return stored; }
  // The base's own `x W^T + b`, where the adapter computes it itself (QLoRA:
  // dequantized again in backward instead of kept); undefined: the layer's.
  virtual at::Tensor linear(const at::Tensor& x, const at::Tensor& bias) const { return {}; }
  virtual at::Tensor delta(const at::Tensor& x) = 0;
};

// One parameter as its layer declares it.
struct ParamLayout {
  std::string name;                   // as in named_parameters() once collected; layer-local before
  ParamSplit split;                   // how it may be split (Replicate: never)
  std::vector<int64_t> global_shape;  // the global tensor (the true vocabulary, never padded)
  std::vector<Block> blocks;          // this rank's blocks, stacked along dim 0 in local storage
  std::vector<int64_t> local_shape;   // the local tensor: the blocks' rows, then padding rows (zero)
  InitRule init;
  ShardedModule* owner = nullptr;
  bool split_here() const { return blocks.size() != 1 || blocks[0].shape != global_shape; }
};

// A module whose own parameters carry layouts and can be swapped for
// materialised tensors (they are built on meta).
class ShardedModule : public torch::nn::Module {
 public:
  virtual std::vector<ParamLayout> layouts() const = 0;
  // Replaces this module's parameter `name` (layer-local) by `t`, which must
  // have the local shape; t becomes a leaf requiring grad.
  void replace_parameter(const std::string& name, at::Tensor t);
  // A frozen parameter (LoRA's base): kept as a buffer of the same name, out of
  // named_parameters() and so out of param_layouts() and the training state.
  void freeze_parameter(const std::string& name);

 protected:
  // Registers a parameter of `layout.local_shape` on `opts`: empty on meta,
  // else filled by the init rule from the global generator (standalone use).
  at::Tensor add_param(const ParamLayout& layout, const c10::TensorOptions& opts);
  virtual void rebind() = 0;  // refresh member handles after replace_parameter
};

// Sequence parallelism's entry into the sequence-sharded region for a
// replicated [1 or batch, T, ..] tensor: this rank's tokens of it broadcast to
// `batch` (identity without it).
torch::Tensor to_sequence_shard(const ShardingContext& ctx, const torch::Tensor& x, int64_t batch);
// Dropout in the sequence-sharded region: under sequence parallelism each rank's
// tokens draw their own masks (the model-parallel RNG), else plain dropout.
torch::Tensor region_dropout(const ShardingContext& ctx, const torch::Tensor& x, double p, bool training);

// Layouts of a parameter every rank holds whole, and of a split one.
ParamLayout replicated_layout(const std::string& name, std::vector<int64_t> shape, InitRule init);
// Column split (dim 0) of `shape`, each fused part on its own; vocab split with
// `padded_rows` local rows (>= the true rows this rank holds); row split (dim 1).
ParamLayout column_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape,
                          std::vector<int64_t> parts, int64_t unit, InitRule init);
ParamLayout row_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape,
                       int64_t unit, InitRule init);
// Stacked expert weights [E, ...]: this rank's E / ctx.ep whole experts (dim 0),
// replicated over tensor-parallel ranks. Throws naming `name` unless ep divides E.
ParamLayout expert_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape,
                          InitRule init);

// y = x W^T + b, W [out, in], replicated.
class LinearImpl : public ShardedModule {
 public:
  LinearImpl(int64_t in, int64_t out, bool bias, InitRule init = InitRule::normal(0.02),
             const c10::TensorOptions& opts = {});
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight, bias;  // bias undefined when disabled
  std::shared_ptr<LinearAdapter> adapter;  // null: none

 private:
  void rebind() override;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(Linear);

// Megatron's column-parallel linear: W's output rows split (each fused part on
// its own, in whole `unit`s), output left split; the input's gradient is
// all-reduced over the group in backward.
class ColumnParallelLinearImpl : public ShardedModule {
 public:
  ColumnParallelLinearImpl(const ShardingContext& ctx, int64_t in, std::vector<int64_t> out_parts, int64_t unit,
                           bool bias, InitRule init);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  int64_t local_out() const { return weight.size(0); }
  torch::Tensor weight, bias;
  std::shared_ptr<LinearAdapter> adapter;  // null: none

 private:
  void rebind() override;
  ShardingContext ctx_;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(ColumnParallelLinear);

// Megatron's row-parallel linear: W's input columns split, partial outputs
// all-reduced over the group, then the (replicated) bias added.
class RowParallelLinearImpl : public ShardedModule {
 public:
  RowParallelLinearImpl(const ShardingContext& ctx, int64_t in, int64_t out, int64_t unit, bool bias, InitRule init);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight, bias;
  std::shared_ptr<LinearAdapter> adapter;  // null: none

 private:
  void rebind() override;
  ShardingContext ctx_;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(RowParallelLinear);

class EmbeddingImpl : public ShardedModule {
 public:
  EmbeddingImpl(int64_t num, int64_t dim, InitRule init = InitRule::normal(0.02), const c10::TensorOptions& opts = {});
  torch::Tensor forward(const torch::Tensor& idx);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight;

 private:
  void rebind() override;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(Embedding);

// Rows of the vocabulary split over the group: each rank looks up the ids it
// holds, zeros for the others, and the partial embeddings are all-reduced.
class VocabParallelEmbeddingImpl : public ShardedModule {
 public:
  VocabParallelEmbeddingImpl(const ShardingContext& ctx, int64_t vocab, int64_t dim, InitRule init);
  torch::Tensor forward(const torch::Tensor& idx);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  int64_t vocab_start() const { return start_; }
  torch::Tensor weight;  // [vocab / tp, dim]

 private:
  void rebind() override;
  ShardingContext ctx_;
  int64_t start_ = 0;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(VocabParallelEmbedding);

// LayerNorm with an optional bias (nanoGPT's `bias` option; LibTorch's has both or neither).
class LayerNormImpl : public ShardedModule {
 public:
  LayerNormImpl(int64_t dim, bool bias, double eps = 1e-5, const c10::TensorOptions& opts = {});
  LayerNormImpl(int64_t dim, bool bias, double eps, const ShardingContext& ctx);  // sequence-parallel aware
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight, bias;
  double eps;

 private:
  void rebind() override;
  std::vector<ParamLayout> layouts_;
  // Under sequence parallelism: the group its weight and bias gradients are summed over.
  c10::intrusive_ptr<TpComm> sp_comm_;
};
TORCH_MODULE(LayerNorm);

class RMSNormImpl : public ShardedModule {
 public:
  RMSNormImpl(int64_t dim, double eps, const c10::TensorOptions& opts = {});
  RMSNormImpl(int64_t dim, double eps, const ShardingContext& ctx);  // sequence-parallel aware
  // unit_offset: Gemma's norm, scaled by (1 + weight) in fp32 and cast back; the weight starts at zero.
  RMSNormImpl(int64_t dim, double eps, const ShardingContext& ctx, bool unit_offset);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight;
  double eps;
  bool unit_offset = false;

 private:
  void rebind() override;
  std::vector<ParamLayout> layouts_;
  c10::intrusive_ptr<TpComm> sp_comm_;  // as LayerNorm's
};
TORCH_MODULE(RMSNorm);

// How the LM head's loss is computed (model.loss): the whole logits, or over
// token chunks with the logits recomputed in backward, or with the gradients
// made in forward (models/common/lm_loss.h).
enum class LossKind { Plain, Chunked, Fused };

// The unsplit LM head and next-token loss on a [vocab, dim] weight.
struct LmHead {
  // Mean cross-entropy of hidden [B, T, C] against targets [B, T]; chunk_size > 0
  // computes it over token chunks, recomputing logits in backward.
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                     int64_t chunk_size = 0) const;
  torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& weight) const;
};

// The LM head over a vocabulary-split weight ([vocab / tp, dim], this rank's
// rows from vocab_start): its own "weight" when `own_weight` (untied), else
// the tied embedding's, passed to loss/logits. The loss is the vocab-parallel
// cross-entropy (plain, chunked or fused over token chunks of chunk_size; the
// int overload: chunked when chunk_size > 0); the full logits are gathered only
// by logits(), for evaluation. At tp == 1: the plain LmHead.
class ParallelLmHeadImpl : public ShardedModule {
 public:
  ParallelLmHeadImpl(const ShardingContext& ctx, int64_t vocab, int64_t dim, bool own_weight, InitRule init);
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                     int64_t chunk_size = 0, int64_t ignore_index = -100) const;
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                     LossKind kind, int64_t chunk_size, int64_t ignore_index = -100) const;
  torch::Tensor logits(const torch::Tensor& hidden, const torch::Tensor& weight) const;
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor weight;  // undefined when tied
  // Gemma's final_logit_softcapping: logits -> tanh(logits / softcap) x softcap
  // (elementwise, so per vocabulary piece too) before the loss, in every loss
  // kind (the chunked and fused ones cap each chunk); 0: none.
  double softcap = 0;
  // Set: loss() is this objective's over whole sequences (preference
  // alignment), from every position's plain log-likelihood whatever `kind`
  // (the logits exist whole, [tokens, vocab / tp]).
  std::shared_ptr<SequenceObjective> objective;

 private:
  torch::Tensor uncapped_logits(const torch::Tensor& hidden, const torch::Tensor& w) const;
  void rebind() override;
  ShardingContext ctx_;
  int64_t vocab_ = 0, start_ = 0;
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(ParallelLmHead);

// Plain next-token cross-entropy: logits [N, V] float, targets [N]. Mean over N.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace nnstrain::models::common
