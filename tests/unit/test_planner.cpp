// The planner: candidates, the cost model's arithmetic, the search (checked
// against a brute-force oracle over the same estimates), refusals with their
// numbers, determinism, the Plan's JSON, and `nnstrain plan` end to end.
#include <catch2/catch.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <tuple>

#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "trainer/cli/plan_command.h"
#include "base/config/arg_map.h"
#include "models/common/sharding.h"
#include "trainer/plan/plan.h"
#include "trainer/plan/planner.h"

using namespace nnstrain;
using parallel::Candidate;
using parallel::PlanRequest;

namespace {

std::shared_ptr<models::gpt::Gpt> gpt(int64_t layers, int64_t heads, int64_t embd, int64_t vocab, int64_t block,
                                      bool bias = true) {
  models::gpt::GptConfig c;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = embd;
  c.vocab_size = vocab;
  c.block_size = block;
  c.bias = bias;
  return std::make_shared<models::gpt::Gpt>(c);
}

// What load_trainer_args would produce for these keys (global batch resolved).
config::TrainerArgs args_for(int world, int plan_ngpus, int64_t micro, int64_t global, int64_t seq,
                             const std::string& policy = "autodist") {
  config::TrainerArgs a;
  a.compute_config.runtime_ngpus = world;
  a.compute_config.plan_ngpus = plan_ngpus;
  a.pas_policy = policy;
  a.micro_batch_size = micro;
  a.global_batch_size = global;
  a.dataset.train_args.seq_len = seq;
  a.precision = "32-true";
  return a;
}

// A slow accelerator, so compute dominates the tiny models as it does real ones.
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

std::string key(const parallel::Plan& p) {
  int k = 0;
  for (bool r : p.recompute) k += r;
  return "tp=" + std::to_string(p.tp) + " zero=" + std::to_string(p.zero_stage) + " k=" + std::to_string(k);
}

// Every candidate of autodist for (world, plan_ngpus), by hand.
std::vector<Candidate> all_candidates(int world, int plan_ngpus, int layers) {
  std::vector<Candidate> out;
  for (int t = 1; t <= plan_ngpus; ++t) {
    if (plan_ngpus % t || world % t) continue;
    const int dp = world / t;
    for (int z = 0; z <= (dp > 1 ? 3 : 0); ++z)
      for (int k = 0; k <= layers; ++k) out.push_back({t, dp, z, k});
  }
  return out;
}

struct TempDir {
  std::string path;
  std::vector<std::string> files;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/nnstrain_planner_XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    for (const auto& f : files) ::unlink(f.c_str());
    ::rmdir(path.c_str());
  }
  std::string write(const std::string& name, const std::string& text) {
    const auto f = path + "/" + name;
    std::ofstream(f) << text;
    files.push_back(f);
    return f;
  }
};

}  // namespace

TEST_CASE("planner: an ample budget gives pure data parallelism", "[planner]") {
  auto model = gpt(4, 4, 128, 256, 64);
  auto args = args_for(4, 4, 4, 16, 64);
  PlanRequest req{&args, model.get(), 4, test_device(), 1e12};
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, &rejected);
  CHECK(plan.tp == 1);
  CHECK(plan.dp == 4);
  CHECK_FALSE(plan.zero_stage);
  CHECK(plan.recompute == std::vector<bool>(4, false));
  CHECK(plan.grad_accumulation_steps == 1);
  CHECK(plan.estimate.total_bytes <= 1e12);
  // Everything else fits as well: the other ZeRO stages shard more than
  // needed, every other tp or recompute is not needed.
  CHECK(rejected.size() == all_candidates(4, 4, 4).size() - 1);
  for (const auto& r : rejected) {
    INFO(r.candidate << ": " << r.reason);
    if (r.cand.zero_stage > 0) {
      CHECK(r.kind == "sharding");
      CHECK_THAT(r.reason, Catch::Contains("zero=0 fits"));
    } else {
      CHECK(r.kind == "order");
    }
  }
  for (const auto& p : plan.params) CHECK(p.local_shape == p.global_shape);
}

