// The Mixture-of-Experts block's maths (models/common/moe.h): the routers,
// capacity dropping, the aux-loss-free bias update, the grouped expert GEMM
// against a per-row reference, the balancing losses' gradient (outside the
// returned loss, exact across micro-batching), statistics under recompute, the
// active-parameter FLOPs (the config keys' validation: tests/integration/test_moe.py).
#include <catch2/catch.hpp>

#include <ATen/Parallel.h>

#include <torch/torch.h>

#include <cmath>

#include "models/common/kernels/grouped_gemm.h"
#include "models/common/kernels/kernels.h"
#include "models/common/moe.h"
#include "models/moe/moe_lm.h"

using namespace nnstrain;
using models::common::MoeOptions;
using models::common::RouterKind;

namespace {

MoeOptions softmax_options(int64_t E, int64_t k, bool norm) {
  MoeOptions o;
  o.num_experts = E;
  o.top_k = k;
  o.norm_topk_prob = norm;
  return o;
}

std::vector<int64_t> ids(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

TEST_CASE("softmax router: top-k of the probabilities, renormalised or not", "[moe][router]") {
  // probabilities 0.1, 0.2, 0.3, 0.4: the top two are experts 3 and 2.
  const auto logits = torch::tensor({0.0, std::log(2.0), std::log(3.0), std::log(4.0)}, torch::kFloat).view({1, 4});
  const auto plain = models::common::route(logits, softmax_options(4, 2, false));
  CHECK(ids(plain.experts) == std::vector<int64_t>{3, 2});
  CHECK(plain.weights[0][0].item<double>() == Approx(0.4).epsilon(1e-6));
  CHECK(plain.weights[0][1].item<double>() == Approx(0.3).epsilon(1e-6));
  const auto norm = models::common::route(logits, softmax_options(4, 2, true));
  CHECK(norm.weights[0][0].item<double>() == Approx(4.0 / 7).epsilon(1e-6));
  CHECK(norm.weights[0][1].item<double>() == Approx(3.0 / 7).epsilon(1e-6));
  CHECK(plain.weights.scalar_type() == torch::kFloat);
}

TEST_CASE("DeepSeek-V3 router: the bias chooses, the scores weigh", "[moe][router]") {
  MoeOptions o = softmax_options(4, 1, false);
  o.router = RouterKind::DeepseekV3;
  const auto logits = torch::tensor({2.0f, 1.0f, 0.0f, -1.0f}).view({1, 4});
  CHECK(ids(models::common::route(logits, o).experts) == std::vector<int64_t>{0});
  // A bias on the weakest expert makes it the choice (aux-loss-free balancing);
  // its weight is still its unbiased sigmoid score.
  const auto bias = torch::tensor({0.0f, 0.0f, 0.0f, 5.0f});
  const auto r = models::common::route(logits, o, bias);
  CHECK(ids(r.experts) == std::vector<int64_t>{3});
  CHECK(r.weights[0][0].item<double>() == Approx(1.0 / (1.0 + std::exp(1.0))).epsilon(1e-6));
  // routed_scaling_factor scales the renormalised weights.
  o.top_k = 2;
  o.norm_topk_prob = true;
  o.routed_scaling_factor = 2.5;
  CHECK(models::common::route(logits, o).weights.sum().item<double>() == Approx(2.5).epsilon(1e-6));
}

TEST_CASE("DeepSeek-V3 router: group-limited top-k", "[moe][router]") {
  // 8 experts in 4 groups of 2. Expert 0 alone scores best, but group 1's two
  // experts sum higher than group 0's, so with one group chosen both picks come from group 1.
  MoeOptions o = softmax_options(8, 2, false);
  o.router = RouterKind::DeepseekV3;
  const auto logits = torch::tensor({3.0f, -3.0f, 1.5f, 1.5f, -5.0f, -5.0f, -5.0f, -5.0f}).view({1, 8});
  auto ungrouped = ids(models::common::route(logits, o).experts);
  std::sort(ungrouped.begin(), ungrouped.end());
  CHECK(ungrouped.front() == 0);
  o.n_group = 4;
  o.topk_group = 1;
  auto grouped = ids(models::common::route(logits, o).experts);
  std::sort(grouped.begin(), grouped.end());
  CHECK(grouped == std::vector<int64_t>{2, 3});
}

TEST_CASE("capacity_factor drops the lowest-weight overflow and counts it", "[moe][capacity]") {
  // Four tokens all choose expert 0 of 2 (k 1): capacity ceil(4 x 1 / 2 x 1.0) = 2.
  auto experts = torch::zeros({4, 1}, torch::kLong);
  const auto weights = torch::tensor({0.6f, 0.9f, 0.7f, 0.8f}).view({4, 1});
  CHECK(models::common::drop_over_capacity(experts, weights, 2, 1.0) == 2);
  CHECK(ids(experts) == std::vector<int64_t>{-1, 0, -1, 0});
  // A factor of 2 keeps them all.
  auto all = torch::zeros({4, 1}, torch::kLong);
  CHECK(models::common::drop_over_capacity(all, weights, 2, 2.0) == 0);
}

TEST_CASE("update_expert_bias: speed x sign(mean load - load)", "[moe][bias]") {
  auto bias = torch::tensor({0.5f, 0.0f, -0.25f});
  models::common::update_expert_bias(bias, torch::tensor({10, 2, 6}), 0.125);
  CHECK(bias[0].item<double>() == Approx(0.375));  // overloaded: down
  CHECK(bias[1].item<double>() == Approx(0.125));  // underloaded: up
  CHECK(bias[2].item<double>() == Approx(-0.25));  // at the mean: unchanged
}

TEST_CASE("grouped expert GEMM: loop and padded bmm equal a per-row reference, gradients too", "[moe][grouped_gemm]") {
  namespace K = models::common::kernels;
  torch::manual_seed(3);
  const std::vector<int64_t> counts = {3, 0, 5, 1};
  const int64_t M = 9, Kd = 6, N = 4;
  const auto x0 = torch::randn({M, Kd}, torch::kDouble), w0 = torch::randn({4, N, Kd}, torch::kDouble);
  // Reference: each row times its own group's weight, gathered (no grouping at all).
  std::vector<int64_t> group;
  for (int64_t g = 0; g < 4; ++g) group.insert(group.end(), counts[g], g);
  const auto per_row = w0.index_select(0, torch::tensor(group));  // [M, N, K]
  const auto want = torch::einsum("mk,mnk->mn", {x0, per_row});
  for (auto which : {K::GroupedGemm::Loop, K::GroupedGemm::PaddedBmm}) {
    auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto y = K::grouped_linear(x, w, counts, which);
    CHECK(K::last_grouped_gemm() == K::grouped_gemm_name(which));
    CHECK((y - want).abs().max().item<double>() < 1e-12);
    y.pow(2).sum().backward();
    auto xr = x0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
    torch::einsum("mk,mnk->mn", {xr, wr.index_select(0, torch::tensor(group))}).pow(2).sum().backward();
    CHECK((x.grad() - xr.grad()).abs().max().item<double>() < 1e-12);
    CHECK((w.grad() - wr.grad()).abs().max().item<double>() < 1e-12);
  }
}

TEST_CASE("grouped expert GEMM with no rows: the result stays in the graph, backward reaches inputs and weights",
          "[moe][grouped_gemm]") {
  // A rank whose experts receive no rows must still run its backward (the all-to-alls and,
  // under sequence parallelism, the tp all-reduces behind its weights): issue 58, item 1.
  namespace K = models::common::kernels;
  const std::vector<int64_t> counts(20, 0);  // 20 local experts, none with rows (the CPU picks padded_bmm)
  const int64_t C = 8, I = 8, G = 20;
  for (auto which : {K::GroupedGemm::Auto, K::GroupedGemm::Loop, K::GroupedGemm::PaddedBmm}) {
    INFO(K::grouped_gemm_name(which));
    auto x = torch::randn({0, C}).requires_grad_(true), w = torch::randn({G, I, C}).requires_grad_(true);
    const auto y = K::grouped_linear(x, w, counts, which);
    REQUIRE(y.sizes() == torch::IntArrayRef{0, I});
    REQUIRE(y.requires_grad());
    y.sum().backward();
    REQUIRE(x.grad().defined());
    REQUIRE(w.grad().defined());
    CHECK(w.grad().abs().max().item<double>() == 0.0);
    auto g = torch::randn({G, I, C}).requires_grad_(true), u = torch::randn({G, I, C}).requires_grad_(true),
         d = torch::randn({G, C, I}).requires_grad_(true), x2 = torch::randn({0, C}).requires_grad_(true);
    const auto m = K::grouped_swiglu_mlp(x2, g, u, d, counts, which);
    REQUIRE(m.requires_grad());
    m.sum().backward();
    for (const auto* t : {&x2, &g, &u, &d}) CHECK(t->grad().defined());
  }
  CHECK(K::choose_grouped_gemm(torch::zeros({0, C}), torch::zeros({G, I, C}), counts) == K::GroupedGemm::PaddedBmm);
}

TEST_CASE("grouped SwiGLU MLP: the loop's one node equals three grouped GEMMs, on one thread and two",
          "[moe][grouped_gemm]") {
  namespace K = models::common::kernels;
  torch::manual_seed(4);
  // Uneven groups (one empty) so two threads split them at a group boundary.
  const std::vector<int64_t> counts = {7, 0, 2, 11, 4};
  const int64_t M = 24, C = 6, I = 5, G = 5;
  const auto x0 = torch::randn({M, C}, torch::kDouble), g0 = torch::randn({G, I, C}, torch::kDouble),
             u0 = torch::randn({G, I, C}, torch::kDouble), d0 = torch::randn({G, C, I}, torch::kDouble),
             dy = torch::randn({M, C}, torch::kDouble);
  auto run = [&](bool loop) {
    std::vector<torch::Tensor> t;
    for (const auto& v : {x0, g0, u0, d0}) t.push_back(v.clone().requires_grad_(true));
    auto y = loop ? K::grouped_swiglu_mlp(t[0], t[1], t[2], t[3], counts, K::GroupedGemm::Loop)
                  : K::grouped_linear(K::swiglu(K::grouped_linear(t[0], t[1], counts, K::GroupedGemm::PaddedBmm),
                                                K::grouped_linear(t[0], t[2], counts, K::GroupedGemm::PaddedBmm)),
                                      t[3], counts, K::GroupedGemm::PaddedBmm);
    y.backward(dy);
    t.insert(t.begin(), y.detach());
    return t;
  };
  const auto want = run(false);
  const int threads = at::get_num_threads();
  for (int n : {1, 2}) {
    at::set_num_threads(n);
    const auto got = run(true);
    CHECK(K::last_grouped_gemm() == "loop");
    INFO(n << " threads");
    CHECK((got[0] - want[0]).abs().max().item<double>() < 1e-12);
    for (int i = 1; i <= 4; ++i) {
      INFO("gradient of input " << i - 1);
      CHECK((got[i].grad() - want[i].grad()).abs().max().item<double>() < 1e-12);
    }
    CHECK(got[2].grad()[1].abs().max().item<double>() == 0.0);  // the empty group's gate: zero
  }
  at::set_num_threads(threads);
}

namespace {

// A tiny qwen3_moe: 2 layers, the first dense, 5 experts top-3, aux and z losses on.
std::shared_ptr<models::moe::MoeLm> tiny_moe(double aux, double z, int64_t first_dense = 1) {
  models::moe::MoeLmConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 16;
  c.qk_norm = true;
  MoeOptions o = softmax_options(5, 3, true);
  o.hidden_size = 16;
  o.moe_intermediate_size = 8;
  o.router_aux_loss_coef = aux;
  o.router_z_loss_coef = z;
  c.moe = std::make_shared<const MoeOptions>(o);
  c.sparse_layers = models::moe::sparse_layers(2, 1, {}, first_dense);
  torch::manual_seed(5);
  auto m = std::make_shared<models::moe::MoeLm>(c);
  {
    torch::NoGradGuard ng;
    for (auto& p : m->parameters()) p.normal_(0, 0.3);  // routers far from uniform
  }
  return m;
}

torch::Tensor router_grad(models::moe::MoeLm& m) {
  for (const auto& p : m.named_parameters())
    if (p.key() == "layers.1.mlp.gate.weight") return p.value().grad().clone();
  FAIL("no router weight");
  return {};
}

}  // namespace

TEST_CASE("balancing losses: gradient only, weighted like the LM loss across micro-batches", "[moe][aux]") {
  torch::manual_seed(9);
  const auto x = torch::randint(0, 32, {4, 8}), y = torch::randint(0, 32, {4, 8});
  auto with = tiny_moe(0.5, 0.1), without = tiny_moe(0.0, 0.0);
  with->train();
  without->train();
  const auto lw = with->loss(x, y), lo = without->loss(x, y);
  CHECK(lw.item<double>() == lo.item<double>());  // the same weights: the returned loss holds no aux term
  lw.backward();
  lo.backward();
  const auto full = router_grad(*with);
  CHECK((full - router_grad(*without)).abs().max().item<double>() > 1e-4);  // the aux gradient is there
  const auto stats = with->take_moe_stats();
  REQUIRE(stats.size() == 1);
  CHECK(stats[0].layer == "layers.1.mlp");
  REQUIRE(stats[0].aux_loss.defined());
  CHECK(stats[0].aux_loss.item<double>() > 0.5);  // coef x E sum f P >= coef x k (uniform) and a z term

  // Two micro-batches of 2 sequences, each weighted by its share as the trainer does:
  // the same gradient as one batch of 4.
  with->zero_grad();
  (with->loss(x.slice(0, 0, 2), y.slice(0, 0, 2)) * 0.5).backward();
  (with->loss(x.slice(0, 2, 4), y.slice(0, 2, 4)) * 0.5).backward();
  CHECK((router_grad(*with) - full).abs().max().item<double>() < 1e-6 * full.abs().max().item<double>() + 1e-9);
}

TEST_CASE("MoE statistics: every assignment once, also under recompute", "[moe][recompute]") {
  auto m = tiny_moe(0.01, 0.0, 0);
  m->train();
  models::RuntimeOptions opts;
  opts.recompute_layers = {true, true};
  m->set_runtime_options(opts);
  const auto x = torch::randint(0, 32, {2, 8}), y = torch::randint(0, 32, {2, 8});
  m->loss(x, y).backward();
  const auto stats = m->take_moe_stats();
  REQUIRE(stats.size() == 2);
  for (const auto& s : stats) {
    int64_t sum = 0;
    for (auto t : s.tokens_per_expert) sum += t;
    CHECK(sum == 2 * 8 * 3);  // B x T x k, not twice that
    CHECK(s.dropped == 0);
  }
  CHECK(m->take_moe_stats()[0].tokens_per_expert == std::vector<int64_t>(5, 0));  // reset by taking
}

TEST_CASE("flops_per_token counts the active parameters", "[moe][flops]") {
  auto m = tiny_moe(0.0, 0.0);
  // Per layer attention q,k,v,o: 16x16 x2 + 16x8 x2 = 768. Layer 0 dense MLP 3x16x24 = 1152;
  // layer 1: router 16x5 = 80 and 3 of 5 experts 3 x 16 x 8 x 3 = 1152. Head 32 x 16 = 512.
  const double n = 768 * 2 + 1152 + 80 + 1152 + 512;
  CHECK(m->flops_per_token(8) == Approx(6 * n + 12.0 * 2 * 16 * 8));
}
