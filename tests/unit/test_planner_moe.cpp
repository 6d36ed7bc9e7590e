// The planner with Mixture-of-Experts models: expert state per rank under
// expert parallelism, the all-to-all term (within and across nodes), compute
// that counts active experts, and the search choosing ep. The models are
// described (ModelFacts built here), not built: the MoE models live elsewhere.
// docs/plans/ is produced by `nnstrain plan --explain` on the real models.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <numeric>

#include "trainer/optim/precision.h"
#include "trainer/plan/planner.h"
#include "trainer/state/training_state.h"

using namespace nnstrain;
using parallel::Candidate;
using parallel::ModelFacts;
using parallel::PlanRequest;

namespace {

// A Llama-style MoE decoder: GQA attention (head_dim may differ from
// hidden / heads, as Qwen3's), `dense` first layers with a SwiGLU MLP of width
// ffn, the rest MoE: a router [E, h], routed experts stacked [E, eff, h]
// (gate, up) and [E, h, eff] (down), shared experts of total width `shared`.
struct MoeShape {
  int64_t layers, hidden, heads, kv_heads, head_dim, experts, topk, eff, vocab, max_seq = 4096;
  int64_t dense = 0, ffn = 0, shared = 0;
};

ModelFacts moe_facts(const MoeShape& m) {
  ModelFacts f;
  const int64_t h = m.hidden, q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim;
  f.dims = {h, m.layers, m.heads, m.kv_heads, m.ffn > 0 ? m.ffn : m.eff, m.vocab, m.max_seq, false,
            m.experts, m.topk, m.eff, m.layers - m.dense, m.shared};
  f.layers = m.layers;
  f.gated_mlp = true;
  f.vocab_parallel_head = true;
  f.experts = m.experts;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, models::SplitStyle style, int unit,
                 int64_t split_unit = 1, std::vector<int64_t> parts = {}) {
    parallel::ParamFact p;
    p.name = name;
    p.shape = shape;
    p.numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
    p.split = {name, style, split_unit, parts};
    p.unit = unit;
    f.params.push_back(p);
    f.zero3_units.push_back(unit >= 0 ? unit + 1 : (f.params.size() == 1 ? 0 : int(m.layers) + 1));
  };
  using S = models::SplitStyle;
  add("embed_tokens.weight", {m.vocab, h}, S::Vocab, -1);
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int u = static_cast<int>(l);
    add(p + "input_layernorm.weight", {h}, S::Replicate, u);
    add(p + "self_attn.q_proj.weight", {q, h}, S::Column, u, m.head_dim);
    add(p + "self_attn.k_proj.weight", {kv, h}, S::Column, u, m.head_dim);
    add(p + "self_attn.v_proj.weight", {kv, h}, S::Column, u, m.head_dim);
    add(p + "self_attn.o_proj.weight", {h, q}, S::Row, u, m.head_dim);
    add(p + "post_attention_layernorm.weight", {h}, S::Replicate, u);
    if (l < m.dense) {
      add(p + "mlp.gate_proj.weight", {m.ffn, h}, S::Column, u);
      add(p + "mlp.up_proj.weight", {m.ffn, h}, S::Column, u);
      add(p + "mlp.down_proj.weight", {h, m.ffn}, S::Row, u);
      continue;
    }
    add(p + "mlp.gate.weight", {m.experts, h}, S::Replicate, u);
    add(p + "mlp.experts.gate_proj", {m.experts, m.eff, h}, S::Expert, u);
    add(p + "mlp.experts.up_proj", {m.experts, m.eff, h}, S::Expert, u);
    add(p + "mlp.experts.down_proj", {m.experts, h, m.eff}, S::Expert, u);
    if (m.shared > 0) {
      add(p + "mlp.shared_experts.gate_proj.weight", {m.shared, h}, S::Column, u);
      add(p + "mlp.shared_experts.up_proj.weight", {m.shared, h}, S::Column, u);
      add(p + "mlp.shared_experts.down_proj.weight", {h, m.shared}, S::Row, u);
    }
  }
  add("norm.weight", {h}, S::Replicate, -1);
  add("lm_head.weight", {m.vocab, h}, S::Vocab, -1);
  f.zero3_head_unit = static_cast<int>(m.layers) + 1;
  // 6 FLOPs per active matmul parameter per token (top-k routed experts, the
  // shared ones, the router), plus attention's 12 x layers x q x seq.
  const double per_layer = double(h) * q * 2 + double(h) * kv * 2;
  const double moe = double(h) * m.experts + 3.0 * h * (m.topk * m.eff + m.shared);
  const double n = m.layers * per_layer + m.dense * 3.0 * h * m.ffn + (m.layers - m.dense) * moe + double(m.vocab) * h;
  f.flops_per_token = [n, L = m.layers, q](int64_t seq) { return 6 * n + 12.0 * L * q * seq; };
  return f;
}

