// One plan for every rank (plan_agreement.h): ranks as threads over an
// in-memory c10d store, as the trainer's ranks meet over the TCP one.
#include <catch2/catch.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <thread>

#include "models/gpt/gpt.h"
#include "trainer/plan/plan_agreement.h"

using namespace nnstrain;

namespace {

struct Outcome {
  bool ok = false;
  std::string hash, error;
};

// Runs agree_plan on `ranks` of a `world`-rank job (the others never show up).
std::vector<Outcome> agree(int world, const std::vector<int>& ranks, std::chrono::milliseconds timeout) {
  models::gpt::GptConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 64;
  c.block_size = 16;
  auto model = std::make_shared<models::gpt::Gpt>(c);
  config::TrainerArgs a;
  a.compute_config.runtime_ngpus = world;
  a.pas_policy = "autodist";
  a.micro_batch_size = 1;
  a.global_batch_size = world;
  a.dataset.train_args.seq_len = 16;
  a.precision = "32-true";
  a.resolved_yaml = "model: {type: gpt}\n";
  parallel::PlanRequest req;
  req.args = &a;
  req.model = model.get();
  req.world_size = world;
  req.device = parallel::device_spec("cpu");
  req.device.memory_bytes = 64.0 * 1073741824.0;

  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        out[i].hash = parallel::plan_hash(parallel::agree_plan(req, *store, ranks[i], world, timeout));
        out[i].ok = true;
      } catch (const std::exception& e) {
        out[i].error = e.what();
      }
    });
  for (auto& t : threads) t.join();
  if (ranks.size() == static_cast<size_t>(world) && out[0].ok)
    REQUIRE(out[0].hash == parallel::plan_hash(parallel::make_plan(req)));  // the planner's own answer
  return out;
}

}  // namespace

TEST_CASE("every rank gets the same plan when the facts agree", "[plan][agreement]") {
  const auto out = agree(4, {0, 1, 2, 3}, std::chrono::milliseconds(20000));
  for (const auto& o : out) {
    INFO(o.error);
    REQUIRE(o.ok);
    REQUIRE(o.hash == out[0].hash);
  }
}

TEST_CASE("a rank that reports different device memory is named on every rank", "[plan][agreement]") {
  ::setenv("NNSTRAIN_TEST_DEVICE_MEMORY_GB", "2:40", 1);
  const auto out = agree(4, {0, 1, 2, 3}, std::chrono::milliseconds(20000));
  ::unsetenv("NNSTRAIN_TEST_DEVICE_MEMORY_GB");
  for (const auto& o : out) {
    REQUIRE_FALSE(o.ok);
    INFO(o.error);
    REQUIRE(o.error.find("rank 2 (host ") != std::string::npos);
    REQUIRE(o.error.find("device memory 40.0 GiB (rank 0: 64.0 GiB)") != std::string::npos);
    REQUIRE(o.error.find("rank 1 ") == std::string::npos);  // only the odd one is named
    REQUIRE(o.error.find('\n') == std::string::npos);
  }
}

TEST_CASE("a rank that never reports is named once the timeout has passed", "[plan][agreement]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = agree(3, {0, 1}, std::chrono::milliseconds(800));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& o : out) {
    REQUIRE_FALSE(o.ok);
    INFO(o.error);
    REQUIRE(o.error.find("rank(s) 2 did not report their plan facts") != std::string::npos);
  }
  REQUIRE(secs < 10);  // the timeout, not the 30 s linger: rank 1 read the verdict
}
