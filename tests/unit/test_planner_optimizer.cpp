// The optimizer's step in the cost model (trainer/plan/cost/optimizer.cpp
// optimizer_work, optimizer_time_term; docs/parallelism.md "The optimizer's
// step"): AdamW's element-wise update, and Muon's Newton-Schulz FLOPs, owner
// balance, gather and scatter, and state. The expected figures are worked out
// here from the GPT's block shapes, not read from the optimizer.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <memory>

#include "models/gpt/gpt.h"
#include "trainer/optim/muon/muon_config.h"
#include "trainer/plan/planner.h"

using namespace nnstrain;
using parallel::Candidate;
using parallel::PlanRequest;

namespace {

std::shared_ptr<models::gpt::Gpt> gpt(int64_t layers, int64_t embd) {
  models::gpt::GptConfig c;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = embd;
  c.vocab_size = 128;
  c.block_size = 32;
  return std::make_shared<models::gpt::Gpt>(c);
}

config::TrainerArgs args_for(int world, const std::string& optimizer, int ns_steps = 5,
                             const std::string& ns_dtype = "auto") {
  config::TrainerArgs a;
  a.compute_config.runtime_ngpus = world;
  a.compute_config.plan_ngpus = world;
  a.micro_batch_size = 2;
  a.global_batch_size = 2 * world;
  a.dataset.train_args.seq_len = 32;
  a.precision = "32-true";
  a.optimizer.type = optimizer;
  if (optimizer == "muon") {
    auto m = std::make_shared<optim::muon::MuonConfig>();
    m->ns_steps = ns_steps;
    m->ns_dtype = ns_dtype;
    a.optimizer.args = m;
  }
  return a;
}

// Distinct peaks, so the test can tell which one a term used.
parallel::DeviceSpec test_device() {
  parallel::DeviceSpec d;
  d.name = "test";
  d.memory_bytes = 1e12;
  d.peak_flops = 2e12;
  d.peak_flops_tf32 = d.peak_flops_fp32 = 1e12;
  d.intra_node_bw = 100e9;
  d.inter_node_bw = 10e9;
  d.memory_bw = 1e12;
  return d;
}

// Newton-Schulz on an m x n matrix (m <= n), one iteration: X X^T (2 m^2 n),
// the gram's square (2 m^3), that polynomial times X (2 m^2 n).
double ns_iteration(double rows, double cols) {
  const double m = std::min(rows, cols), n = std::max(rows, cols);
  return 2 * m * m * n + 2 * m * m * m + 2 * m * m * n;
}

}  // namespace