double expert_numel(const ModelFacts& f) {
  double n = 0;
  for (const auto& p : f.params)
    if (p.split.style == models::SplitStyle::Expert) n += double(p.numel);
  return n;
}

config::TrainerArgs moe_args(int world, int plan_ngpus, int64_t micro, int64_t global, int64_t seq) {
  config::TrainerArgs a;
  a.compute_config.runtime_ngpus = world;
  a.compute_config.plan_ngpus = plan_ngpus;
  a.pas_policy = "autodist";
  a.micro_batch_size = micro;
  a.global_batch_size = global;
  a.dataset.train_args.seq_len = seq;
  a.precision = "32-true";
  a.compute_config.sequence_parallel = false;
  return a;
}

parallel::DeviceSpec test_device() {
  parallel::DeviceSpec d;
  d.name = "test";
  d.memory_bytes = 1e12;
  d.peak_flops = d.peak_flops_tf32 = d.peak_flops_fp32 = 1e12;
  d.intra_node_bw = 100e9;
  d.inter_node_bw = 10e9;
  d.ranks_per_node = 8;
  d.collective_latency_s = 20e-6;
  return d;
}

// A small MoE: 4 layers, 16 experts of width 64, top-2.
const MoeShape kSmall{4, 64, 4, 2, 16, 16, 2, 64, 256};

Candidate cand(int tp, int dp, int zero, int ep, int cp = 1) {
  Candidate c;
  c.tp = tp, c.dp = dp, c.zero_stage = zero, c.ep = ep, c.cp = cp;
  return c;
}

}  // namespace

TEST_CASE("moe planner: expert state per rank is E / ep experts, ZeRO-sharded over dp x cp / ep", "[planner][moe]") {
  const auto f = moe_facts(kSmall);
  const auto a = moe_args(8, 1, 1, 8, 32);
  PlanRequest req;
  req.args = &a;
  req.world_size = 8;
  req.device = test_device();
  const auto ps = optim::precision_setup(a.precision, a.compute_config.reduce_dtype);
  const auto sb = parallel::state_bytes(ps.param, ps.grad, ps.master_weights);
  const double P = expert_numel(f);
  REQUIRE(P == 4 * 3 * 16 * 64 * 64);
  double last_total = 0;
  for (int ep : {1, 2, 4, 8}) {
    INFO("ep " << ep);
    // No ZeRO: every rank holds its E / ep experts' parameters, gradients and moments whole.
    const auto e0 = parallel::estimate(req, f, cand(1, 8, 0, ep));
    CHECK(e0.expert_bytes == Approx(P / ep * sb.total()));
    // ZeRO-1 over dp 8: parameters and the full gradient buffer are E / ep;
    // the reduced chunk and the optimizer state are 1/8 of all experts at every ep.
    const auto e1 = parallel::estimate(req, f, cand(1, 8, 1, ep));
    CHECK(e1.expert_bytes == Approx(P / ep * (sb.param + sb.grad) + P / 8 * (sb.grad + sb.master + sb.moments)));
    if (ep > 1) CHECK(e0.total_bytes < last_total);  // the whole rank's memory falls with ep
    last_total = e0.total_bytes;
  }
  // The non-expert state does not change with ep.
  const auto e1 = parallel::estimate(req, f, cand(1, 8, 0, 1)), e8 = parallel::estimate(req, f, cand(1, 8, 0, 8));
  CHECK(e1.param_bytes - e1.expert_bytes / sb.total() * sb.param ==
        Approx(e8.param_bytes - e8.expert_bytes / sb.total() * sb.param));
}

