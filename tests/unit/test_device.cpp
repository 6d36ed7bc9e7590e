// Device choice per rank, the TF32 switch, the stop-agreement interval and the
// RNG state in checkpoints: the parts of the CUDA path that can be checked
// without a GPU.
#include <ATen/Context.h>

#include <functional>

#include "test_support.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/rng_state.h"
#include "trainer/dist/device.h"
#include "trainer/train/step_graph.h"
#include "trainer/train/stop_decision.h"

using namespace nnstrain;

namespace {
dist::DistEnv rank_env(int rank, int local_rank) {
  dist::DistEnv e;
  e.rank = rank;
  e.local_rank = local_rank;
  e.world_size = rank + 1;
  e.local_world_size = local_rank + 1;
  return e;
}
}  // namespace

TEST_CASE("each rank binds cuda:LOCAL_RANK, checked against the visible devices", "[device]") {
  CHECK(dist::choose_device("cpu", rank_env(0, 0), 8, false, true) == c10::Device(c10::kCPU));
  CHECK(dist::choose_device("auto", rank_env(0, 0), 0, false, true) == c10::Device(c10::kCPU));
  CHECK(dist::choose_device("auto", rank_env(5, 1), 2, false, true) == c10::Device(c10::kCUDA, 1));
  CHECK(dist::choose_device("cuda", rank_env(11, 3), 8, false, true) == c10::Device(c10::kCUDA, 3));
  // More local ranks than GPUs: an error naming the rank, never a shared GPU 0.
  try {
    dist::choose_device("auto", rank_env(6, 2), 2, false, true);
    FAIL("no error");
  } catch (const dist::DistEnvError& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("rank 6: LOCAL_RANK 2 needs cuda:2 but only 2 CUDA device(s) are visible"));
  }
  try {
    dist::choose_device("cuda", rank_env(1, 1), 0, false, true);
    FAIL("no error");
  } catch (const dist::DistEnvError& e) {
    CHECK(std::string(e.what()) == "rank 1: compute_config.device is cuda but no CUDA device is visible");
  }
  // NNSTRAIN_SHARE_DEVICES=1: round-robin (several Gloo ranks on one GPU).
  CHECK(dist::choose_device("cuda", rank_env(2, 2), 1, true, true) == c10::Device(c10::kCUDA, 0));
  CHECK(dist::choose_device("cuda", rank_env(3, 3), 2, true, true) == c10::Device(c10::kCUDA, 1));
}

TEST_CASE("a binary built without nnstrain's CUDA code never trains on a GPU", "[device]") {
  // It links a CUDA LibTorch all the same, with the CUDA paths of the asynchronous
  // save and the memory figures compiled out: auto takes the CPU, cuda is refused.
  CHECK(dist::choose_device("auto", rank_env(0, 0), 8, false, false) == c10::Device(c10::kCPU));
  CHECK(dist::choose_device("auto", rank_env(1, 1), 2, true, false) == c10::Device(c10::kCPU));
  try {
    dist::choose_device("cuda", rank_env(3, 1), 2, false, false);
    FAIL("no error");
  } catch (const dist::DistEnvError& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("rank 3: compute_config.device is cuda but this nnstrain was built without "
                                           "its CUDA code") &&
                             Catch::Contains("NNSTRAIN_WITH_CUDA"));
  }
  // This build's answer is the compile-time one.
#ifdef NNSTRAIN_CUDA
  CHECK(dist::built_with_cuda());
#else
  CHECK_FALSE(dist::built_with_cuda());
#endif
}

TEST_CASE("allow_tf32 switches cuBLAS and cuDNN TF32 in LibTorch's context", "[device]") {
  auto& ctx = at::globalContext();
  const bool blas = ctx.allowTF32CuBLAS(), dnn = ctx.allowTF32CuDNN();
  dist::set_allow_tf32(true);
  CHECK(ctx.allowTF32CuBLAS());
  CHECK(ctx.allowTF32CuDNN());
  CHECK(ctx.float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST);
  dist::set_allow_tf32(false);
  CHECK_FALSE(ctx.allowTF32CuBLAS());
  CHECK_FALSE(ctx.allowTF32CuDNN());
  CHECK(ctx.float32MatmulPrecision() == at::Float32MatmulPrecision::HIGHEST);
  ctx.setAllowTF32CuBLAS(blas);
  ctx.setAllowTF32CuDNN(dnn);
}

TEST_CASE("the stop agreement is spaced by about one second of steps", "[device]") {
  CHECK(train::agreement_interval(2.0, 1.0) == 1);     // slow steps: every step
  CHECK(train::agreement_interval(1.0, 1.0) == 1);
  CHECK(train::agreement_interval(0.3, 1.0) == 3);
  CHECK(train::agreement_interval(0.001, 1.0) == 1000);
  CHECK(train::agreement_interval(1e-6, 1.0) == 1000);  // capped
  CHECK(train::agreement_interval(0.0, 1.0) == 1);       // no measurement yet
  // A single process decides alone, at every step.
  train::StopDecision alone(nullptr);
  CHECK_FALSE(alone.after_step(1, false, false));
  CHECK(alone.after_step(2, true, false));
}

