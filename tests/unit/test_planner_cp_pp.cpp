// The cost model and the search with context and pipeline parallelism
// together (cp x pp): a candidate is costed as the sum of its terms, each
// checked against an independent computation (another candidate's estimate,
// the documented closed forms of the ring and of 1F1B), and the search plans
// and explains cp x pp candidates.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "models/common/sharding.h"
#include "models/llama/llama.h"
#include "trainer/plan/planner.h"

using namespace nnstrain;
using parallel::Candidate;
using parallel::PlanRequest;

namespace {

// An 8-layer Llama of 1024 hidden, 8 query over 2 key/value heads (head_dim
// 128), on meta: only its shapes are read.
std::shared_ptr<models::llama::Llama> meta_gqa_llama() {
  models::llama::LlamaConfig lc;
  lc.num_hidden_layers = 8;
  lc.hidden_size = 1024;
  lc.intermediate_size = 3584;
  lc.num_attention_heads = 8;
  lc.num_key_value_heads = 2;
  lc.vocab_size = 4096;
  lc.max_position_embeddings = 65536;
  models::common::ShardingContext meta;
  meta.options = meta.options.device(c10::kMeta);
  return std::make_shared<models::llama::Llama>(lc, meta);
}

// bf16-mixed, micro-batch 1, `global` sequences of `seq` tokens on `world` ranks.
config::TrainerArgs bf16_args(int world, int64_t global, int64_t seq) {
  config::TrainerArgs a;
  a.compute_config.runtime_ngpus = world;
  a.compute_config.plan_ngpus = 1;
  a.pas_policy = "autodist";
  a.micro_batch_size = 1;
  a.global_batch_size = global;
  a.dataset.train_args.seq_len = seq;
  a.precision = "bf16-mixed";
  return a;
}

Candidate cp_pp(int cp, int pp, const std::string& comm = "p2p") {
  Candidate c{1, 1, 0, 0};
  c.cp = cp;
  c.cp_comm = comm;
  c.pp = c.stages = pp;
  c.scheduler = "1f1b";
  c.stage_layers = std::vector<int>(pp, 8 / pp);
  return c;
}

constexpr double kHeadDim = 1024 / 8, kKvHeads = 2, kAct = 2 /* bf16 */;

}  // namespace

TEST_CASE("cost model: cp x pp memory is the pipeline's at a rank's share of the sequence plus the ring's K/V",
          "[planner][cp][pp]") {
  auto model = meta_gqa_llama();
  const auto h100 = parallel::device_spec("H100");
  for (int cp : {2, 4}) {
    INFO("cp " << cp);
    const int64_t seq = 16384;
    // cp x pp2 on cp x 2 ranks, and pp2 alone on 2 ranks with each sequence cp times shorter:
    // every rank holds the same tokens, so the same activations but for the ring's.
    auto args = bf16_args(2 * cp, 8, seq), short_args = bf16_args(2, 8, seq / cp);
    PlanRequest req{&args, model.get(), 2 * cp, h100, 0}, short_req{&short_args, model.get(), 2, h100, 0};
    const auto both = parallel::estimate(req, cp_pp(cp, 2)), pipe = parallel::estimate(short_req, cp_pp(1, 2));
    // Parameters, gradients and optimizer state are replicated over cp (ZeRO 0).
    CHECK(both.param_bytes == pipe.param_bytes);
    CHECK(both.grad_bytes == pipe.grad_bytes);
    CHECK(both.optim_bytes == pipe.optim_bytes);
    // p2p holds two blocks of this rank's K and V (compute dtype) with their fp32
    // gradients during a layer's backward, the peak of stage 0 (2 micro-batches in flight).
    const double kv = double(seq) / cp * 2 * kKvHeads * kHeadDim * kAct, dkv = kv / kAct * 4;
    CHECK(both.activation_bytes - pipe.activation_bytes == Approx(2 * (kv + dkv)).epsilon(1e-9));
    CHECK(both.total_bytes - pipe.total_bytes == Approx(2 * (kv + dkv)).epsilon(1e-9));
    // all_gather holds the whole sequence's K/V and gradients instead.
    const auto gathered = parallel::estimate(req, cp_pp(cp, 2, "all_gather"));
    CHECK(gathered.activation_bytes - pipe.activation_bytes == Approx(cp * (kv + dkv)).epsilon(1e-9));
    // And against pp2 at the whole sequence: activations fall with cp (the K/V a small share).
    auto long_args = bf16_args(2, 8, seq);
    PlanRequest long_req{&long_args, model.get(), 2, h100, 0};
    const auto whole = parallel::estimate(long_req, cp_pp(1, 2));
    CHECK(both.activation_bytes / whole.activation_bytes == Approx(1.0 / cp).epsilon(0.10));
    // ZeRO-1 shards the optimizer state over dp x cp = cp ranks, where pp2 alone has nothing to shard it over.
    auto z1 = cp_pp(cp, 2);
    z1.zero_stage = 1;
    CHECK(parallel::estimate(req, z1).optim_bytes == Approx(pipe.optim_bytes / cp).epsilon(0.01));
  }
}

