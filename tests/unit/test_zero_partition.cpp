// ZeRO-1 partitioning (parallel::TrainingState + GradientReducer) with a real dist::Runtime (Gloo
// over a TCPStore), its ranks run as threads of this process, one Runtime each:
// - each rank's optimizer state is 1/Z of the whole plus bucket padding, counted
//   from the exp_avg tensors optim::AdamW actually allocated;
// - the segments of a ZeRO group are disjoint and cover every parameter element
//   exactly once (sharding::covered / overlap on the state's segment_specs);
// - after steps with different gradients on every rank, all ranks hold the same
//   parameters, equal to one process's AdamW on the averaged gradients, and each
//   rank's exp_avg chunk is the matching slice of that process's exp_avg.
#include <catch2/catch.hpp>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "trainer/sharding/shard_spec.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/adamw.h"
#include "trainer/state/grad_reducer.h"
#include "trainer/state/training_state.h"

using namespace nnstrain;

namespace {

// Odd sizes and a 26-float bucket cap (0.0001 MB): several buckets, some of odd
// length (so ZeRO pads them), and parameters cut by chunk boundaries.
const std::vector<std::vector<int64_t>> kShapes = {{5}, {5, 3}, {2, 7}, {5, 7}, {3}, {11, 2}, {1}};
constexpr double kBucketCapMb = 0.0001;
constexpr double kLr = 1e-2, kWeightDecay = 0.1;
constexpr int kSteps = 3;

std::string param_name(size_t k) { return "p" + std::to_string(k); }

int64_t total_numel() {
  int64_t n = 0;
  for (const auto& s : kShapes) {
    int64_t m = 1;
    for (auto d : s) m *= d;
    n += m;
  }
  return n;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// The same initial parameters on every rank (and in the reference).
std::vector<torch::Tensor> initial_params() {
  auto gen = at::detail::createCPUGenerator(1234);
  std::vector<torch::Tensor> out;
  for (const auto& s : kShapes) out.push_back(at::randn(s, gen));
  return out;
}

// Rank r's "data" at step s: the gradient of sum(p * x) is x, so ranks differ.
torch::Tensor rank_input(int rank, int step, size_t k) {
  auto gen = at::detail::createCPUGenerator(1000 * step + 100 * rank + static_cast<int64_t>(k) + 1);
  return at::randn(kShapes[k], gen);
}

config::OptimizerArgs adamw_args() {
  config::OptimizerArgs a;
  a.lr = kLr;
  a.weight_decay = kWeightDecay;
  return a;
}

// What one rank saw and holds, collected in its thread and asserted in the main one
// (Catch2 assertions are not thread-safe).
struct RankResult {
  std::string error;
  int zero_rank = -1, zero_size = 0;
  std::vector<int> zero_ranks;
  int64_t bucket_count = 0, padded_total = 0;
  int64_t state_numel = 0;                      // exp_avg elements this rank allocated
  std::vector<sharding::ShardSpec> specs;     // optim/exp_avg/<name>, one per segment
  std::vector<torch::Tensor> exp_avg;           // same order
  std::vector<torch::Tensor> params;            // after kSteps steps, in kShapes order
  std::vector<std::vector<torch::Tensor>> grads_seen;  // this rank's own inputs (step 0)
};

RankResult run_rank(int rank, int world, int zero_ngroups, int port) {
  RankResult res;
  try {
    dist::DistEnv env;
    env.rank = rank;
    env.world_size = world;
    env.local_rank = rank;
    env.local_world_size = world;
    env.master_addr = "127.0.0.1";
    env.master_port = port;
    dist::RuntimeOptions ro;
    ro.zero_ngroups = zero_ngroups;
    ro.backend = "gloo";
    ro.timeout = std::chrono::milliseconds(60000);
    dist::Runtime rt(env, ro);

    std::vector<parallel::ParamShard> shards;
    auto init = initial_params();
    std::vector<int> all(world);
    for (int r = 0; r < world; ++r) all[r] = r;
    for (size_t k = 0; k < kShapes.size(); ++k) {
      auto t = init[k].clone().set_requires_grad(true);
      auto spec = sharding::ShardSpec::full(param_name(k), "F32", kShapes[k]);
      spec.replica_ranks = all;
      shards.push_back({param_name(k), t, spec});
    }
    parallel::TrainingStateOptions o;
    o.bucket_cap_mb = kBucketCapMb;
    o.zero_stage = 1;
    o.zero_size = rt.zero.size();
    o.zero_rank = rt.zero.rank;
    o.zero_replicas = rt.zero_cross.ranks;
    o.weight_decay = kWeightDecay;
    parallel::TrainingState state(std::move(shards), o);
    parallel::GradientReducer reducer(state, &rt);
    optim::AdamW opt(state.optimizer_segments(), adamw_args());

    res.zero_rank = rt.zero.rank;
    res.zero_size = rt.zero.size();
    res.zero_ranks = rt.zero.ranks;
    res.bucket_count = reducer.bucket_count();
    res.padded_total = reducer.reduced_bytes_per_step() / static_cast<int64_t>(sizeof(float));
    for (size_t i = 0; i < opt.segments().size(); ++i) res.state_numel += opt.exp_avg(i).numel();
    res.specs = state.segment_specs("optim/exp_avg/");

    for (int s = 0; s < kSteps; ++s) {
      state.zero_grad();
      reducer.begin_micro_step(true);
      auto loss = torch::zeros({});
      for (size_t k = 0; k < kShapes.size(); ++k) loss = loss + (state.params()[k].tensor * rank_input(rank, s, k)).sum();
      (loss / world).backward();  // each rank's share of the mean (the reducer sums); hooks launch the reduce-scatters
      torch::NoGradGuard no_grad;
      reducer.finish_gradients();
      opt.step(kLr);
      state.refresh_compute_copy();
      reducer.gather_params();
    }
    for (size_t i = 0; i < opt.segments().size(); ++i) res.exp_avg.push_back(opt.exp_avg(i).clone());
    for (const auto& p : state.params()) res.params.push_back(p.tensor.detach().clone());
  } catch (const std::exception& e) {
    res.error = "rank " + std::to_string(rank) + ": " + e.what();
  }
  return res;
}

std::vector<RankResult> run_ranks(int world, int zero_ngroups) {
  const int port = free_port();
  std::vector<RankResult> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] { results[r] = run_rank(r, world, zero_ngroups, port); });
  for (auto& t : threads) t.join();
  return results;
}