TEST_CASE("RNG state round-trips through a checkpoint and a CPU-only one still restores", "[device]") {
  testing::TempDir dir("rng");
  const auto cpu = c10::Device(c10::kCPU);
  torch::manual_seed(1234);
  auto tensors = checkpoint::rng_state_tensors(0, cpu);
  REQUIRE(tensors.size() == 1);  // CPU training: the CPU generator only
  CHECK(tensors[0].spec.name == "rng/cpu/rank0");
  CHECK(tensors[0].spec.replica_ranks == std::vector<int>{0});
  const auto want = torch::rand({8});  // what follows the saved state
  checkpoint::SaveOptions so{dir.path, "sharded", 0};
  checkpoint::SaveContext sc{0, 1, {}, {}};
  const auto saved = checkpoint::save(so, sc, 7, tensors, nlohmann::json{{"step", 7}}, nlohmann::json::object());
  torch::manual_seed(999);
  checkpoint::Checkpoint ck(saved);
  CHECK(checkpoint::restore_rng_state(ck, 0, cpu) == std::vector<std::string>{"rng/cpu/rank0"});
  CHECK(torch::equal(torch::rand({8}), want));
  // Another rank's state is not this rank's: nothing restored, nothing thrown.
  CHECK(checkpoint::restore_rng_state(ck, 1, cpu).empty());
}

TEST_CASE("cuda_graphs auto captures one GPU's default step and names what keeps any other eager", "[device]") {
  train::GraphFacts one_gpu;
  one_gpu.built_with_cuda = true;
  one_gpu.cuda = true;
  one_gpu.optimizer_impl = "fused";
  CHECK(train::graph_blocker(one_gpu).empty());
  // Each fact alone is enough, and the reason names it.
  const std::vector<std::pair<std::function<void(train::GraphFacts&)>, std::string>> cases{
      {[](auto& f) { f.built_with_cuda = false; }, "NNSTRAIN_WITH_CUDA"},
      {[](auto& f) { f.cuda = false; }, "needs a CUDA device"},
      {[](auto& f) { f.world = 2, f.backend = "gloo"; }, "cannot capture gloo's host collectives (compute_config.backend"},
      {[](auto& f) { f.world = 2; }, "which backend"},
      {[](auto& f) { f.world = 2, f.backend = "nccl", f.tp = 2; }, "tensor parallelism"},
      {[](auto& f) { f.zero_stage = 2; }, "ZeRO stage 2"},
      {[](auto& f) { f.zero_stage = 3; }, "ZeRO stage 3"},
      {[](auto& f) { f.recompute = true; }, "recompute"},
      {[](auto& f) { f.optimizer_impl = "foreach"; }, "not foreach"},
      {[](auto& f) { f.offload = true; }, "compute_config.offload"},
      {[](auto& f) { f.cp = 2; }, "context_parallel_size"},
      {[](auto& f) { f.pp = 2; }, "pp_size"},
      {[](auto& f) { f.document_mask = true; }, "document_mask"},
  };
  for (const auto& [change, reason] : cases) {
    auto f = one_gpu;
    change(f);
    CHECK_THAT(train::graph_blocker(f), Catch::Contains(reason));
  }
  // ZeRO-1 at one rank is still captured.
  auto z1 = one_gpu;
  z1.zero_stage = 1;
  CHECK(train::graph_blocker(z1).empty());
}

TEST_CASE("cuda_graphs auto captures data parallelism over NCCL, ZeRO 0 and 1, and nothing over Gloo", "[device]") {
  train::GraphFacts dp;
  dp.built_with_cuda = dp.cuda = true;
  dp.optimizer_impl = "fused";
  dp.world = 8;
  dp.backend = "nccl";
  CHECK(train::graph_blocker(dp).empty());
  dp.zero_stage = 1;
  CHECK(train::graph_blocker(dp).empty());
  // What stays eager at several ranks says why, NCCL or not.
  auto z2 = dp;
  z2.zero_stage = 2;
  CHECK_THAT(train::graph_blocker(z2), Catch::Contains("ZeRO stage 2"));
  auto gloo = dp;
  gloo.backend = "gloo";
  CHECK(train::graph_blocker(gloo) ==
        "cannot capture gloo's host collectives (compute_config.backend; nccl can be captured)");
  auto tp = dp;
  tp.tp = 2;
  CHECK_THAT(train::graph_blocker(tp), Catch::Contains("compute_config.plan_ngpus"));
  auto cp = dp;
  cp.cp = 2;
  CHECK_THAT(train::graph_blocker(cp), Catch::Contains("context_parallel_size"));
  auto pp = dp;
  pp.pp = 2;
  CHECK_THAT(train::graph_blocker(pp), Catch::Contains("pp_size"));
  // One rank with a one-rank NCCL runtime (ZeRO-2/3 at one GPU) is judged by its stage, not its backend.
  auto one = dp;
  one.world = 1;
  one.zero_stage = 0;
  CHECK(train::graph_blocker(one).empty());
}