TEST_CASE("planner: the cost model's arithmetic", "[planner]") {
  const int64_t L = 2, C = 64, V = 128, T = 32;
  auto model = gpt(L, 4, C, V, T);
  auto args = args_for(2, 2, 2, 4, T);
  PlanRequest req{&args, model.get(), 2, test_device(), 1e12};
  // Parameters: wte V*C, wpe T*C, per layer 12C^2 + 13C (with biases), ln_f 2C.
  const double total = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C;
  const auto e1 = parallel::estimate(req, {1, 2, 0, 0});
  CHECK(e1.param_bytes == 4 * total);
  CHECK(e1.grad_bytes == 4 * total);
  CHECK(e1.optim_bytes == 8 * total);
  // tp=2: wte (vocab) and the column/row weights and column biases halve.
  const double local = V * C / 2 + T * C + L * (6 * C * C + 4 * C + 1.5 * C + C + 2 * C + C) + 2 * C;
  const auto e2 = parallel::estimate(req, {2, 1, 0, 0});
  CHECK(e2.param_bytes == 4 * local);
  // ZeRO over dp=2 halves the optimizer states (plus at most one pad element per bucket).
  const auto ez = parallel::estimate(req, {1, 2, 1, 0});
  CHECK(ez.optim_bytes >= 4 * total);
  CHECK(ez.optim_bytes <= 4 * total + 8);
  // Activations (fp32, fused attention): a GPT block keeps 16 s*b*h elements
  // (input, ln_1 out, q k v, attention out, residual, ln_2 out, c_fc out and
  // GELU at 4h each); the peak is the larger of backward's start (every block,
  // the last block's output and ln_f's, three fp32 [tokens, V] logits tensors)
  // and the last block's backward (every block, the incoming gradient h,
  // GELU's gradient 4h, autograd's gradient of c_fc's weight, 4h x h, and the
  // tied embedding's gradient from the head, V x h, waiting for the
  // embedding's part).
  const double s = T, b = 2, h = C, tok = s * b;
  const double layer = tok * 16 * h * 4;
  const double saved = L * layer, block_bwd = tok * 5 * h * 4 + 4 * h * h * 4 + V * h * 4;
  CHECK(e1.activation_bytes == Approx(std::max(saved + tok * 2 * h * 4 + tok * V * 12, saved + block_bwd)));
  PlanRequest unfused = req;
  unfused.fused_attention = false;
  CHECK(parallel::estimate(unfused, {1, 2, 0, 0}).activation_bytes ==
        Approx(e1.activation_bytes + L * tok * 2 * 4 * s * 4));  // scores and softmax, 4 heads
  // Recomputing every layer keeps L inputs; the last block rebuilt whole (its
  // output held) then its backward.
  const auto er = parallel::estimate(req, {1, 2, 0, static_cast<int>(L)});
  const double inputs = L * tok * h * 4;
  CHECK(er.activation_bytes == Approx(std::max(inputs + tok * 2 * h * 4 + tok * V * 12,
                                               inputs + layer - tok * h * 4 + tok * h * 4 + block_bwd)));
  // With a vocabulary whose logits dominate, the chunked loss keeps no [tokens, V] logits.
  auto big_vocab = gpt(L, 4, C, 8192, T);
  PlanRequest plain_big{&args, big_vocab.get(), 2, test_device(), 1e12};
  const auto e_plain = parallel::estimate(plain_big, {1, 2, 0, 0});
  CHECK(e_plain.activation_bytes == Approx(saved + tok * 2 * h * 4 + tok * 8192 * 12));
  auto chunked_args = args;
  chunked_args.model.loss = "chunked";
  chunked_args.model.loss_chunk_size = 16;
  PlanRequest chunked{&chunked_args, big_vocab.get(), 2, test_device(), 1e12};
  CHECK(parallel::estimate(chunked, {1, 2, 0, 0}).activation_bytes < e_plain.activation_bytes);
  // The fused loss: from its last chunk on, fp32 gradients of hidden [tok, h] and
  // head weight [V, h] and one chunk's fp32 logits (fp32 compute: no 16-bit copies);
  // then a block's backward (with the tied head's gradient waiting) may be the peak.
  auto fused_args = chunked_args;
  fused_args.model.loss = "fused";
  PlanRequest fused{&fused_args, big_vocab.get(), 2, test_device(), 1e12};
  const auto e_fused = parallel::estimate(fused, {1, 2, 0, 0});
  const double big_block_bwd = tok * 5 * h * 4 + 4 * h * h * 4 + 8192 * h * 4;
  CHECK(e_fused.activation_bytes ==
        Approx(std::max(saved + tok * 2 * h * 4 + (tok + 8192) * h * 4 + 16 * 8192 * 4, saved + big_block_bwd)));
  CHECK(e_fused.activation_bytes < e_plain.activation_bytes);
  // auto: fused once the tokens (64) exceed the chunk, plain at a chunk of 64 or more.
  auto auto_args = chunked_args;
  auto_args.model.loss = "auto";
  PlanRequest auto_small{&auto_args, big_vocab.get(), 2, test_device(), 1e12};
  CHECK(parallel::estimate(auto_small, {1, 2, 0, 0}).activation_bytes == Approx(e_fused.activation_bytes));
  auto_args.model.loss_chunk_size = 64;
  PlanRequest auto_whole{&auto_args, big_vocab.get(), 2, test_device(), 1e12};
  CHECK(parallel::estimate(auto_whole, {1, 2, 0, 0}).activation_bytes == Approx(e_plain.activation_bytes));
  // Sequence parallelism (on by default) splits what tp leaves whole.
  auto no_sp_args = args;
  no_sp_args.compute_config.sequence_parallel = false;
  PlanRequest no_sp{&no_sp_args, model.get(), 2, test_device(), 1e12};
  const auto e_sp = parallel::estimate(req, {2, 1, 0, 0}), e_nosp = parallel::estimate(no_sp, {2, 1, 0, 0});
  CHECK(e_sp.activation_bytes < e_nosp.activation_bytes);
  CHECK(e_nosp.activation_bytes < e1.activation_bytes);
  // Per ZeRO stage over dp 2: 1 shards the optimizer state (the full gradient
  // stays, plus the reduced half), 2 the gradients too, 3 the parameters too.
  const auto z1 = parallel::estimate(req, {1, 2, 1, 0}), z2 = parallel::estimate(req, {1, 2, 2, 0}),
             z3 = parallel::estimate(req, {1, 2, 3, 0});
  CHECK(z1.param_bytes == e1.param_bytes);
  CHECK(z1.grad_bytes == Approx(1.5 * e1.grad_bytes).epsilon(1e-3));
  CHECK(z2.grad_bytes == Approx(0.5 * e1.grad_bytes).epsilon(1e-3));
  CHECK(z2.optim_bytes == z1.optim_bytes);
  CHECK(z3.param_bytes == Approx(0.5 * e1.param_bytes).epsilon(1e-3));
  CHECK(z3.optim_bytes == Approx(0.5 * e1.optim_bytes).epsilon(1e-3));
  CHECK(z3.grad_bytes == Approx(z2.grad_bytes).epsilon(1e-3));
  // What lives only around the peak grows with the stage: ZeRO-2's buckets, ZeRO-3's gathered units.
  CHECK(z1.transient_bytes == e1.transient_bytes);
  CHECK(z2.transient_bytes > z1.transient_bytes);
  CHECK(z3.transient_bytes > z2.transient_bytes);
  CHECK(z1.total_bytes < e1.total_bytes);
  CHECK(z3.param_bytes + z3.grad_bytes + z3.optim_bytes < z2.param_bytes + z2.grad_bytes + z2.optim_bytes);
  CHECK(er.compute_s > e1.compute_s);
  // Per-rank compute is the same for every split of the same world.
  CHECK(e2.compute_s == Approx(e1.compute_s));
  CHECK(e1.tp_comm_s == 0);
  CHECK(e2.tp_comm_s > 0);
  CHECK(e2.dp_comm_s == 0);
  // The step from first principles: a GPT's 6 FLOPs per matmul parameter per
  // token (12 C^2 a layer, the head's V C) plus causal attention's half of
  // 12 L C T, over this rank's 2 sequences of T tokens (global 4 over dp 2), at
  // kAssumedEfficiency (1/2) of the device's 1e12 FLOP/s; the rest of e1's step
  // is its exposed gradient reduction and AdamW's step: every parameter's
  // weight and two moments read and written and its gradient read (fp32:
  // 28 bytes) at the device's memory bandwidth.
  const double flops_per_token = 6 * (L * 12 * C * C + V * C) + 6 * L * C * T;
  const double compute = 2 * T * flops_per_token / (0.5 * 1e12);
  CHECK(e1.compute_s == Approx(compute));
  CHECK(e1.optim_step_s == Approx(total * 28 / req.device.memory_bw));
  CHECK(e1.step_s == Approx(compute + e1.dp_comm_s + e1.optim_step_s));
}

