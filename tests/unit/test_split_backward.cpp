// The zero-bubble split backward (models/common/weight_grad.h): I and then W
// give the whole backward's gradients, and W runs only the weights' matmuls:
// I's and W's matmul FLOPs add up to the whole backward's, counted op by op
// (ATen's RecordFunction), with and without recompute, on GPT (tied head) and
// Llama (untied).
#include <ATen/record_function.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <string>

#include "models/common/weight_grad.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "tests/unit/tiny_models.h"

using nnstrain::models::CausalLM;
using nnstrain::models::RuntimeOptions;
namespace common = nnstrain::models::common;
using nnstrain::testing::tiny_llama;

namespace {

// Matmul FLOPs of the ATen ops run while one of these lives (2 n k m per
// [n, k] x [k, m]; batched ones times the batch).
class MatmulFlops {
 public:
  MatmulFlops() {
    flops_ = 0;
    ops_ = 0;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&MatmulFlops::on_enter).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  ~MatmulFlops() { at::removeCallback(handle_); }
  double flops() const { return flops_.load(); }
  int ops() const { return ops_.load(); }

 private:
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    const bool mm = name == "aten::mm", addmm = name == "aten::addmm", bmm = name == "aten::bmm",
               baddbmm = name == "aten::baddbmm";
    if (!(mm || addmm || bmm || baddbmm)) return nullptr;
    const auto in = fn.inputs();
    const auto& a = in[addmm || baddbmm ? 1 : 0].toTensor();
    const auto& b = in[addmm || baddbmm ? 2 : 1].toTensor();
    double f = 2.0 * double(a.size(-2)) * double(a.size(-1)) * double(b.size(-1));
    if (bmm || baddbmm) f *= double(a.size(0));
    double old = flops_.load();
    while (!flops_.compare_exchange_weak(old, old + f)) {
    }
    ++ops_;
    return nullptr;
  }
  static inline std::atomic<double> flops_{0};
  static inline std::atomic<int> ops_{0};
  at::CallbackHandle handle_;
};

std::map<std::string, torch::Tensor> grads_of(CausalLM& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    REQUIRE(p.value().grad().defined());
    out[p.key()] = p.value().grad().clone();
  }
  return out;
}

struct Counts {
  double b = 0, i = 0, w = 0, w_expected = 0;
  int w_ops = 0;
  size_t deferred = 0;
  std::map<std::string, torch::Tensor> whole, split;
};

// The same step twice: a whole backward, then I (a capture) and W (flush).
Counts split_vs_whole(CausalLM& m, const torch::Tensor& idx, const torch::Tensor& targets) {
  Counts c;
  m.zero_grad();
  auto loss = m.loss(idx, targets);
  {
    MatmulFlops count;
    loss.backward();
    c.b = count.flops();
  }
  c.whole = grads_of(m);

  m.zero_grad();
  common::WeightGradStore store;
  {
    common::SplitLinears split;  // the forward builds deferrable linears
    loss = m.loss(idx, targets);
    MatmulFlops count;
    common::CaptureWeightGrads capture(store);
    loss.backward();
    c.i = count.flops();
  }
  c.deferred = store.size();
  {
    MatmulFlops count;
    store.flush();
    c.w = count.flops();
    c.w_ops = count.ops();
  }
  c.split = grads_of(m);
  return c;
}

// The weight-gradient matmuls of a model's deferred linears: 2 x tokens x in x out each.
double weight_flops(CausalLM& m, int64_t tokens) {
  double f = 0;
  for (const auto& p : m.named_parameters())
    if (p.value().dim() == 2 && p.key().find("wte") == std::string::npos &&
        p.key().find("embed_tokens") == std::string::npos && p.key().find("wpe") == std::string::npos)
      f += 2.0 * double(tokens) * double(p.value().numel());
  return f;
}

void check(const Counts& c, double w_expected, size_t linears) {
  INFO("matmul FLOPs: whole backward " << c.b << ", I " << c.i << ", W " << c.w << " in " << c.w_ops << " ops");
  CHECK(c.deferred == linears);
  // W is the weights' matmuls and nothing else: one per deferred linear, their FLOPs.
  CHECK(c.w_ops == static_cast<int>(linears));
  CHECK(c.w == Approx(w_expected).epsilon(1e-12));
  // I + W cost what the whole backward costs: W re-ran no part of the chain.
  CHECK(c.i + c.w == Approx(c.b).epsilon(1e-12));
  CHECK(c.i < c.b);
  for (const auto& [name, g] : c.whole) {
    INFO(name);
    CHECK(torch::equal(c.split.at(name), g));  // the same matmuls in the same order: bit for bit
  }
}

nnstrain::models::gpt::GptConfig tiny_gpt() {
  nnstrain::models::gpt::GptConfig cfg;
  cfg.vocab_size = 64;
  cfg.block_size = 16;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 32;
  cfg.dropout = 0.0;
  return cfg;
}

}  // namespace

TEST_CASE("split backward: GPT (tied head) gets the whole backward's gradients, W only the weights' matmuls",
          "[split_backward]") {
  for (bool recompute : {false, true}) {
    INFO("recompute " << recompute);
    torch::manual_seed(0);
    nnstrain::models::gpt::Gpt m(tiny_gpt());
    RuntimeOptions opts;
    if (recompute) opts.recompute_layers = {true, true};
    m.set_runtime_options(opts);
    const auto idx = torch::randint(64, {2, 16}), targets = torch::randint(64, {2, 16});
    const auto c = split_vs_whole(m, idx, targets);
    // Per block c_attn, attn c_proj, c_fc, mlp c_proj; and the head on the tied wte.
    const double head = 2.0 * 32 * 64 * 32;
    check(c, weight_flops(m, 32) + head, 2 * 4 + 1);
  }
}

TEST_CASE("split backward: Llama, with and without recompute", "[split_backward]") {
  for (bool recompute : {false, true}) {
    INFO("recompute " << recompute);
    torch::manual_seed(0);
    nnstrain::models::llama::Llama m(tiny_llama());
    RuntimeOptions opts;
    if (recompute) opts.recompute_layers = {true, false, true};
    m.set_runtime_options(opts);
    const auto idx = torch::randint(80, {2, 20}), targets = torch::randint(80, {2, 20});
    const auto c = split_vs_whole(m, idx, targets);
    // q, k, v, o, gate, up, down per layer, and the untied lm_head.
    check(c, weight_flops(m, 40), 3 * 7 + 1);
  }
}

TEST_CASE("outside a capture a deferrable linear's backward is whole", "[split_backward]") {
  torch::manual_seed(1);
  common::Linear lin(6, 4, true);
  const auto x = torch::randn({3, 6});
  lin(x).pow(2).sum().backward();
  const auto gw = lin->weight.grad().clone(), gb = lin->bias.grad().clone();
  lin->zero_grad();
  common::SplitLinears split;
  lin(x).pow(2).sum().backward();  // no capture: dW and db now
  CHECK(torch::equal(lin->weight.grad(), gw));
  CHECK(torch::equal(lin->bias.grad(), gb));
}
