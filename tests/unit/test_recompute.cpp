// Activation checkpointing: the block really is recomputed in backward, and a
// model gives the same loss, gradients and random stream with it on or off.
#include <catch2/catch.hpp>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>

#include <vector>

#include "models/common/layers.h"
#include "models/common/recompute.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "tests/unit/tiny_models.h"
#include "trainer/train/cpu_memory.h"

using nnstrain::models::CausalLM;
using nnstrain::models::RuntimeOptions;
using nnstrain::models::common::recompute;
using nnstrain::testing::tiny_llama;

namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ad = a.to(torch::kDouble), bd = b.to(torch::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

struct Step {
  torch::Tensor loss, next_random;
  int64_t kept_bytes;  // tensor bytes the forward left alive for backward
};

// One forward + backward from a fixed seed; also the next draw of the CPU generator.
Step step(CausalLM& m, const torch::Tensor& idx, const torch::Tensor& targets, uint64_t seed) {
  nnstrain::train::install_cpu_tensor_counter();  // counts from here; idempotent
  m.zero_grad();
  torch::manual_seed(seed);
  const int64_t before = nnstrain::train::cpu_tensor_bytes().in_use;
  auto loss = m.loss(idx, targets);
  const int64_t kept = nnstrain::train::cpu_tensor_bytes().in_use - before;
  loss.backward();
  return {loss.detach(), torch::rand({4}), kept};
}

// Same loss, same gradients, and the replayed RNG leaves the stream where it was.
void check_same(CausalLM& off, CausalLM& on, const torch::Tensor& idx, const torch::Tensor& targets) {
  const auto a = step(off, idx, targets, 7), b = step(on, idx, targets, 7);
  // The comparison is with recompute really on: its forward keeps fewer activations.
  INFO("bytes kept for backward: recompute off " << a.kept_bytes << ", on " << b.kept_bytes);
  CHECK(b.kept_bytes < a.kept_bytes);
  CHECK(rel_err(b.loss, a.loss) < 1e-6);
  CHECK(torch::equal(a.next_random, b.next_random));
  const auto pa = off.named_parameters(), pb = on.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (const auto& p : pa) {
    INFO(p.key());
    REQUIRE(p.value().grad().defined());
    REQUIRE(pb[p.key()].grad().defined());
    CHECK(rel_err(pb[p.key()].grad(), p.value().grad()) < 1e-6);
  }
}

}  // namespace

TEST_CASE("recompute runs the block without grad, then again with grad in backward", "[recompute]") {
  torch::manual_seed(0);
  nnstrain::models::common::Linear lin(6, 6, true);
  std::vector<bool> grad_modes;
  auto fn = [&](const torch::Tensor& t) {
    grad_modes.push_back(torch::GradMode::is_enabled());
    return torch::tanh(lin(t));
  };
  const auto x0 = torch::randn({3, 6});
  auto x = x0.clone().requires_grad_(true);
  auto y = recompute(fn, x);
  CHECK(grad_modes == std::vector<bool>{false});  // nothing kept from the forward
  y.pow(2).sum().backward();
  CHECK(grad_modes == std::vector<bool>{false, true});
  const auto gx = x.grad().clone(), gw = lin->weight.grad().clone(), gb = lin->bias.grad().clone();

  lin->zero_grad();
  auto x2 = x0.clone().requires_grad_(true);
  torch::tanh(lin(x2)).pow(2).sum().backward();
  CHECK(rel_err(gx, x2.grad()) < 1e-6);
  CHECK(rel_err(gw, lin->weight.grad()) < 1e-6);
  CHECK(rel_err(gb, lin->bias.grad()) < 1e-6);

  // An input that needs no grad: the parameters still get theirs.
  lin->zero_grad();
  recompute(fn, x0).pow(2).sum().backward();
  CHECK(rel_err(lin->weight.grad(), gw) < 1e-6);

  // Without grad mode it is a plain call.
  grad_modes.clear();
  {
    torch::NoGradGuard no_grad;
    recompute(fn, x0);
  }
  CHECK(grad_modes == std::vector<bool>{false});
}

TEST_CASE("recompute replays dropout masks: GPT with dropout, recompute on and off", "[recompute]") {
  nnstrain::models::gpt::GptConfig cfg;
  cfg.vocab_size = 64;
  cfg.block_size = 16;
  cfg.n_layer = 3;
  cfg.n_head = 2;
  cfg.n_embd = 32;
  cfg.dropout = 0.2;
  torch::manual_seed(0);
  nnstrain::models::gpt::Gpt off(cfg);
  torch::manual_seed(0);
  nnstrain::models::gpt::Gpt on(cfg);
  RuntimeOptions opts;
  opts.recompute_layers = {true, false, true};
  on.set_runtime_options(opts);
  const auto idx = torch::randint(64, {2, 16}), targets = torch::randint(64, {2, 16});

  // Dropout is live, so a wrong mask in the replay would show.
  const auto s1 = step(off, idx, targets, 7), s2 = step(off, idx, targets, 8);
  REQUIRE(s1.loss.item<double>() != s2.loss.item<double>());
  check_same(off, on, idx, targets);
}

TEST_CASE("recompute gives Llama the same loss and gradients", "[recompute]") {
  const auto cfg = tiny_llama();
  torch::manual_seed(0);
  nnstrain::models::llama::Llama off(cfg);
  torch::manual_seed(0);
  nnstrain::models::llama::Llama on(cfg);
  RuntimeOptions opts;
  opts.recompute_layers = {true, true, false};
  opts.loss = nnstrain::models::common::LossKind::Chunked;
  opts.loss_chunk_size = 10;
  on.set_runtime_options(opts);
  const auto idx = torch::randint(80, {2, 20}), targets = torch::randint(80, {2, 20});
  check_same(off, on, idx, targets);
}

TEST_CASE("recompute with the fused loss gives Llama (untied and tied heads) the plain loss and gradients",
          "[recompute][fused_loss]") {
  for (bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied"));
    const auto cfg = tiny_llama(tied);
    torch::manual_seed(0);
    nnstrain::models::llama::Llama off(cfg);
    torch::manual_seed(0);
    nnstrain::models::llama::Llama on(cfg);
    RuntimeOptions opts;
    opts.recompute_layers = {true, true, true};
    opts.loss = nnstrain::models::common::LossKind::Fused;
    opts.loss_chunk_size = 7;  // 40 tokens: 6 chunks, the last of 5
    on.set_runtime_options(opts);
    const auto idx = torch::randint(80, {2, 20}), targets = torch::randint(80, {2, 20});
    check_same(off, on, idx, targets);
  }
}

TEST_CASE("recompute replays the forward's autocast state (CPU bf16 autocast)", "[recompute]") {
  torch::manual_seed(3);
  nnstrain::models::common::Linear a(16, 32, true), b(32, 16, true);
  auto fn = [&](const torch::Tensor& t) { return b(torch::gelu(a(t))); };
  const auto x0 = torch::randn({4, 16});
  // Forward under autocast, backward outside it, as a training step does.
  auto grads = [&](bool checkpoint) {
    a->zero_grad();
    b->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    torch::Tensor y;
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    y = checkpoint ? recompute(fn, x) : fn(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    CHECK(y.scalar_type() == torch::kBFloat16);
    y.to(torch::kFloat).pow(2).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), a->weight.grad(), b->weight.grad()};
  };
  const auto plain = grads(false), replayed = grads(true);
  // A replay in fp32 would differ from the bf16 forward by bf16 rounding (~1e-2).
  for (size_t i = 0; i < plain.size(); ++i) CHECK(rel_err(replayed[i], plain[i]) < 1e-6);
}