// The selection rule by brute force over the same estimates: per (tp, k) the
// least ZeRO stage that fits; (smallest tp, k = 0) if it has one, else the
// fastest of them, ties to the smaller tp then the smaller k.
const Candidate* oracle(const std::vector<Candidate>& cands, const PlanRequest& req) {
  std::map<std::pair<int, int>, const Candidate*> least;
  for (const auto& c : cands) {
    if (parallel::estimate(req, c).total_bytes > parallel::memory_budget(req)) continue;
    auto& slot = least[{c.tp, c.recompute_layers}];
    if (!slot || c.zero_stage < slot->zero_stage) slot = &c;
  }
  if (least.empty()) return nullptr;
  if (least.begin()->first == std::make_pair(cands.front().tp, 0)) return least.begin()->second;
  const Candidate* best = nullptr;
  for (const auto& [key, c] : least)
    if (!best || parallel::estimate(req, *c).step_s < parallel::estimate(req, *best).step_s) best = c;
  return best;
}

TEST_CASE("planner: shrinking the budget escalates ZeRO 0 -> 1 -> 2 -> 3 before recompute or tensor parallel",
          "[planner]") {
  // Deep enough that ZeRO-3's gathered units (embedding, head, two blocks and
  // two blocks' gradients) cost less than the 3/4 of the parameters it shards.
  const int L = 12, world = 4;
  auto model = gpt(L, 4, 128, 256, 64);
  auto args = args_for(world, 4, 4, 16, 64);
  args.compute_config.reducer_bucket_cap_mb = 0.25;  // ZeRO-2 keeps two buckets, not the whole gradient
  PlanRequest req{&args, model.get(), world, test_device(), 0};
  auto est = [&](Candidate c) { return parallel::estimate(req, c); };
  const double pure_dp = est({1, 4, 0, 0}).total_bytes;
  // Each stage needs less memory than the one before it.
  for (int z = 1; z <= 3; ++z) REQUIRE(est({1, 4, z, 0}).total_bytes < est({1, 4, z - 1, 0}).total_bytes);
  // tp 2 without ZeRO needs less than ZeRO-2 at tp 1, yet ZeRO-2 and ZeRO-3 come first.
  REQUIRE(est({2, 2, 0, 0}).total_bytes < est({1, 4, 2, 0}).total_bytes);

  std::vector<std::string> sequence;
  double budget = pure_dp;
  bool threw = false;
  for (int i = 0; i < 400 && !threw; ++i, budget *= 0.98) {
    req.memory_budget_bytes = budget;
    std::vector<parallel::Rejected> rejected;
    parallel::Plan plan;
    try {
      plan = parallel::make_plan(req, &rejected);
    } catch (const parallel::PlanError& e) {
      threw = true;
      CHECK(e.min_bytes > budget);
      break;
    }
    INFO("budget " << budget << " chose " << key(plan));
    if (plan.offload_ratio > 0) {
      // Offload last: only once no candidate without it fits (the oracle's, which knows none with it).
      CHECK(oracle(all_candidates(world, 4, L), req) == nullptr);
      CHECK(plan.estimate.total_bytes <= budget);
      CHECK(plan.estimate.host_bytes > 0);
      if (sequence.empty() || sequence.back() != "offload") sequence.push_back("offload");
      continue;
    }
    CHECK(plan.estimate.total_bytes <= budget);
    const auto cands = all_candidates(world, 4, L);
    const Candidate* best = oracle(cands, req);
    REQUIRE(best != nullptr);
    CHECK(plan.tp == best->tp);
    CHECK(plan.zero_stage == best->zero_stage);
    int k = 0;
    for (bool r : plan.recompute) k += r;
    CHECK(k == best->recompute_layers);
    // Every lower stage at the plan's tp and recompute is over the budget, and says by how much.
    for (const auto& r : rejected)
      if (r.cand.tp == plan.tp && r.cand.recompute_layers == k && r.cand.zero_stage < plan.zero_stage) {
        CHECK(r.kind == "memory");
        CHECK_THAT(r.reason, Catch::Contains("over the budget"));
      }
    if (sequence.empty() || sequence.back() != key(plan)) sequence.push_back(key(plan));
  }
  CHECK(threw);
  REQUIRE(sequence.size() >= 6);
  CHECK(sequence.back() == "offload");  // then optimizer (and parameter) offload, before nothing fits
  CHECK(sequence[0] == "tp=1 zero=0 k=0");
  CHECK(sequence[1] == "tp=1 zero=1 k=0");
  CHECK(sequence[2] == "tp=1 zero=2 k=0");
  CHECK(sequence[3] == "tp=1 zero=3 k=0");
  // Then recompute or tensor parallelism, each at its least stage that fits.
  CHECK((sequence[4].find("k=0") == std::string::npos || sequence[4].find("tp=1") == std::string::npos));
}