// One process, AdamW on whole parameters with the gradient averaged over ranks.
struct Reference {
  std::vector<torch::Tensor> params, exp_avg;
};

Reference reference(int world) {
  auto init = initial_params();
  std::vector<torch::Tensor> params, grads;
  std::vector<optim::Segment> segs;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    params.push_back(init[k].clone());
    grads.push_back(torch::zeros(kShapes[k]));
    segs.push_back({param_name(k), params[k], grads[k], optim::weight_decay_for(params[k], kWeightDecay), 0});
  }
  optim::AdamW opt(segs, adamw_args());
  for (int s = 0; s < kSteps; ++s) {
    for (size_t k = 0; k < kShapes.size(); ++k) {
      auto sum = torch::zeros(kShapes[k]);
      for (int r = 0; r < world; ++r) sum += rank_input(r, s, k);
      grads[k].copy_(sum / world);
    }
    opt.step(kLr);
  }
  Reference ref{params, {}};
  for (size_t k = 0; k < kShapes.size(); ++k) ref.exp_avg.push_back(opt.exp_avg(k));
  return ref;
}

void check_zero(int world, int zero_ngroups) {
  const auto results = run_ranks(world, zero_ngroups);
  for (const auto& r : results) REQUIRE(r.error == "");
  const int z = world / zero_ngroups;
  const int64_t total = total_numel();
  const auto ref = reference(world);

  for (int rank = 0; rank < world; ++rank) {
    const auto& r = results[rank];
    INFO("rank " << rank);
    REQUIRE(r.zero_size == z);
    REQUIRE(r.bucket_count >= 3);
    // The buffer is the parameters plus, for 16-element alignment (FlatLayout), less
    // than 16 elements per parameter and 16 x Z per bucket, and the kShapes need padding.
    CHECK(r.padded_total % z == 0);
    CHECK(r.padded_total > total);
    CHECK(r.padded_total <= total + int64_t(kShapes.size()) * 15 + r.bucket_count * (16 * z - 1));
    // 1/Z of the buffer, and no less than that minus the padding.
    CHECK(r.state_numel * z <= r.padded_total);
    CHECK(r.state_numel >= r.padded_total / z - (r.padded_total - total));
    REQUIRE(r.specs.size() == r.exp_avg.size());
    for (size_t i = 0; i < r.specs.size(); ++i) CHECK(r.specs[i].numel() == r.exp_avg[i].numel());
  }

  // Every ZeRO group partitions every parameter: disjoint, complete.
  std::map<std::vector<int>, std::vector<int>> groups;
  for (int rank = 0; rank < world; ++rank) groups[results[rank].zero_ranks].push_back(rank);
  REQUIRE(static_cast<int>(groups.size()) == zero_ngroups);
  for (const auto& [ranks, members] : groups) {
    REQUIRE(static_cast<int>(members.size()) == z);
    int64_t group_state = 0;
    for (int m : members) group_state += results[m].state_numel;
    CHECK(group_state == total);
    for (size_t k = 0; k < kShapes.size(); ++k) {
      const auto name = "optim/exp_avg/" + param_name(k);
      const auto wanted = sharding::ShardSpec::full(name, "F32", kShapes[k]);
      std::vector<sharding::ShardSpec> pieces;
      std::vector<int> owner;
      for (int m : members)
        for (const auto& s : results[m].specs)
          if (s.name == name) {
            pieces.push_back(s);
            owner.push_back(m);
          }
      INFO(name << " in ZeRO group of rank " << members.front());
      int64_t held = 0;
      for (const auto& p : pieces) held += p.numel();
      CHECK(sharding::covered(pieces, wanted) == wanted.numel());
      CHECK(held == wanted.numel());
      for (size_t a = 0; a < pieces.size(); ++a)
        for (size_t b = a + 1; b < pieces.size(); ++b) {
          INFO(pieces[a].describe() << " on rank " << owner[a] << " vs " << pieces[b].describe() << " on rank "
                                    << owner[b]);
          CHECK(sharding::overlap(pieces[a], pieces[b]).empty());
        }
    }
  }

  // Same position in every ZeRO group: the same pieces, and the specs say so.
  for (int a = 0; a < world; ++a)
    for (int b = 0; b < world; ++b) {
      if (results[a].zero_rank != results[b].zero_rank) continue;
      REQUIRE(results[a].specs.size() == results[b].specs.size());
      for (size_t i = 0; i < results[a].specs.size(); ++i) {
        const auto& sa = results[a].specs[i];
        const auto& sb = results[b].specs[i];
        CHECK(sa.name == sb.name);
        CHECK(sa.flat_begin == sb.flat_begin);
        CHECK(sa.end() == sb.end());
        CHECK(sa.replica_ranks == sb.replica_ranks);
        CHECK(std::find(sa.replica_ranks.begin(), sa.replica_ranks.end(), a) != sa.replica_ranks.end());
      }
    }

  // After the steps: identical parameters everywhere, equal to one process's.
  for (int rank = 0; rank < world; ++rank) {
    for (size_t k = 0; k < kShapes.size(); ++k) {
      INFO("rank " << rank << " " << param_name(k));
      CHECK(torch::equal(results[rank].params[k], results[0].params[k]));
      CHECK(torch::allclose(results[rank].params[k], ref.params[k], 1e-5, 1e-6));
      // It moved (so the comparisons above are not of untouched tensors).
      CHECK(!torch::allclose(results[rank].params[k], initial_params()[k]));
    }
    // Each rank's exp_avg chunk is the reference's exp_avg over the same flat range.
    const auto& r = results[rank];
    for (size_t i = 0; i < r.specs.size(); ++i) {
      const auto& s = r.specs[i];
      size_t k = 0;
      while (k < kShapes.size() && "optim/exp_avg/" + param_name(k) != s.name) ++k;
      REQUIRE(k < kShapes.size());
      INFO("rank " << rank << " " << s.describe());
      auto want = ref.exp_avg[k].reshape({-1}).narrow(0, s.flat_begin, s.end() - s.flat_begin);
      CHECK(torch::allclose(r.exp_avg[i].reshape({-1}), want, 1e-5, 1e-7));
    }
  }
}

}  // namespace

TEST_CASE("zero partition: ZeRO-1 over 2 ranks: each holds half the optimizer state, together all of it once",
          "[zero]") {
  check_zero(2, 1);
}

TEST_CASE("zero partition: ZeRO-1 over 4 ranks: each holds a quarter of the optimizer state",
          "[zero]") {
  check_zero(4, 1);
}

TEST_CASE("zero partition: ZeRO-1 over 4 ranks in 2 groups: each holds half, every group all of it once",
          "[zero]") {
  check_zero(4, 2);
}