TEST_CASE("cost model: Muon's Newton-Schulz FLOPs grow with ns_steps and matrix size, balanced over the stage",
          "[planner][muon]") {
  const int64_t L = 2;
  for (const int64_t C : {32, 64}) {
    auto model = gpt(L, C);
    // A GPT block's matrices: c_attn [3C, C], attn.c_proj [C, C], mlp.c_fc [4C, C], mlp.c_proj [C, 4C].
    const double block = ns_iteration(3 * C, C) + ns_iteration(C, C) + 2 * ns_iteration(4 * C, C);
    const double c3 = double(C) * C * C;
    for (const int ns : {5, 10}) {
      INFO("C " << C << ", ns_steps " << ns);
      auto one = args_for(1, "muon", ns);
      const auto e = parallel::estimate(PlanRequest{&one, model.get(), 1, test_device(), 1e12}, {1, 1, 0, 0});
      // One rank owns every block matrix; embeddings, head and norms are AdamW's.
      CHECK(e.optim_matrix_flops == Approx(ns * L * block));
      CHECK(e.optim_matrix_s == Approx(ns * L * block / (0.5 * 2e12)));  // bf16 (a CUDA device), half its peak
      CHECK(e.optim_gather_bytes == 0);
      CHECK(e.optim_scatter_bytes == 0);
      CHECK(e.optim_exchange_s == 0);
      // Over dp 4 the 8 matrices are dealt largest first to the least loaded:
      // the four 18 C^3 (c_fc, mlp.c_proj) one each, the two 14 C^3 (c_attn)
      // to the first two, the two 6 C^3 (attn.c_proj) to the other two: the
      // busiest owner does 32 C^3 per iteration.
      auto four = args_for(4, "muon", ns);
      const auto e4 = parallel::estimate(PlanRequest{&four, model.get(), 4, test_device(), 1e12}, {1, 4, 0, 0});
      CHECK(e4.optim_matrix_flops == Approx(ns * 32 * c3));
      CHECK(e4.optim_matrix_flops < e.optim_matrix_flops);
      // fp32 Newton-Schulz runs at the fp32 peak.
      auto fp32 = args_for(1, "muon", ns, "fp32");
      CHECK(parallel::estimate(PlanRequest{&fp32, model.get(), 1, test_device(), 1e12}, {1, 1, 0, 0}).optim_matrix_s ==
            Approx(ns * L * block / (0.5 * 1e12)));
    }
  }
  // Under pp 2 each pipeline rank orthogonalises its own stage's matrices
  // (one layer's here, one owner each); the slowest rank's step is the step's.
  {
    const int64_t C = 32;
    auto model = gpt(L, C);
    auto two = args_for(2, "muon");
    Candidate pp{1, 1, 0, 0};
    pp.pp = pp.stages = 2;
    pp.stage_layers = {1, 1};
    const auto e = parallel::estimate(PlanRequest{&two, model.get(), 2, test_device(), 1e12}, pp);
    CHECK(e.optim_matrix_flops ==
          Approx(5 * (ns_iteration(3 * C, C) + ns_iteration(C, C) + 2 * ns_iteration(4 * C, C))));
    CHECK(e.optim_exchange_s == 0);  // a stage of one rank
    CHECK(e.step_s > e.optim_step_s);
    CHECK(e.optim_step_s == Approx(e.optim_elementwise_s + e.optim_matrix_s));
  }
  // AdamW has no matrix work.
  auto model = gpt(L, 32);
  auto adamw = args_for(4, "adamw");
  const auto a = parallel::estimate(PlanRequest{&adamw, model.get(), 4, test_device(), 1e12}, {1, 4, 1, 0});
  CHECK(a.optim_matrix_flops == 0);
  CHECK(a.optim_exchange_s == 0);
}

TEST_CASE("cost model: Muon's gather appears under tp and ZeRO, its scatter wherever ranks share a stage, not at one rank",
          "[planner][muon]") {
  const int64_t L = 2, C = 64;
  auto model = gpt(L, C);
  const auto dev = test_device();
  auto two = args_for(2, "muon");
  const PlanRequest req{&two, model.get(), 2, dev, 1e12};
  // Per layer 12 C^2 matrix elements (3 + 1 + 4 + 4); over 2 ranks each owner
  // gets half of the FLOPs, which here is half of the elements: 12 C^2 of the 24 C^2.
  const double owned = 12.0 * C * C, wire = 2;  // bf16 on a CUDA device
  struct Case {
    const char* what;
    Candidate c;
    double gather, scatter;  // elements
  };
  // tp 2: each owner holds half of each of its matrices, receives the other
  // half, and sends back the half its peer holds. ZeRO over dp 2: the same,
  // with flat chunks in place of slices. dp 2 replicas: every matrix is
  // whole on both ranks, so nothing is gathered, but each owner sends its
  // matrices' updates to the other replica.
  for (const Case& k : {Case{"tp 2", {2, 1, 0, 0}, owned / 2, owned / 2},
                        Case{"ZeRO-1 dp 2", {1, 2, 1, 0}, owned / 2, owned / 2},
                        Case{"ZeRO-3 dp 2", {1, 2, 3, 0}, owned / 2, owned / 2},
                        Case{"dp 2", {1, 2, 0, 0}, 0, owned}}) {
    INFO(k.what);
    const auto e = parallel::estimate(req, k.c);
    CHECK(e.optim_gather_bytes == Approx(k.gather * wire).margin(1e-9));
    CHECK(e.optim_scatter_bytes == Approx(k.scatter * wire));
    // Two all-to-alls over the stage (2 ranks, one node: NVLink), not overlapped.
    CHECK(e.optim_exchange_s == Approx(2 * dev.collective_latency_s + (k.gather + k.scatter) * wire / dev.intra_node_bw));
    CHECK(e.step_s == Approx(e.compute_s + e.comm_s + e.offload_s + e.optim_step_s));
    CHECK(e.optim_step_s == Approx(e.optim_elementwise_s + e.optim_matrix_s + e.optim_exchange_s));
  }
  // fp32 exchange: twice the bytes.
  auto fp32 = args_for(2, "muon", 5, "fp32");
  CHECK(parallel::estimate(PlanRequest{&fp32, model.get(), 2, dev, 1e12}, {2, 1, 0, 0}).optim_gather_bytes ==
        Approx(owned / 2 * 4));
  // One rank: nothing moves.
  auto one = args_for(1, "muon");
  const auto e1 = parallel::estimate(PlanRequest{&one, model.get(), 1, dev, 1e12}, {1, 1, 0, 0});
  CHECK(e1.optim_exchange_s == 0);
  CHECK(e1.optim_matrix_s > 0);
}