TEST_CASE("planner: a GPT whose one-process training does not fit the budget is planned as ZeRO-3 at dp 4",
          "[planner]") {
  auto model = gpt(12, 4, 256, 512, 64);
  auto one = args_for(1, 1, 2, 2, 64);
  PlanRequest req1{&one, model.get(), 1, test_device(), 0};
  const double dp1 = parallel::estimate(req1, {1, 1, 0, 0}).total_bytes;
  auto four = args_for(4, 4, 2, 8, 64);  // plan_ngpus 4: tp 2 and 4 are candidates too
  four.compute_config.reducer_bucket_cap_mb = 1;
  PlanRequest req4{&four, model.get(), 4, test_device(), 0};
  const double z2 = parallel::estimate(req4, {1, 4, 2, 0}).total_bytes;
  const double z3 = parallel::estimate(req4, {1, 4, 3, 0}).total_bytes;
  REQUIRE(z3 < z2);
  const double budget = (z2 + z3) / 2;  // ZeRO-3 fits, ZeRO-2 does not
  REQUIRE(dp1 > budget);
  req1.memory_budget_bytes = req4.memory_budget_bytes = budget;
  // One process: nothing without offload fits (only recompute, still too much).
  try {
    const auto p1 = parallel::make_plan(req1);
    CHECK((p1.offload_ratio > 0 || p1.offload_params));
  } catch (const parallel::PlanError&) {
  }
  auto no_offload = one;
  no_offload.pas_policy = "dp";  // a fixed policy never offloads by itself
  PlanRequest req1_dp{&no_offload, model.get(), 1, test_device(), budget};
  CHECK_THROWS_AS(parallel::make_plan(req1_dp), parallel::PlanError);
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req4, &rejected);
  CHECK(plan.tp == 1);
  CHECK(plan.dp == 4);
  CHECK(plan.zero_stage == 3);
  CHECK(std::count(plan.recompute.begin(), plan.recompute.end(), true) == 0);
  CHECK(plan.estimate.total_bytes <= budget);
  // tp 2 fits at a lower stage, but ZeRO is escalated first; the explanation says so.
  bool tp2_explained = false;
  for (const auto& r : rejected)
    if (r.cand.tp == 2 && r.kind == "order") {
      CHECK_THAT(r.reason, Catch::Contains("needs no tensor parallelism"));
      tp2_explained = true;
    }
  CHECK(tp2_explained);
  // Autodist tries ZeRO only where the ZeRO group has two or more ranks; a
  // stage the config names runs anyway (on one-rank groups) and is estimated
  // with the buffers it gathers.
  std::vector<parallel::Rejected> at_one;
  const auto plan1 = parallel::make_plan({&one, model.get(), 1, test_device(), 1e12}, &at_one);
  CHECK(plan1.zero_stage == 0);
  for (const auto& r : at_one) CHECK(r.cand.zero_stage == 0);
  auto fixed = args_for(1, 1, 2, 2, 64);
  fixed.compute_config.use_zero = 3;
  const auto plan3 = parallel::make_plan({&fixed, model.get(), 1, test_device(), 1e12});
  CHECK(plan3.zero_stage == 3);
  CHECK(plan3.estimate.total_bytes > dp1);
}

TEST_CASE("planner: an impossible budget is an error stating the minimum", "[planner]") {
  auto model = gpt(2, 4, 64, 128, 32);
  auto args = args_for(2, 2, 2, 4, 32);
  PlanRequest req{&args, model.get(), 2, test_device(), 64 * 1024};
  // Every candidate autodist tries when nothing fits: each also with the
  // optimizer offloaded, and at ZeRO-3 with the parameters too.
  double least = std::numeric_limits<double>::infinity();
  for (auto c : all_candidates(2, 2, 2)) {
    least = std::min(least, parallel::estimate(req, c).total_bytes);
    c.offload_ratio = 1.0;
    least = std::min(least, parallel::estimate(req, c).total_bytes);
    c.zero_stage = 3;
    c.offload_params = true;
    least = std::min(least, parallel::estimate(req, c).total_bytes);
  }
  try {
    parallel::make_plan(req);
    FAIL("expected PlanError");
  } catch (const parallel::PlanError& e) {
    CHECK(e.min_bytes == least);
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains(parallel::format_bytes(least)));
    CHECK_THAT(msg, Catch::Contains("64.0 KiB"));
    CHECK_THAT(msg, Catch::Contains("memory_budget_gb"));
  }
}

TEST_CASE("planner: infeasible tensor-parallel sizes are refused with the numbers", "[planner]") {
  // Heads tp does not divide split unevenly (6 over 4: 2, 2, 1, 1); fewer heads than ranks cannot split.
  auto six_heads = gpt(2, 6, 96, 192, 32);
  for (int tp : {2, 3, 4, 5, 6}) CHECK_NOTHROW(parallel::check_tp_feasible(*six_heads, tp));
  CHECK_THROWS_WITH(parallel::check_tp_feasible(*six_heads, 8),
                    Catch::Contains("attention heads 6 are fewer than tp 8"));
  auto two_heads = gpt(2, 2, 32, 192, 32);
  CHECK_THROWS_WITH(parallel::check_tp_feasible(*two_heads, 4),
                    Catch::Contains("attention heads 2 are fewer than tp 4"));
  // GQA: key/value heads carry their query groups, so they must number at least tp.
  nnstrain::models::llama::LlamaConfig lc;
  lc.vocab_size = 64;
  lc.hidden_size = 64;
  lc.intermediate_size = 96;
  lc.num_hidden_layers = 1;
  lc.num_attention_heads = 8;
  lc.num_key_value_heads = 2;
  lc.max_position_embeddings = 32;
  auto gqa = std::make_shared<nnstrain::models::llama::Llama>(lc);
  CHECK_NOTHROW(parallel::check_tp_feasible(*gqa, 2));
  CHECK_THROWS_WITH(parallel::check_tp_feasible(*gqa, 4), Catch::Contains("key/value heads 2 are fewer than tp 4"));
  lc.num_key_value_heads = 4;
  CHECK_NOTHROW(parallel::check_tp_feasible(nnstrain::models::llama::Llama(lc), 3));  // kv 2, 1, 1; q 4, 2, 2
  // A vocabulary tp does not divide is padded, not refused.
  auto odd_vocab = gpt(2, 4, 64, 65, 32);
  CHECK_NOTHROW(parallel::check_tp_feasible(*odd_vocab, 2));
  CHECK_NOTHROW(parallel::check_tp_feasible(*odd_vocab, 4));

  // autodist skips tp=4 (and says why) but still plans.
  auto args = args_for(4, 4, 1, 4, 32);
  PlanRequest req{&args, two_heads.get(), 4, test_device(), 0};
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, &rejected);
  CHECK(plan.tp != 4);
  bool refused = false;
  for (const auto& r : rejected)
    if (r.cand.tp == 4) {
      CHECK(r.kind == "infeasible");
      CHECK_THAT(r.reason, Catch::Contains("attention heads 2 are fewer than tp 4"));
      refused = true;
    }
  CHECK(refused);
  // The tp policy has no fallback: the split itself is the error.
  auto tp_args = args_for(4, 4, 1, 4, 32, "tp");
  PlanRequest tp_req{&tp_args, two_heads.get(), 4, test_device(), 0};
  CHECK_THROWS_AS(parallel::make_plan(tp_req), parallel::PlanError);
  CHECK_THROWS_WITH(parallel::make_plan(tp_req), Catch::Contains("attention heads 2"));
  PlanRequest six_req{&tp_args, six_heads.get(), 4, test_device(), 0};
  CHECK(parallel::make_plan(six_req).tp == 4);
  // A global batch that dp cannot divide rules the candidate out.
  auto odd_batch = args_for(4, 4, 1, 2, 32);
  PlanRequest ob{&odd_batch, two_heads.get(), 4, test_device(), 0};
  const auto p2 = parallel::make_plan(ob);
  CHECK(p2.tp == 2);  // dp 4 cannot split a batch of 2, tp 4 cannot split 2 heads
  CHECK(p2.dp == 2);
}

