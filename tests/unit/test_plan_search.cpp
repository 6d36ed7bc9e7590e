// The search as the trainer and `nnstrain plan` both run it under autodist
// (issues 21 and 22), through `nnstrain plan --json --explain` on a config
// file, so the loader's readings (which keys the config names) take part:
// sizes a config names stay, the accumulation follows the plan's dp (pinned
// when the config names it), a batch no split takes is a config error (exit
// 2), what the trainer cannot run yet is an infeasible candidate with its
// reason, and each pipeline rank's memory is in the estimate.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_support.h"
#include "trainer/cli/plan_command.h"

using namespace nnstrain;
using testing::TempDir;

namespace {

// A 4-layer GPT over 4 ranks: micro 2, global 8 unless `extra` says otherwise.
struct Planned {
  int rc = 0;
  nlohmann::json out;
  std::string err;
};

Planned plan(const std::string& extra, std::vector<std::string> flags = {}) {
  TempDir dir("plan_search");
  const std::string cfg = dir / "tiny.yaml";
  std::ofstream(cfg) << "model:\n  type: gpt\n  args: {vocab_size: 64, block_size: 32, n_layer: 4, n_head: 4, n_embd: 64}\n"
                        "dataset:\n  train_args: {path: none.bin, seq_len: 32}\n"
                        "micro_batch_size: 2\nmax_train_steps: 10\n"
                     << extra;
  std::vector<std::string> argv{"--config", cfg, "--runtime-ngpus", "4", "--device", "cpu", "--json", "--explain"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  std::ostringstream out, err;
  Planned p;
  p.rc = cli::plan_main(argv, out, err);
  p.err = err.str();
  if (p.rc == 0) p.out = nlohmann::json::parse(out.str());
  return p;
}

int pp_of(const nlohmann::json& j) { return j.contains("pipeline") ? j["pipeline"]["pp"].get<int>() : j.value("pp", 1); }

}  // namespace

TEST_CASE("plan search: what the trainer cannot run yet is infeasible, with its reason", "[plan_search]") {
  const auto p = plan("global_batch_size: 8\n");
  REQUIRE(p.rc == 0);
  // ZeRO-2/3 under pp run now: such candidates are weighed, never refused as not runnable.
  int zero_under_pp = 0;
  for (const auto& r : p.out["rejected"]) {
    if (r["pp"].get<int>() > 1 && r["zero"].get<int>() >= 2) {
      CHECK_THAT(r["reason"].get<std::string>(), !Catch::Contains("not implemented"));
      ++zero_under_pp;
    }
  }
  CHECK(zero_under_pp > 0);
  // CUDA graphs: no pipeline at all.
  const auto g = plan("global_batch_size: 8\n", {"--compute_config.cuda_graphs", "true"});
  REQUIRE(g.rc == 0);
  for (const auto& r : g.out["rejected"])
    if (r["pp"].get<int>() > 1) CHECK(r["kind"] == "infeasible");
}

TEST_CASE("plan search: pipeline sizes and schedulers the config names stay", "[plan_search]") {
  const auto free = plan("global_batch_size: 8\n");
  REQUIRE(free.rc == 0);
  const auto& all = free.out["rejected"];
  CHECK(std::any_of(all.begin(), all.end(), [](const nlohmann::json& r) { return r["pp"].get<int>() > 1; }));
  // pp_size named, 1 included: no other pipeline is tried.
  const auto one = plan("global_batch_size: 8\ncompute_config: {pas_config: {pp_size: 1}}\n");
  REQUIRE(one.rc == 0);
  for (const auto& r : one.out["rejected"]) CHECK(r["pp"].get<int>() == 1);
  // A named scheduler: pipelines of any size, with that scheduler only.
  const auto zb = plan("global_batch_size: 8\ncompute_config: {pas_config: {pipeline_scheduler: zbv}}\n");
  REQUIRE(zb.rc == 0);
  int tried = 0;
  for (const auto& r : zb.out["rejected"])
    if (r["pp"].get<int>() > 1) {
      CHECK(r["scheduler"] == "zbv");
      ++tried;
    }
  CHECK(tried > 0);
}

TEST_CASE("plan search: the accumulation follows the plan's dp, pinned when the config names it", "[plan_search]") {
  // Global 8 and micro 2 over 4 ranks: dp 4, one micro-batch each.
  const auto free = plan("global_batch_size: 8\n");
  REQUIRE(free.rc == 0);
  CHECK(free.out["plan"]["dp"] == 4);
  CHECK(free.out["plan"]["grad_accumulation_steps"] == 1);
  // Accumulation 2 named too: only dp 2 remains, which 4 ranks reach with 2 pipeline stages.
  const auto pinned = plan("global_batch_size: 8\ngrad_accumulation_steps: 2\n");
  INFO(pinned.err);
  REQUIRE(pinned.rc == 0);
  CHECK(pinned.out["plan"]["dp"] == 2);
  CHECK(pinned.out["plan"]["grad_accumulation_steps"] == 2);
  CHECK(pp_of(pinned.out["plan"]) == 2);
  CHECK(pinned.out["plan"]["pipeline"]["nmicros"] == 2);
  for (const auto& r : pinned.out["rejected"])
    if (r["dp"].get<int>() != 2) {
      CHECK(r["kind"] == "infeasible");
      CHECK_THAT(r["reason"].get<std::string>(), Catch::Contains("needs dp 2"));
    }
  // A batch no split takes (dp 5 of 4 ranks): one config error, exit 2.
  const auto bad = plan("global_batch_size: 10\ngrad_accumulation_steps: 1\n");
  CHECK(bad.rc == 2);
  CHECK_THAT(bad.err, Catch::Contains("config error: global_batch_size 10 = micro_batch_size 2 x "
                                      "grad_accumulation_steps 1 x dp needs dp 5, not 4") &&
                          Catch::Contains("(dp 4, 2, 1 tried)"));
  CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
}

TEST_CASE("plan search: each pipeline rank's memory is in the estimate", "[plan_search]") {
  const auto p = plan("global_batch_size: 8\ncompute_config: {pas_config: {pp_size: 4}}\n");
  REQUIRE(p.rc == 0);
  const auto& e = p.out["plan"]["estimate"];
  const auto ranks = e["pp_rank_bytes"].get<std::vector<double>>();
  REQUIRE(ranks.size() == 4);
  // The estimate is the busiest rank's; under 1F1B stage 0 holds the most micro-batches.
  CHECK(*std::max_element(ranks.begin(), ranks.end()) == e["total_bytes"].get<double>());
  CHECK(ranks.front() > ranks[2]);
}