TEST_CASE("moe planner: the all-to-all crosses nodes once the ep group outgrows a node, and costs more", "[planner][moe]") {
  const auto f = moe_facts(kSmall);
  const auto a = moe_args(16, 4, 1, 16, 32);
  PlanRequest req;
  req.args = &a;
  req.world_size = 16;
  req.device = test_device();
  req.moe_imbalance = 1.5;
  const double alpha = req.device.collective_latency_s, intra = req.device.intra_node_bw,
               inter = req.device.inter_node_bw;
  // One micro-batch of 32 tokens, top-2 rows of 64 fp32 values; the busiest rank receives 1.5 x.
  const double rows = 1.5 * 32 * 2 * 64 * 4;
  // ep 4 at tp 2: ranks 0, 2, 4, 6 - one node.
  const auto in = parallel::all_to_all_layer(req, f, cand(2, 8, 0, 4));
  CHECK_FALSE(in.cross_node);
  CHECK(in.bytes == Approx(rows * 3 / 4));
  CHECK(in.forward_s == Approx(alpha + 2 * (alpha + rows * 3 / 4 / intra)));
  CHECK(in.backward_s == Approx(2 * (alpha + rows * 3 / 4 / intra)));
  // cp slices the group too (cp innermost in dp x cp): tp 2, cp 2, ep 4 is still ranks 0, 2, 4, 6.
  CHECK_FALSE(parallel::all_to_all_layer(req, f, cand(2, 4, 0, 4, 2)).cross_node);
  // ep 4 at tp 4: ranks 0, 4 | 8, 12 - two per node; half the rows from the other node.
  const auto out = parallel::all_to_all_layer(req, f, cand(4, 4, 0, 4));
  CHECK(out.cross_node);
  CHECK(out.bytes == Approx(in.bytes));
  CHECK(out.backward_s == Approx(2 * (alpha + std::max(rows / 4 / intra, rows * 2 / 4 / inter))));
  CHECK(out.forward_s > in.forward_s);
  // The step: every MoE layer's all-to-alls per micro-batch (global 16 / dp), exposed.
  const auto e_in = parallel::estimate(req, f, cand(2, 8, 0, 4)), e_out = parallel::estimate(req, f, cand(4, 4, 0, 4));
  CHECK(e_in.ep_comm_s == Approx(2 * 4 * (in.forward_s + in.backward_s)));
  CHECK(e_out.ep_comm_s == Approx(4 * 4 * (out.forward_s + out.backward_s)));
  CHECK(e_out.comm_s - e_out.tp_comm_s - e_out.dp_comm_s == Approx(e_out.ep_comm_s));
  // No all-to-all at ep 1.
  CHECK(parallel::estimate(req, f, cand(2, 8, 0, 1)).ep_comm_s == 0);
}

TEST_CASE("moe planner: compute counts active experts, whole on every tp rank, imbalance x at ep > 1", "[planner][moe]") {
  auto shape = kSmall;
  const auto a = moe_args(8, 2, 1, 8, 32);
  PlanRequest req;
  req.args = &a;
  req.world_size = 8;
  req.device = test_device();
  req.moe_imbalance = 1.25;
  const double peak = 1e12 * parallel::kAssumedEfficiency;
  const double tokens = 32;
  auto compute = [&](const ModelFacts& f, const Candidate& c) { return parallel::estimate(req, f, c).compute_s; };
  const auto f16 = moe_facts(shape);
  shape.experts = 64;
  const auto f64 = moe_facts(shape);
  // Causal attention's masked half is not work.
  auto work = [&](const ModelFacts& f) {
    return f.flops_per_token(32) - 0.5 * (f.flops_per_token(32) - f.flops_per_token(0));
  };
  const double routed = 6.0 * 4 * 2 * 3 * 64 * 64;  // 4 MoE layers, top-2 of width 64
  CHECK(compute(f16, cand(1, 8, 0, 1)) == Approx(tokens * work(f16) / peak));
  // Four times the experts, the same top-k: only the router grows.
  CHECK(compute(f64, cand(1, 8, 0, 1)) / compute(f16, cand(1, 8, 0, 1)) ==
        Approx((work(f16) + 6.0 * 4 * 64 * 48) / work(f16)));
  // tp 2 (no SP) divides the rest, not the routed experts (dp 4: two micro-batches).
  CHECK(compute(f16, cand(2, 4, 0, 1)) == Approx(2 * tokens * ((work(f16) - routed) / 2 + routed) / peak));
  // The busiest ep rank runs 1.25 x the mean assignments.
  CHECK(compute(f16, cand(1, 8, 0, 4)) == Approx(tokens * (work(f16) + 0.25 * routed) / peak));
}

TEST_CASE("moe planner: sequence parallelism divides the routed experts' work over tp and all-reduces their gradients",
          "[planner][moe]") {
  const auto f = moe_facts(kSmall);
  auto a = moe_args(8, 2, 1, 8, 32);
  PlanRequest req;
  req.args = &a;
  req.world_size = 8;
  req.device = test_device();
  const auto plain = parallel::estimate(req, f, cand(2, 4, 0, 1));
  a.compute_config.sequence_parallel = true;
  const auto sp = parallel::estimate(req, f, cand(2, 4, 0, 1));
  // Each tp rank routes half the tokens: all the work divides by tp.
  const double peak = 1e12 * parallel::kAssumedEfficiency;
  const double work = f.flops_per_token(32) - 0.5 * (f.flops_per_token(32) - f.flops_per_token(0));
  CHECK(sp.compute_s == Approx(2 * 32 * work / 2 / peak));
  CHECK(sp.compute_s < plain.compute_s);
  // The experts' fp32 gradients (all of them at ep 1), ring all-reduced over tp 2 within
  // the node per MoE layer, in each of the two micro-batches.
  const auto& d = req.device;
  const double grads = 2 * (4 * d.collective_latency_s + 2 * 0.5 * expert_numel(f) * 4 / d.intra_node_bw);
  CHECK(sp.tp_comm_s - plain.tp_comm_s == Approx(grads));
}