TEST_CASE("planner: fixed policies and config switches", "[planner]") {
  auto model = gpt(3, 4, 64, 128, 32);
  SECTION("hybrid: tp = plan_ngpus, dp = world / tp") {
    auto args = args_for(8, 2, 1, 4, 32, "hybrid");
    const auto p = parallel::make_plan({&args, model.get(), 8, test_device(), 0});
    CHECK(p.tp == 2);
    CHECK(p.dp == 4);
    CHECK(p.params.front().split == "vocab");
  }
  SECTION("tp needs world == plan_ngpus") {
    auto args = args_for(8, 2, 1, 4, 32, "tp");
    CHECK_THROWS_WITH(parallel::make_plan({&args, model.get(), 8, test_device(), 0}),
                      Catch::Contains("runtime_ngpus 8 must equal compute_config.plan_ngpus 2"));
  }
  SECTION("dp: tp = 1 even when plan_ngpus allows more") {
    auto args = args_for(4, 4, 1, 4, 32, "dp");
    const auto p = parallel::make_plan({&args, model.get(), 4, test_device(), 0});
    CHECK(p.tp == 1);
    CHECK(p.dp == 4);
  }
  SECTION("use_zero keeps ZeRO on, activation_checkpointing recomputes every layer") {
    auto args = args_for(4, 1, 1, 4, 32);
    args.compute_config.use_zero = 1;
    args.model.activation_checkpointing = true;
    const auto p = parallel::make_plan({&args, model.get(), 4, test_device(), 0});
    CHECK(p.zero_stage == 1);
    CHECK(p.recompute == std::vector<bool>(3, true));
  }
  SECTION("mixed precision: 2-byte params, 4-byte grads, 12-byte optimizer state") {
    auto args = args_for(1, 1, 1, 1, 32);
    args.precision = "bf16-mixed";
    parallel::PlanRequest req{&args, model.get(), 1, test_device(), 0};
    const auto e = parallel::estimate(req, {1, 1, false, 0});
    CHECK(e.grad_bytes == 2 * e.param_bytes);
    CHECK(e.optim_bytes == 6 * e.param_bytes);
  }
}

TEST_CASE("planner: deterministic, and the Plan's JSON round-trips", "[planner]") {
  auto args = args_for(4, 4, 2, 8, 32);
  torch::manual_seed(1);
  auto m1 = gpt(3, 4, 64, 128, 32);
  torch::manual_seed(2);
  auto m2 = gpt(3, 4, 64, 128, 32);  // other weights, same shapes
  const double budget = 0.6 * parallel::estimate({&args, m1.get(), 4, test_device(), 0}, {1, 4, false, 0}).total_bytes;
  const auto p1 = parallel::make_plan({&args, m1.get(), 4, test_device(), budget});
  const auto p2 = parallel::make_plan({&args, m2.get(), 4, test_device(), budget});
  nlohmann::json j1 = p1, j2 = p2;
  CHECK(j1.dump() == j2.dump());
  CHECK(parallel::describe(p1, true) == parallel::describe(p2, true));

  parallel::Plan back = nlohmann::json::parse(j1.dump()).get<parallel::Plan>();
  nlohmann::json j3 = back;
  CHECK(j3.dump() == j1.dump());
  CHECK(back.tp == p1.tp);
  CHECK(back.recompute == p1.recompute);
  CHECK(back.params.size() == p1.params.size());
  CHECK(back.estimate.step_s == p1.estimate.step_s);
  // A broken plan is refused.
  j1["world"] = 3;
  CHECK_THROWS_WITH(j1.get<parallel::Plan>(), Catch::Contains("world 3 != tp"));
}

TEST_CASE("planner: describe folds identical layers", "[planner]") {
  auto model = gpt(3, 4, 64, 128, 32);
  auto args = args_for(2, 2, 1, 1, 32, "tp");
  const auto p = parallel::make_plan({&args, model.get(), 2, test_device(), 0});
  const auto text = parallel::describe(p);
  CHECK_THAT(text, Catch::Contains("h.*.attn.c_attn.weight (x3)"));
  CHECK_THAT(text, Catch::Contains("[192, 64] -> [96, 64]"));
  CHECK_THAT(text, Catch::Contains("h.*.mlp.c_proj.weight (x3)"));
  CHECK_THAT(text, Catch::Contains("[64, 256] -> [64, 128]"));
  CHECK(text.find("h.0.") == std::string::npos);
}

TEST_CASE("planner: build_model_for_planning allocates no weights", "[planner]") {
  config::TrainerArgs args;
  args.model.type = "gpt";
  auto cfg = std::make_shared<models::gpt::GptConfig>();  // GPT-2 124M (vocab 50304)
  args.model.args = cfg;
  const auto model = cli::build_model_for_planning(args);
  double numel = 0;
  for (const auto& p : model->named_parameters()) {
    CHECK(p.value().is_meta());
    numel += double(p.value().numel());
  }
  const double V = 50304, C = 768, T = 1024, L = 12;
  CHECK(numel == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C);  // 124,475,904
  // Ordinary tensors made afterwards are real again.
  CHECK_FALSE(torch::zeros({2}).is_meta());
}