TEST_CASE("cost model: a cp x pp stage's time includes the ring's exposed communication", "[planner][cp][pp]") {
  auto model = meta_gqa_llama();
  auto dev = parallel::device_spec("H100");
  const int cp = 2, p = 2, m = 8;
  const int64_t seq = 16384;
  auto args = bf16_args(cp * p, m, seq);
  PlanRequest req{&args, model.get(), cp * p, dev, 0};
  // p2p at 8192 tokens per rank: each block's attention outlasts its K/V's
  // transfer over NVLink, so nothing is exposed; the blocks are slowed by the
  // transfers beside them (kOverlapContention of each, cp - 1 per layer).
  const auto hidden = parallel::estimate(req, cp_pp(cp, p, "p2p"));
  const double kv = double(seq) / cp * 2 * kKvHeads * kHeadDim * kAct, dkv = kv / kAct * 4;
  const double layers_per_stage = 8.0 / p;
  const double send_f = dev.collective_latency_s + kv / dev.intra_node_bw, send_b = send_f + dkv / dev.intra_node_bw;
  const double hidden_per_micro = layers_per_stage * (cp - 1) * parallel::kOverlapContention * (send_f + send_b);
  CHECK(hidden.cp_comm_s == Approx(m * hidden_per_micro).epsilon(1e-9));
  // all_gather exposes all of it: per layer, forward gathers K/V (alpha + (cp-1) kv / bw),
  // backward gathers again and reduce-scatters the fp32 gradients.
  const auto gathered = parallel::estimate(req, cp_pp(cp, p, "all_gather"));
  const double fwd = dev.collective_latency_s + (cp - 1) * kv / dev.intra_node_bw;
  const double bwd = fwd + dev.collective_latency_s + (cp - 1) * dkv / dev.intra_node_bw;
  const double per_micro = layers_per_stage * (fwd + bwd);  // one stage, one micro-batch
  CHECK(gathered.cp_comm_s == Approx(m * per_micro).epsilon(1e-9));
  // The ring is on the stages' critical path: 1F1B with equal stages spans
  // (m + p - 1) forward-backward pairs, each longer by the ring's time.
  CHECK(gathered.step_s - hidden.step_s == Approx((m + p - 1) * (per_micro - hidden_per_micro)).epsilon(1e-6));
  CHECK(gathered.compute_s == hidden.compute_s);
  // The bubble: 1F1B's at equal stages, plus what the lighter stage idles
  // behind the head's (vocab 4096: 0.14 of a layer's FLOPs at this sequence,
  // 3.5% of a 4-layer stage; each stage is simulated at its own cost).
  CHECK(gathered.pp_bubble > double(p - 1) / (m + p - 1));
  CHECK(gathered.pp_bubble < double(p - 1) / (m + p - 1) + 0.035 / 2 + 1e-9);
}

