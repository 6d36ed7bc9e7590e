// NCCL collectives inside a CUDA graph (issue 20), checked on one GPU at one
// rank: a one-rank NCCL runtime (the one ZeRO-2/3 use at one GPU) runs the
// GradientReducer's bucket reductions (ZeRO 0: all-reduce; ZeRO 1:
// reduce-scatter into the shard, then the parameters' all-gather) and a
// norm-style all-reduce in a step that train::StepGraph warms up, captures and
// replays, exactly as the trainer does. Checks:
// - every replayed step equals the same step run eagerly afterwards, bitwise
//   (gradients and the all-reduced sum of squares), and the sum of squares
//   equals the inputs' own (the one-rank reduction is the identity), so a
//   replay that skipped a collective or read stale buffers would differ;
// - the collective monitor survives the capture (it would end the process with
//   status 1 had it queried an event recorded in the capture) and each replay
//   counts the captured collectives (Runtime::watch_replay): the groups'
//   traffic equals steps x one step's.
// With the argument `hang` (CTest device.nccl_graph_hang): a replay that does
// not finish (a kernel spinning ~10 s, standing for a peer that never comes)
// ends the process within collective_timeout_s (2 s here) with the monitor's
// one-line diagnosis naming the replay; CTest matches that line.
// Several ranks exchanging data inside a graph need several GPUs:
// bench/gpu/multi_gpu.sh. Exit status 77 (CTest: skipped) without a CUDA
// device, unless NNSTRAIN_TEST_DEVICE=cuda asked for one (then 1).
#include <ATen/DeviceAccelerator.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#ifdef NNSTRAIN_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include "trainer/dist/process_groups.h"
#include "trainer/state/grad_reducer.h"
#include "trainer/state/training_state.h"
#include "trainer/train/step_graph.h"

using namespace nnstrain;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
  if (!ok) ++failures;
}

// Odd sizes and a tiny bucket cap: several buckets, some padded under ZeRO.
const std::vector<std::vector<int64_t>> kShapes = {{5}, {5, 3}, {2, 7}, {5, 7}, {3}, {11, 2}, {1}};
constexpr int kSteps = 6, kWarmup = 2;

void run(dist::Runtime& rt, int stage) {
  const std::string tag = "ZeRO-" + std::to_string(stage) + ": ";
  const c10::Device dev(c10::kCUDA, 0);
  const auto f32 = torch::TensorOptions().device(dev).dtype(torch::kFloat32);
  std::vector<parallel::ParamShard> shards;
  int64_t total = 0;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    auto t = torch::randn(kShapes[k], f32).set_requires_grad(true);
    total += t.numel();
    const auto name = "p" + std::to_string(k);
    shards.push_back({name, t, sharding::ShardSpec::full(name, "F32", kShapes[k])});
  }
  parallel::TrainingStateOptions o;
  o.bucket_cap_mb = 0.0001;  // 26 floats
  o.zero_stage = stage;
  o.zero_size = rt.zero.size();
  o.zero_rank = rt.zero.rank;
  o.zero_replicas = rt.zero_cross.ranks;
  parallel::TrainingState state(std::move(shards), o);
  parallel::GradientReducer reducer(state, &rt);
  auto reduced = [&] { return stage ? state.shard_grad() : state.flat_grad(); };
  auto out_grad = torch::zeros_like(reduced()), out_sq = torch::zeros({1}, f32);
  const auto before = std::vector<dist::Traffic>{rt.dp_cp.traffic, rt.zero.traffic};

  // The step: gradients of sum(p * x) are x; reduced as backward fills the buckets.
  auto body = [&](const std::vector<data::Batch>& b) {
    const auto& x = b.front().x;
    state.zero_grad();
    reducer.begin_micro_step(true);
    auto loss = torch::zeros({}, f32);
    int64_t off = 0;
    for (const auto& p : state.params()) {
      loss = loss + (p.tensor * x.narrow(0, off, p.tensor.numel()).view(p.tensor.sizes())).sum();
      off += p.tensor.numel();
    }
    loss.backward();
    torch::NoGradGuard no_grad;
    reducer.finish_gradients();
    auto sq = reduced().pow(2).sum().reshape({1});
    rt.wait(rt.all_reduce_async(rt.dp_cp, sq, "sum of squares all-reduce"), rt.dp_cp, "sum of squares all-reduce");
    reducer.gather_params();  // ZeRO-1: the parameters' all-gather (a no-op at stage 0)
    out_grad.copy_(reduced());
    out_sq.copy_(sq);
  };

  std::vector<torch::Tensor> inputs, got_grad, got_sq;
  auto graph = std::make_unique<train::StepGraph>(body, kWarmup);
  for (int s = 0; s < kSteps; ++s) {
    inputs.push_back(torch::randn({total}, f32));
    graph->run({{inputs.back(), torch::zeros({1}, f32.dtype(torch::kInt64))}});
    if (graph->captured()) rt.watch_replay("CUDA graph replay (test)");
    got_grad.push_back(out_grad.clone());
    got_sq.push_back(out_sq.clone());
  }
  check(graph->captured(), tag + "the step was captured after " + std::to_string(kWarmup) + " eager steps");
  torch::cuda::synchronize();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the monitor polls the replays' events
  // Traffic: one step's, eager, times the steps run so far.
  const auto dp = rt.dp_cp.traffic - before[0], zero = rt.zero.traffic - before[1];
  const int64_t buckets = reducer.bucket_count();
  check(dp.all_reduce == kSteps * (stage == 0 ? buckets + 1 : 1),
        tag + "all-reduces counted over " + std::to_string(kSteps) + " steps: " + std::to_string(dp.all_reduce));
  check(zero.reduce_scatter == kSteps * (stage == 1 ? buckets : 0) &&
            zero.all_gather == kSteps * (stage == 1 ? buckets : 0),
        tag + "reduce-scatters / all-gathers counted: " + std::to_string(zero.reduce_scatter) + " / " +
            std::to_string(zero.all_gather) + " (" + std::to_string(buckets) + " buckets a step)");
  graph.reset();  // before the communicators go (trainer.cpp's run())

  for (int s = 0; s < kSteps; ++s) {
    body({{inputs[s], torch::zeros({1}, f32.dtype(torch::kInt64))}});  // eagerly, as no graph
    const auto name = tag + "step " + std::to_string(s + 1) +
                      (s < kWarmup ? " (eager)" : s == kWarmup ? " (captured)" : " (replayed)");
    check(torch::equal(out_grad, got_grad[s]), name + ": reduced gradients equal the eager step's bitwise");
    check(torch::equal(out_sq, got_sq[s]), name + ": sum of squares equals the eager step's bitwise");
    const double want = inputs[s].to(torch::kFloat64).pow(2).sum().item<double>();
    const double got = got_sq[s].item<double>();
    check(std::abs(got - want) <= 1e-5 * want, name + ": sum of squares " + std::to_string(got) + ", inputs' " +
                                                   std::to_string(want));
  }
  check(!torch::equal(got_grad[kSteps - 1], got_grad[kSteps - 2]), tag + "two replays gave different gradients");
}