TEST_CASE("cost model: Muon keeps one momentum per matrix element where AdamW keeps two moments", "[planner][muon]") {
  const int64_t L = 2, C = 64;
  auto model = gpt(L, C);
  const auto dev = test_device();
  auto adamw = args_for(1, "adamw"), muon = args_for(1, "muon");
  const auto a = parallel::estimate(PlanRequest{&adamw, model.get(), 1, dev, 1e12}, {1, 1, 0, 0});
  const auto m = parallel::estimate(PlanRequest{&muon, model.get(), 1, dev, 1e12}, {1, 1, 0, 0});
  const double matrices = L * 12.0 * C * C;  // the block matrices' elements
  // 32-true: fp32 moments, 4 bytes each.
  CHECK(a.optim_bytes - m.optim_bytes == Approx(4 * matrices));
  CHECK(m.param_bytes == a.param_bytes);
  // The element-wise step reads and writes weights and state and reads the
  // gradient, at the device's memory bandwidth: AdamW 4 + 4 + 2 x 8 + 4 = 28
  // bytes per element; Muon's matrices 4 + 4 + 2 x 4 + 4 and its piece into the
  // exchange and its update back (2 x 2, bf16) = 24.
  double elements = 0;
  for (const auto& p : model->named_parameters()) elements += double(p.value().numel());
  CHECK(a.optim_elementwise_s == Approx(elements * 28 / dev.memory_bw));
  CHECK(m.optim_elementwise_s == Approx(((elements - matrices) * 28 + matrices * 24) / dev.memory_bw));
  CHECK(a.optim_step_s == a.optim_elementwise_s);
  CHECK(a.step_s == Approx(a.compute_s + a.comm_s + a.optim_step_s));
  // ZeRO over dp 2 halves each rank's element-wise work (its shard; padding aside).
  auto adamw2 = args_for(2, "adamw");
  const auto z = parallel::estimate(PlanRequest{&adamw2, model.get(), 2, dev, 1e12}, {1, 2, 1, 0});
  CHECK(z.optim_elementwise_s == Approx(a.optim_elementwise_s / 2).epsilon(1e-3));
}

TEST_CASE("planner: the plan's step time carries the optimizer's, and says which optimizer", "[planner][muon]") {
  auto model = gpt(2, 64);
  for (const std::string opt : {"adamw", "muon"}) {
    INFO(opt);
    auto args = args_for(2, opt);
    args.pas_policy = "autodist";
    PlanRequest req{&args, model.get(), 2, test_device(), 1e12};
    std::vector<parallel::Rejected> rejected;
    const auto plan = parallel::make_plan(req, &rejected);
    CHECK(plan.optimizer == opt);
    Candidate chosen{plan.tp, plan.dp, plan.zero_stage, 0};
    const auto e = parallel::estimate(req, chosen);
    CHECK(plan.estimate.step_s == Approx(e.step_s));
    CHECK(plan.estimate.optim_step_s > 0);
    // Every evaluated candidate was scored with its optimizer's step too.
    for (const auto& r : rejected)
      if (r.kind != "infeasible") CHECK(r.step_s == Approx(parallel::estimate(req, r.cand).step_s));
    const auto text = parallel::describe(plan);
    CHECK_THAT(text, Catch::Contains(" s (" + opt + ", ") && Catch::Contains("% of the step): "));
    if (opt == "muon") CHECK_THAT(text, Catch::Contains("Newton-Schulz (5 steps, bf16)"));
    // The JSON keeps it.
    const auto back = nlohmann::json(plan).get<parallel::Plan>();
    CHECK(back.optimizer == opt);
    CHECK(back.estimate.optim_matrix_flops == plan.estimate.optim_matrix_flops);
  }
}