TEST_CASE("planner: cp x pp is planned as the config names it, and searched and explained under autodist",
          "[planner][cp][pp]") {
  auto model = meta_gqa_llama();
  const auto h100 = parallel::device_spec("H100");
  // The trainer's request: cp 2 and pp 2 named by the config, the only split tried.
  auto args = bf16_args(8, 8, 16384);
  args.compute_config.context_parallel_size = 2;
  args.compute_config.pipeline.pp_size = 2;
  PlanRequest req{&args, model.get(), 8, h100, 0};
  const auto plan = parallel::make_plan(req);
  CHECK(plan.context.cp == 2);
  CHECK(plan.pipeline.pp == 2);
  CHECK(plan.dp == 2);
  CHECK(plan.world == plan.tp * plan.context.cp * plan.pipeline.pp * plan.dp);
  Candidate c = cp_pp(2, 2);
  c.dp = plan.dp;
  c.zero_stage = plan.zero_stage;
  c.stage_layers = plan.pipeline.stage_layers;
  c.recompute_layers = 0;
  for (bool r : plan.recompute) c.recompute_layers += r;
  c.recompute_layers /= plan.pipeline.stages;
  CHECK(plan.estimate.total_bytes == parallel::estimate(req, c).total_bytes);

  // `nnstrain plan` (both searches on), a budget nothing without cp meets:
  // candidates with cp and pp together are priced, and every one not taken
  // has one reason.
  auto free_args = bf16_args(8, 8, 65536);
  free_args.model.loss = "fused";
  PlanRequest free_req{&free_args, model.get(), 8, h100, 1e15};
  free_req.search_pipeline = true;
  // The least any candidate without cp needs: every one fits an ample budget
  // and is listed (rejected or chosen) with its estimate.
  std::vector<parallel::Rejected> without;
  double least_without_cp = parallel::make_plan(free_req, &without).estimate.total_bytes;
  for (const auto& r : without)
    if (r.kind != "infeasible") least_without_cp = std::min(least_without_cp, r.memory_bytes);
  free_req.search_context = true;
  free_req.memory_budget_bytes = 0.9 * least_without_cp;
  std::vector<parallel::Rejected> rejected;
  const auto chosen = parallel::make_plan(free_req, &rejected);
  INFO(parallel::describe(chosen));
  CHECK(chosen.context.cp > 1);
  CHECK(chosen.estimate.total_bytes <= free_req.memory_budget_bytes);
  int both = 0;
  for (const auto& r : rejected) {
    INFO(r.candidate << ": " << r.reason);
    CHECK_FALSE(r.reason.empty());
    CHECK(r.reason.find('\n') == std::string::npos);
    if (r.cand.cp > 1 && r.cand.pp > 1) ++both;
  }
  CHECK(both > 0);

  // A pp_size the config names, under autodist with cp free: when no pp2 plan
  // fits without cp, the search splits the sequences of that pipeline.
  free_args.compute_config.pipeline.pp_size = 2;
  free_req.search_context = false;
  free_req.memory_budget_bytes = 1e15;
  std::vector<parallel::Rejected> pp_only;
  double least_pp2 = parallel::make_plan(free_req, &pp_only).estimate.total_bytes;
  for (const auto& r : pp_only) {
    CHECK(r.cand.pp == 2);
    if (r.kind != "infeasible") least_pp2 = std::min(least_pp2, r.memory_bytes);
  }
  free_req.search_context = true;
  free_req.memory_budget_bytes = 0.9 * least_pp2;
  const auto cp_pp_plan = parallel::make_plan(free_req);
  INFO(parallel::describe(cp_pp_plan));
  CHECK(cp_pp_plan.pipeline.pp == 2);
  CHECK(cp_pp_plan.context.cp > 1);
  CHECK(cp_pp_plan.world == cp_pp_plan.tp * cp_pp_plan.context.cp * 2 * cp_pp_plan.dp);
  CHECK(cp_pp_plan.estimate.total_bytes <= free_req.memory_budget_bytes);
}