// A replay that never completes in time: the monitor must end the process (status 1).
int hang(dist::Runtime& rt) {
  const auto f32 = torch::TensorOptions().device(c10::Device(c10::kCUDA, 0)).dtype(torch::kFloat32);
  auto t = torch::ones({4}, f32);
  bool spin = false;
  train::StepGraph graph(
      [&](const std::vector<data::Batch>&) {
#ifdef NNSTRAIN_CUDA
        if (spin) at::cuda::sleep(20'000'000'000LL);  // ~10 s of GPU clock cycles, replayed
#endif
        rt.wait(rt.all_reduce_async(rt.dp_cp, t, "all-reduce"), rt.dp_cp, "all-reduce");
      },
      /*warmup=*/1);
  const data::Batch b{t, t};
  graph.run({b});  // eager: its collective watched as usual, and done
  torch::cuda::synchronize();
  spin = true;
  graph.run({b});  // captured and replayed
  rt.watch_replay("CUDA graph replay of the training step (test)");
  torch::cuda::synchronize();  // the monitor ends the process before this returns
  std::fprintf(stderr, "FAILED: the replay outlived collective_timeout_s and nothing ended the process\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bool hang_mode = argc > 1 && std::string(argv[1]) == "hang";
  const char* dev = std::getenv("NNSTRAIN_TEST_DEVICE");
  const bool asked = dev && std::string(dev) == "cuda";
  if (!train::graphs_built() || !torch::cuda::is_available()) {
    const char* why = train::graphs_built() ? "no CUDA device" : "nnstrain built without its CUDA code";
    if (asked) {
      std::fprintf(stderr, "NNSTRAIN_TEST_DEVICE=cuda, but %s\n", why);
      return 1;
    }
    std::printf("skipped: %s\n", why);
    return 77;
  }
  try {
    const c10::Device device(c10::kCUDA, 0);
    at::accelerator::setDeviceIndex(0);
    train::use_capture_stream(device);  // before any gradient hook exists (step_graph.h)
    dist::DistEnv env;
    dist::RuntimeOptions ro;
    ro.backend = "nccl";
    ro.cuda = true;
    ro.one_rank_backend = true;
    ro.timeout = std::chrono::milliseconds(hang_mode ? 2000 : 120000);
    dist::Runtime rt(env, ro);
    if (hang_mode) return hang(rt);
    check(rt.dp_cp.nccl && rt.zero.nccl, "one-rank NCCL groups");
    for (int stage : {0, 1}) run(rt, stage);
    rt.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