TEST_CASE("planner: nnstrain plan end to end", "[planner]") {
  TempDir dir;
  const auto cfg = dir.write("tiny.yaml", R"(model:
  type: gpt
  args: {vocab_size: 128, block_size: 32, n_layer: 2, n_head: 4, n_embd: 64}
compute_config: {plan_ngpus: 2}
dataset:
  train_args: {path: does/not/exist.bin, seq_len: 32}
micro_batch_size: 2
global_batch_size: 8
max_train_steps: 10
)");
  std::ostringstream out, err;
  int rc = cli::plan_main({"--config", cfg, "--runtime-ngpus", "4", "--device", "H100", "--explain"}, out, err);
  INFO(err.str());
  REQUIRE(rc == 0);
  const auto text = out.str();
  CHECK_THAT(text, Catch::Contains("world 4 = tp 1 x dp 4"));
  CHECK_THAT(text, Catch::Contains("h.*.attn.c_attn.weight (x2)"));
  CHECK_THAT(text, Catch::Contains("rejected candidates"));
  CHECK_THAT(text, Catch::Contains("device: H100"));

  std::ostringstream jout, jerr;
  rc = cli::plan_main({"--config", cfg, "--runtime-ngpus=4", "--device=H100", "--json",
                       "--compute_config.plan_ngpus", "4"},
                      jout, jerr);
  REQUIRE(rc == 0);
  const auto j = nlohmann::json::parse(jout.str());
  const auto plan = j.at("plan").get<parallel::Plan>();
  CHECK(plan.world == 4);
  CHECK(plan.params.size() == 2 + 2 * 12 + 2);  // wte, wpe, 12 per layer, ln_f weight and bias

  std::ostringstream eout, eerr;
  rc = cli::plan_main({"--config", cfg, "--runtime-ngpus", "2", "--device", "H100", "--memory-budget-gb", "0.0001"},
                      eout, eerr);
  CHECK(rc == 1);
  CHECK_THAT(eerr.str(), Catch::Contains("raise compute_config.memory_budget_gb to at least"));

  std::ostringstream uout, uerr;
  CHECK(cli::plan_main({"--config", cfg, "--compute_config.no_such_key", "1"}, uout, uerr) == 2);
  CHECK_THAT(uerr.str(), Catch::Contains("no_such_key"));
  CHECK(cli::plan_main({"--device", "H100"}, uout, uerr) == 2);
  std::ostringstream dout, derr;
  CHECK(cli::plan_main({"--config", cfg, "--runtime-ngpus", "2", "--device", "TPU"}, dout, derr) == 1);
  // Without --runtime-ngpus the config's (here unset: 1) world: autodist's
  // plan_ngpus only bounds tp, so one rank plans tp 1; hybrid's tp = plan_ngpus must fit.
  std::ostringstream aout, aerr;
  CHECK(cli::plan_main({"--config", cfg}, aout, aerr) == 0);
  CHECK_THAT(aout.str(), Catch::Contains("world 1 = tp 1 x dp 1"));
  std::ostringstream rout, rerr;
  CHECK(cli::plan_main({"--config", cfg, "--pas_policy", "hybrid"}, rout, rerr) == 2);
  CHECK_THAT(rerr.str(), Catch::Contains("not a multiple of plan_ngpus 2"));
  CHECK_THAT(derr.str(), Catch::Contains("unknown device 'TPU'"));
}

// ---- context and pipeline parallelism ------------------------------------------

namespace {

// A Llama on the meta device (shapes only): 70B-sized models plan without memory.
std::shared_ptr<models::llama::Llama> meta_llama(int64_t layers, int64_t hidden, int64_t ffn, int64_t heads,
                                                 int64_t kv, int64_t vocab, int64_t max_seq) {
  models::llama::LlamaConfig lc;
  std::tie(lc.num_hidden_layers, lc.hidden_size, lc.intermediate_size, lc.num_attention_heads, lc.num_key_value_heads,
           lc.vocab_size, lc.max_position_embeddings) = std::make_tuple(layers, hidden, ffn, heads, kv, vocab, max_seq);
  models::common::ShardingContext meta;
  meta.options = meta.options.device(c10::kMeta);
  return std::make_shared<models::llama::Llama>(lc, meta);
}

parallel::DeviceSpec h100() { return parallel::device_spec("H100"); }

}  // namespace

TEST_CASE("planner: context parallelism divides activations by cp and adds the ring's exposed time",
          "[planner][cp]") {
  auto model = meta_llama(4, 1024, 3584, 8, 2, 4096, 65536);
  auto args = args_for(8, 8, 1, 1, 65536);
  args.precision = "bf16-mixed";
  PlanRequest req{&args, model.get(), 8, h100(), 0};
  std::map<int, parallel::PlanEstimate> by_cp;
  for (int cp : {1, 2, 4, 8}) {
    Candidate c{1, 1, 0, 0};
    c.cp = cp;
    by_cp[cp] = parallel::estimate(req, c);
  }
  // Activations per rank: 1/cp of the tokens, plus the K/V the ring holds (a
  // small share with 2 of 8 heads as K/V), so within 10% of 1/cp.
  for (int cp : {2, 4, 8}) {
    INFO("cp " << cp);
    const double ratio = by_cp[cp].activation_bytes / by_cp[1].activation_bytes;
    CHECK(ratio == Approx(1.0 / cp).epsilon(0.10));
    CHECK(ratio > 1.0 / cp);  // the ring's K/V in flight come on top
    // Compute divides by cp exactly (each rank's queries against the whole sequence).
    CHECK(by_cp[cp].compute_s == Approx(by_cp[1].compute_s / cp).epsilon(1e-9));
    // Parameters are replicated over cp.
    CHECK(by_cp[cp].param_bytes == by_cp[1].param_bytes);
  }
  CHECK(by_cp[1].cp_comm_s == 0);
  // p2p hides transfers behind each block's attention: at 65536 tokens a block
  // computes far longer than its K/V take to move within a node, so all that
  // is charged is the blocks' slowdown beside the transfers (no dp here).
  CHECK(by_cp[2].cp_comm_s > 0);
  CHECK(by_cp[2].cp_comm_s <= parallel::kOverlapContention * by_cp[2].compute_s);
  // all_gather exposes its gathers and the gradients' reduce-scatter in full.
  Candidate g{1, 1, 0, 0};
  g.cp = 4;
  g.cp_comm = "all_gather";
  const auto ag = parallel::estimate(req, g);
  CHECK(ag.cp_comm_s > 0);
  CHECK(ag.step_s > by_cp[4].step_s);
  // A short sequence cannot hide the ring: p2p is exposed too.
  auto short_args = args_for(8, 8, 1, 1, 1024);
  short_args.precision = "bf16-mixed";
  PlanRequest short_req{&short_args, model.get(), 8, h100(), 0};
  Candidate s{1, 1, 0, 0};
  s.cp = 8;
  CHECK(parallel::estimate(short_req, s).cp_comm_s > 0);
}

