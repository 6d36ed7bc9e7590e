// LoRA's adapter math on the typed linear layers (models/common/layers.h):
// y = W x + scale * B (A dropout(x)), A [r, in], B [out, r], split over the
// tensor-parallel group the way the base layer splits (docs/lora.md):
//   column-parallel (out split): A whole, B this rank's output rows;
//   row-parallel (in split): A this rank's input columns, B whole.
// The replicated matrix of the pair receives a partial gradient on each rank
// (its rank's rows or columns of the product), summed over the group in
// backward by one small all-reduce of its own gradient; the row-parallel term
// joins the base layer's partial output before the layer's own reduction, so
// forward adds no collective (under sequence parallelism a column-parallel
// adapter gathers its r-wide hidden, not the input).
//
// Nothing here knows peft or a config: trainer/lora/ decides where adapters go,
// fills them and keeps them in the training state.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "models/common/layers.h"
#include "models/lora/nf4.h"

namespace nnstrain::models::lora {

// One matrix of an adapter, as a layer that declares its layout (so the
// training state, ShardSpecs, ZeRO and checkpoints treat it as any parameter).
class LoraWeightImpl : public common::ShardedModule {
 public:
  LoraWeightImpl(common::ParamLayout layout, const c10::TensorOptions& opts);
  std::vector<common::ParamLayout> layouts() const override { return {layout_}; }
  const common::ParamLayout& layout() const { return layout_; }
  torch::Tensor weight;

 private:
  void rebind() override;
  common::ParamLayout layout_;
};
TORCH_MODULE(LoraWeight);

enum class BaseKind { Plain, Column, Row };

// While one of these lives (process-wide, nestable) every adapter adds nothing
// and a quantized base still dequantizes: the model is its frozen base (the
// reference model of preference training, issue 54).
class AdaptersOff {
 public:
  AdaptersOff();
  ~AdaptersOff();
  AdaptersOff(const AdaptersOff&) = delete;
  AdaptersOff& operator=(const AdaptersOff&) = delete;
  static bool active();
};

struct AdapterShape {
  BaseKind kind = BaseKind::Plain;
  int64_t r = 8;
  double scale = 1.0;    // alpha / r, or alpha / sqrt(r) (rsLoRA)
  double dropout = 0.0;
};

class LoraAdapter : public common::LinearAdapter {
 public:
  // base_weight: the base layer's weight layout (global [out, in], this rank's blocks).
  LoraAdapter(const AdapterShape& shape, const common::ShardingContext& ctx, const common::ParamLayout& base_weight,
              const c10::TensorOptions& opts);
  at::Tensor weight(const at::Tensor& stored) const override;
  // QLoRA: x W^T + b with W dequantized in forward and again in backward for
  // x's gradient, so no layer's dequantized weight lives from forward to
  // backward (W is frozen: it needs no gradient). Undefined unless quantized.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& bias) const override;
  at::Tensor delta(const at::Tensor& x) override;
  at::Tensor dropout_mask(const at::Tensor& x) const;  // lora.dropout's, drawn as one process would

  // Fills A and B as one process would (global tensors drawn from `seed`, this
  // rank's slices kept): A Kaiming-uniform (a = sqrt(5), peft's default) or
  // normal(0, 1 / r) (gaussian); B zero.
  void init(const std::string& kind, uint64_t seed);
  // QLoRA: the base weight's NF4 form replaces it in compute (weight()).
  void set_quantized(Nf4Tensor q, c10::ScalarType compute) { quantized_ = std::move(q), compute_ = compute; }
  bool quantized() const { return quantized_.codes.defined(); }
  const Nf4Tensor& nf4() const { return quantized_; }

  const AdapterShape& shape() const { return shape_; }
  LoraWeight A{nullptr}, B{nullptr};

 private:
  AdapterShape shape_;
  common::ShardingContext ctx_;
  Nf4Tensor quantized_;
  c10::ScalarType compute_ = c10::kFloat;
};

// The rectangle(s) `l` holds of a global tensor, as its local tensor (blocks stacked along dim 0):
// an adapter's piece of a whole peft tensor, or a base weight's of a whole Hugging Face one.
at::Tensor local_piece(const at::Tensor& global, const common::ParamLayout& l);

}  // namespace nnstrain::models::lora