TEST_CASE("moe planner: ep is searched, and ep > 1 chosen when the experts do not fit at ep 1", "[planner][moe]") {
  const auto f = moe_facts(kSmall);
  auto a = moe_args(8, 1, 1, 8, 32);
  a.compute_config.use_zero = 1;  // fixed, so only ep can shrink the experts' parameters and gradients
  PlanRequest req;
  req.args = &a;
  req.world_size = 8;
  req.device = test_device();
  const auto at = [&](int ep, int k) {
    auto c = cand(1, 8, 1, ep);
    c.recompute_layers = k;
    return parallel::estimate(req, f, c).total_bytes;
  };
  REQUIRE(at(2, 0) < at(1, 4));
  req.memory_budget_bytes = at(2, 0);  // ep 1 over at every recompute, ep 2 (and more) under
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, f, &rejected);
  CHECK(plan.ep > 1);
  CHECK(plan.estimate.total_bytes <= req.memory_budget_bytes);
  int ep1 = 0;
  for (const auto& r : rejected)
    if (r.cand.ep == 1) {
      CHECK(r.kind == "memory");
      ++ep1;
    }
  CHECK(ep1 == 5);  // recompute 0..4
  for (const auto& p : plan.params)
    if (p.param == "layers.0.mlp.experts.up_proj") {
      CHECK(p.split == "expert");
      CHECK(p.local_shape == std::vector<int64_t>{16 / plan.ep, 64, 64});
    }
  // With room for all: the same search still weighs every ep by speed (each
  // other ep at the plan's point rejected as slower, none for memory).
  req.memory_budget_bytes = 1e12;
  rejected.clear();
  const auto roomy = parallel::make_plan(req, f, &rejected);
  int slower_eps = 0;
  for (const auto& r : rejected)
    if (r.cand.recompute_layers == 0 && r.cand.ep != roomy.ep) {
      CHECK(r.kind == "slower");
      ++slower_eps;
    }
  CHECK(slower_eps == 3);  // of ep 1, 2, 4, 8
  CHECK(parallel::describe_rejected(rejected, 4).find("ep=") != std::string::npos);
}

TEST_CASE("moe planner: a configured expert_parallel_size is kept, and refused by name where it cannot run", "[planner][moe]") {
  const auto f = moe_facts(kSmall);
  auto a = moe_args(8, 1, 1, 8, 32);
  a.compute_config.expert_parallel_given = true;
  a.compute_config.expert_parallel_size = 2;
  PlanRequest req;
  req.args = &a;
  req.world_size = 8;
  req.device = test_device();
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, f, &rejected);
  CHECK(plan.ep == 2);
  for (const auto& r : rejected) CHECK(r.cand.ep == 2);
  // 3 divides neither dp x cp nor the 16 experts: a config error, one line naming the key.
  a.compute_config.expert_parallel_size = 3;
  try {
    parallel::make_plan(req, f);
    FAIL("planned with expert_parallel_size 3");
  } catch (const parallel::PlanError& e) {
    CHECK(e.config);
    CHECK(std::string(e.what()) == "compute_config.expert_parallel_size 3 does not divide dp x cp = 8 x 1");
  }
  a.compute_config.expert_parallel_size = 16;  // divides the experts, not the 8 ranks
  CHECK_THROWS_WITH(parallel::make_plan(req, f), "compute_config.expert_parallel_size 16 does not divide dp x cp = 8 x 1");
  a.compute_config.expert_parallel_size = 2;
  auto odd = moe_facts({4, 64, 4, 2, 16, 9, 2, 64, 256});
  CHECK_THROWS_WITH(parallel::make_plan(req, odd), "compute_config.expert_parallel_size 2 does not divide the 9 experts");
  // A dense model keeps the config's size for the trainer to refuse by name.
  auto dense = f;
  dense.experts = 0;
  for (auto& p : dense.params)
    if (p.split.style == models::SplitStyle::Expert) p.split.style = models::SplitStyle::Replicate;
  a.compute_config.expert_parallel_size = 3;
  CHECK(parallel::make_plan(req, dense).ep == 3);
}