TEST_CASE("planner: the search takes cp only when a sequence does not fit without it", "[planner][cp]") {
  auto model = meta_llama(4, 1024, 3584, 8, 2, 4096, 65536);
  auto args = args_for(8, 2, 1, 4, 65536);  // 4 sequences: without cp, tp 2 x dp 4 is the only split
  args.precision = "bf16-mixed";
  args.model.loss = "fused";
  PlanRequest req{&args, model.get(), 8, h100(), 0};
  req.search_context = true;
  double least_without = 1e300, with_cp = 1e300;
  for (int z = 0; z <= 3; ++z) {
    least_without = std::min(least_without, parallel::estimate(req, {2, 4, z, 4}).total_bytes);  // all recomputed
    Candidate c{2, 1, z, 4};
    c.cp = 4;
    with_cp = std::min(with_cp, parallel::estimate(req, c).total_bytes);
  }
  REQUIRE(with_cp < least_without);
  // Ample memory: no cp. A budget below anything without cp: cp, and --explain
  // gives every candidate without it a reason.
  req.memory_budget_bytes = 1e12;
  CHECK(parallel::make_plan(req).context.cp == 1);
  req.memory_budget_bytes = (with_cp + least_without) / 2;
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, &rejected);
  CHECK(plan.context.cp > 1);
  CHECK(plan.world == plan.tp * plan.context.cp * plan.dp);
  CHECK(plan.estimate.total_bytes <= req.memory_budget_bytes);
  int without_cp = 0;
  for (const auto& r : rejected) {
    INFO(r.candidate << ": " << r.reason);
    CHECK_FALSE(r.reason.empty());
    if (r.cand.cp == 1) {
      ++without_cp;
      CHECK((r.kind == "memory" || r.kind == "infeasible"));
    }
  }
  CHECK(without_cp > 0);
  // The trainer's request (no search_context) never splits sequences: it
  // offloads, or refuses.
  req.search_context = false;
  try {
    const auto p = parallel::make_plan(req);
    CHECK(p.context.cp == 1);
    CHECK((p.offload_ratio > 0 || p.offload_params));
  } catch (const parallel::PlanError&) {
  }
}

TEST_CASE("planner: stage splits keep every layer once and balance the head", "[planner][pp]") {
  CHECK(parallel::balanced_stage_split(7, 3, 0, 0) == std::vector<int>{3, 2, 2});
  CHECK(parallel::balanced_stage_split(8, 4, 0, 0) == std::vector<int>{2, 2, 2, 2});
  for (int layers : {1, 3, 7, 13, 80})
    for (int stages = 1; stages <= std::min(layers, 16); ++stages)
      for (double head : {0.0, 0.4, 2.5}) {
        const auto n = parallel::balanced_stage_split(layers, stages, 0.0, head);
        INFO(layers << " layers, " << stages << " stages, head " << head);
        REQUIRE(static_cast<int>(n.size()) == stages);
        CHECK(std::accumulate(n.begin(), n.end(), 0) == layers);
        CHECK(*std::min_element(n.begin(), n.end()) >= 1);
        // No move of one layer lowers the most expensive stage.
        auto cost = [&](const std::vector<int>& v) {
          double worst = 0;
          for (int s = 0; s < stages; ++s) worst = std::max(worst, v[s] + (s == stages - 1 ? head : 0.0));
          return worst;
        };
        for (int from = 0; from < stages; ++from)
          for (int to = 0; to < stages; ++to) {
            if (from == to || n[from] <= 1) continue;
            auto m = n;
            --m[from];
            ++m[to];
            CHECK(cost(m) >= cost(n) - 1e-12);
          }
      }
  // A heavy head (2.5 layers) leaves the last stage the fewest layers.
  const auto h = parallel::balanced_stage_split(12, 4, 0.0, 2.5);
  CHECK(h.back() < h.front());
  CHECK_THROWS_AS(parallel::balanced_stage_split(3, 4, 0, 0), parallel::PlanError);
}

TEST_CASE("planner: a pipeline's bubble and memory come from the schedule simulator", "[planner][pp]") {
  // Equal stages (no head cost to speak of: a tiny vocabulary), no transfers
  // to speak of: 1F1B's bubble is (p - 1) / (m + p - 1). The head still makes
  // the last stage 0.1% heavier, and each stage is simulated at its own cost,
  // so the three lighter ranks idle that much of every micro-batch: +0.07
  // points at m 100.
  auto model = meta_llama(8, 1024, 3584, 8, 8, 32, 2048);
  for (int m : {4, 8, 32, 100}) {
    auto args = args_for(4, 1, 1, m, 2048);
    args.precision = "bf16-mixed";
    PlanRequest req{&args, model.get(), 4, h100(), 0};
    Candidate c{1, 1, 0, 0};
    c.pp = c.stages = 4;
    c.scheduler = "1f1b";
    c.stage_layers = {2, 2, 2, 2};
    const auto e = parallel::estimate(req, c);
    INFO("m " << m);
    const double p = 4;
    CHECK(e.pp_bubble == Approx((p - 1) / (m + p - 1)).epsilon(0.03));
    CHECK(e.pp_comm_s > 0);
    CHECK(e.step_s > e.compute_s);
    // GPipe holds every micro-batch, 1F1B's stage 0 holds p of them: its
    // activations grow with m, 1F1B's do not past p.
    Candidate g = c;
    g.scheduler = "gpipe";
    const auto eg = parallel::estimate(req, g);
    if (m > 4) CHECK(eg.activation_bytes > e.activation_bytes);
  }
  // Stage 0 under 1F1B at p 4 holds 4 micro-batches of its 2 layers; one
  // process (the same 8 layers, nothing in flight but one micro-batch) holds
  // 1 x 8: the same layer activations.
  auto args = args_for(4, 1, 1, 16, 2048);
  args.precision = "bf16-mixed";
  PlanRequest req{&args, model.get(), 4, h100(), 0};
  Candidate c{1, 1, 0, 0};
  c.pp = c.stages = 4;
  c.stage_layers = {2, 2, 2, 2};
  auto one_args = args_for(1, 1, 1, 16, 2048);
  one_args.precision = "bf16-mixed";
  PlanRequest one_req{&one_args, model.get(), 1, h100(), 0};
  const auto pipe = parallel::estimate(req, c), whole = parallel::estimate(one_req, Candidate{1, 1, 0, 0});
  CHECK(pipe.param_bytes < whole.param_bytes / 2);  // a quarter of the layers, and the embedding
  CHECK(pipe.activation_bytes == Approx(whole.activation_bytes).epsilon(0.10));
  // Interleaving (2 stages per rank) and zero bubble shrink the bubble.
  Candidate v = c;
  v.scheduler = "1f1b_interleaved";
  v.stages = 8;
  v.stage_layers = {1, 1, 1, 1, 1, 1, 1, 1};
  Candidate z = c;
  z.scheduler = "zb1p";
  const auto ev = parallel::estimate(req, v), ez = parallel::estimate(req, z);
  CHECK(ev.pp_bubble < pipe.pp_bubble);
  CHECK(ez.pp_bubble < pipe.pp_bubble);
}

