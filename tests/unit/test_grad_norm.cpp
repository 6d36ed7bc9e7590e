// The global gradient norm (parallel::global_grad_norm) is accurate on CPU for
// large parameters: LibTorch's fp32 CPU norm accumulates in fp32 and drifts by
// ~1e-4 to 1e-2 relative over millions of elements (clipping would then scale
// by the wrong factor), so the norm is accumulated in fp64 there.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "trainer/state/clip.h"
#include "trainer/state/training_state.h"

using namespace nnstrain;

TEST_CASE("grad norm: a large parameter's norm on CPU matches an fp64 reference", "[clip]") {
  torch::manual_seed(0);
  const int64_t n = 8 << 20;
  std::vector<parallel::ParamShard> params;
  for (const char* name : {"big", "small"}) {
    auto p = torch::zeros({name[0] == 'b' ? n : 1000}).requires_grad_(true);
    params.push_back({name, p, sharding::ShardSpec::full(name, "F32", p.sizes().vec()), 1.0});
  }
  for (int stage : {0, 1}) {
    parallel::TrainingStateOptions o;
    o.zero_stage = stage;
    parallel::TrainingState state(params, o);
    // Gradients of mixed magnitude, where fp32 accumulation loses the most.
    auto g = torch::randn({state.layout().size}) * 1e-3;
    g.narrow(0, 0, 1000).mul_(1000);
    state.flat_grad().copy_(g);
    if (stage == 1) state.shard_grad().copy_(g.narrow(0, 0, state.layout().shard_size));
    const double want = torch::linalg_vector_norm(g.to(torch::kFloat64), 2, {}, false, {}).item<double>();
    const double got = parallel::global_grad_norm(state, nullptr).item<double>();
    INFO("ZeRO stage " << stage);
    CHECK(std::abs(got - want) / want < 1e-6);
    // Meaningful: LibTorch's plain fp32 norm of the same gradients is off by far more.
    const double plain = torch::linalg_vector_norm(g, 2, {}, false, {}).item<double>();
    CHECK(std::abs(plain - want) / want > 1e-5);
  }
}
