#include "models/common/weight_grad.h"

#include <torch/torch.h>

#include <atomic>
#include <map>

namespace nnstrain::models::common {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int> split_depth{0};
std::atomic<WeightGradStore*> capture{nullptr};

at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// torch's linear, with a backward that leaves the weight's work to W while a
// capture is active. The parameters ride in saved_data (leaves: no cycle) so
// W can accumulate into them; only x goes through save_for_backward.
struct DeferrableLinear : torch::autograd::Function<DeferrableLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    const bool has_bias = bias.numel() > 0;
    ctx->save_for_backward({x});
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = bias;
    return torch::nn::functional::linear(x, weight, has_bias ? bias : at::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto x = ctx->get_saved_variables()[0];
    const auto weight = ctx->saved_data["weight"].toTensor();
    auto bias = ctx->saved_data["bias"].toTensor();
    const bool has_bias = bias.numel() > 0;
    const auto& dy = g[0];
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) dx = dy.matmul(weight);
    if (auto* store = CaptureWeightGrads::current()) {
      store->add({weight, has_bias ? bias : at::Tensor(), [x2 = rows(x)] { return x2; }, rows(dy)});
      return {dx, at::Tensor(), at::Tensor()};
    }
    const auto dy2 = rows(dy);
    at::Tensor dw, db;
    if (ctx->needs_input_grad(1)) dw = linear_weight_grad(dy2, rows(x));
    if (has_bias && ctx->needs_input_grad(2)) db = dy2.sum(0);
    return {dx, dw, db};
  }
};

}  // namespace

SplitLinears::SplitLinears() { ++split_depth; }
SplitLinears::~SplitLinears() { --split_depth; }
bool SplitLinears::active() { return split_depth.load() > 0; }

CaptureWeightGrads::CaptureWeightGrads(WeightGradStore& store) : previous_(capture.exchange(&store)) {}
CaptureWeightGrads::~CaptureWeightGrads() { capture.store(previous_); }
WeightGradStore* CaptureWeightGrads::current() { return capture.load(); }

at::Tensor linear_weight_grad(const at::Tensor& grad_output_2d, const at::Tensor& input_2d) {
  return grad_output_2d.t().mm(input_2d);
}

at::Tensor deferrable_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!SplitLinears::active() || !torch::GradMode::is_enabled() || !weight.requires_grad())
    return torch::nn::functional::linear(x, weight, bias);
  // An undefined tensor cannot enter an autograd function: no bias is an empty one.
  return DeferrableLinear::apply(x, weight, bias.defined() ? bias : at::empty({0}, weight.options()));
}

void WeightGradStore::flush() {
  if (entries_.empty()) return;
  // One gradient per parameter (a weight used twice sums), then one pass of
  // the engine over the accumulators: what a whole backward's last step does.
  std::vector<at::Tensor> params, grads;
  std::map<const void*, size_t> slot;
  auto add = [&](const at::Tensor& p, at::Tensor g) {
    auto [it, fresh] = slot.emplace(p.unsafeGetTensorImpl(), params.size());
    if (fresh) {
      params.push_back(p);
      grads.push_back(std::move(g));
    } else {
      grads[it->second] = grads[it->second] + g;
    }
  };
  {
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      add(e.weight, linear_weight_grad(e.grad_output, e.input()));
      if (e.bias.defined()) add(e.bias, e.grad_output.sum(0));
    }
  }
  entries_.clear();
  torch::autograd::backward(params, grads);
}

}  // namespace nnstrain::models::common