TEST_CASE("planner: optimizer post-validation adds its backup to memory, the steady state to time",
          "[planner][pp][post_validation]") {
  // The backup copies what the optimizer updates, its weights (fp32 masters
  // under *-mixed) and both moments: 12 bytes per element where the state
  // holds 8 (fp32: moments only) or 12 (masters and moments); under fp16 loss
  // scaling also the reduced gradients. 1F1B's steady period is one step's
  // makespan (tests/base/test_post_validation): bubble and step time unchanged.
  auto model = meta_llama(8, 1024, 3584, 8, 8, 32, 2048);
  Candidate c{1, 1, 0, 0};
  c.pp = c.stages = 4;
  c.scheduler = "1f1b";
  c.stage_layers = {2, 2, 2, 2};
  for (const std::string precision : {"32-true", "bf16-mixed", "16-mixed"}) {
    INFO(precision);
    auto args = args_for(4, 1, 1, 8, 2048);
    args.precision = precision;
    PlanRequest req{&args, model.get(), 4, h100(), 0};
    const auto off = parallel::estimate(req, c);
    args.compute_config.pipeline.post_validation = true;
    const auto on = parallel::estimate(req, c);
    CHECK(on.optim_bytes == Approx(off.optim_bytes * (precision == "32-true" ? (8.0 + 12) / 8 : 2.0)));
    CHECK(on.grad_bytes == Approx(off.grad_bytes * (precision == "16-mixed" ? 2.0 : 1.0)));
    CHECK(on.pp_bubble == Approx(off.pp_bubble));
    CHECK(on.step_s == Approx(off.step_s));
  }
}

// The gradient reduction hidden behind backward still costs: the backward
// beside it runs kOverlapContention slower for as long as they overlap.
// ZeRO-2 reduce-scatters every micro-batch, ZeRO-1 once per step.
TEST_CASE("planner: overlapped collectives charge compute their contention", "[planner]") {
  auto model = gpt(4, 4, 256, 512, 64);
  const int m = 8;
  auto args = args_for(2, 1, 1, 2 * m, 64);
  args.compute_config.reducer_bucket_cap_mb = 1;  // ~13 MB of gradients: all but the last bucket overlap
  PlanRequest req{&args, model.get(), 2, test_device(), 1e12};
  const auto z1 = parallel::estimate(req, {1, 2, 1, 0}), z2 = parallel::estimate(req, {1, 2, 2, 0});
  const auto one = parallel::estimate(PlanRequest{&args, model.get(), 1, test_device(), 1e12}, {1, 1, 0, 0});
  CHECK(one.contention_s == 0);  // nothing to reduce
  REQUIRE(z1.contention_s > 0);
  // The same reduce-scatter under both, once per step or once per micro-batch.
  CHECK(z2.contention_s == Approx(m * z1.contention_s));
  // It slows only the backward it overlaps: at most that fraction of it.
  CHECK(z2.contention_s <= parallel::kOverlapContention * z2.compute_s * 2 / 3);
  // It is part of the exposed data-parallel time, and so of the step: the step is
  // the compute from first principles (6 FLOPs per matmul parameter per token
  // plus causal attention's 6 L C T, m micro-batches of 64 tokens, at half the
  // device's 1e12 FLOP/s), which carries no contention, plus that time.
  CHECK(z2.dp_comm_s >= z2.contention_s);
  const double flops_per_token = 6 * (4 * 12 * 256.0 * 256 + 512 * 256) + 6 * 4 * 256 * 64;
  const double compute = m * 64 * flops_per_token / (0.5 * 1e12);
  CHECK(z2.compute_s == Approx(compute));
  CHECK(z2.step_s == Approx(compute + z2.dp_comm_s + z2.optim_step_s));
  CHECK(z2.step_s >= compute + z2.contention_s);
}

TEST_CASE("planner: Llama 3 70B on 64 and 128 H100 is planned with pipeline stages", "[planner][pp]") {
  const int world = GENERATE(64, 128);
  INFO("world " << world);
  auto model = meta_llama(80, 8192, 28672, 64, 8, 128256, 8192);
  auto args = args_for(world, 8, 1, 256, 8192);
  args.precision = "bf16-mixed";
  args.model.loss = "fused";
  args.compute_config.reducer_bucket_cap_mb = 100;
  PlanRequest req{&args, model.get(), world, h100(), 0};
  req.search_pipeline = true;
  std::vector<parallel::Rejected> rejected;
  const auto plan = parallel::make_plan(req, &rejected);
  INFO(parallel::describe(plan));
  CHECK(plan.pipeline.pp > 1);
  CHECK(plan.world == plan.tp * plan.pipeline.pp * plan.dp);
  CHECK(plan.estimate.total_bytes <= plan.memory_budget_bytes);
  CHECK(std::accumulate(plan.pipeline.stage_layers.begin(), plan.pipeline.stage_layers.end(), 0) == 80);
  CHECK(static_cast<int>(plan.pipeline.stage_layers.size()) == plan.pipeline.stages);
  CHECK(plan.pipeline.nmicros == 256 / plan.dp);
  int recomputed = 0;
  for (bool r : plan.recompute) recomputed += r;
  CHECK(recomputed % plan.pipeline.stages == 0);  // the first k layers of every stage
  CHECK(plan.estimate.pp_bubble > 0);
  CHECK(plan.estimate.pp_bubble < 0.5);
  // The pipeline travels in the plan's JSON (checkpoints, plan agreement).
  const nlohmann::json j = plan;
  CHECK(nlohmann::json(j.get<parallel::Plan>()) == j);
  CHECK(j.at("pipeline").at("stage_layers") == nlohmann::json(plan.pipeline.stage_layers));
  // It is the fastest of what fits: every faster candidate is over the budget.
  for (const auto& r : rejected)
    if (r.kind != "infeasible" && r.step_s < plan.estimate.step_s) CHECK(r.kind == "memory");
  // Without pipeline parallelism on the table (the trainer's request) it is
  // not used, and what is chosen then is slower.
  req.search_pipeline = false;
  const auto flat = parallel::make_plan(req);
  CHECK(flat.pipeline.pp == 1);
  CHECK(flat.estimate.step_s > plan.estimate.step_s);
}
