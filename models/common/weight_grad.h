// The zero-bubble split backward (docs/parallelism.md, "Split backward"): the
// pipeline's I computes the gradient of a stage's input, its W later the
// weights' gradients, without running the chain again. As the zero-bubble
// paper's Megatron implementation does: the models' linear layers go through
// deferrable_linear() below, whose backward, inside a capture, computes dX = dY W now
// and leaves (X, dY) in a WeightGradStore; W then makes dW = dY^T X (and the
// bias's sum of dY) from it. Everything else (norms, the embedding, a fused or
// chunked loss head) takes its gradient in I: small, or no matmul to defer.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace nnstrain::models::common {

// What deferred linears left for one (stage, micro-batch)'s W.
class WeightGradStore {
 public:
  struct Entry {
    at::Tensor weight, bias;          // the parameters (bias undefined: none, or added outside)
    std::function<at::Tensor()> input;  // the layer's input as [tokens, in] (may gather it: sequence parallelism)
    at::Tensor grad_output;           // dY as [tokens, out]
  };
  void add(Entry e) { entries_.push_back(std::move(e)); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // W: every entry's weight (and bias) gradient, accumulated into the
  // parameters' .grad through their autograd accumulators (so gradient hooks
  // run as in a whole backward); then the store is empty.
  void flush();

 private:
  std::vector<Entry> entries_;
};

// While one of these lives (process-wide: the autograd engine runs CUDA
// backward on its own threads), the layers build their linears as deferrable
// autograd functions; outside, deferrable_linear() is torch's. Set it around a forward
// whose backward will be split (a pipeline stage's F; a recomputed block's
// second forward runs in I, inside the same scope).
class SplitLinears {
 public:
  SplitLinears();
  ~SplitLinears();
  SplitLinears(const SplitLinears&) = delete;
  SplitLinears& operator=(const SplitLinears&) = delete;
  static bool active();
};

// While one of these lives, a deferrable linear's backward computes only the
// input's gradient and leaves its weight's work in `store` (the pipeline's I).
// Outside, it computes both (a whole backward).
class CaptureWeightGrads {
 public:
  explicit CaptureWeightGrads(WeightGradStore& store);
  ~CaptureWeightGrads();
  CaptureWeightGrads(const CaptureWeightGrads&) = delete;
  CaptureWeightGrads& operator=(const CaptureWeightGrads&) = delete;
  static WeightGradStore* current();

 private:
  WeightGradStore* previous_;
};

// y = x W^T + b (bias may be undefined), torch's linear; deferrable while
// SplitLinears is active.
at::Tensor deferrable_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// The weight gradient of a linear: dW = dY^T X as autograd's linear backward
// computes it (so a split and a whole backward agree bit for bit).
at::Tensor linear_weight_grad(const at::Tensor& grad_output_2d, const at::Tensor& input_2d);

}  // namespace nnstrain::models::common
