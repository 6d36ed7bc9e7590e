// Gloo's point-to-point under NCCL's rules (NNSTRAIN_P2P_SEMANTICS=nccl,
// trainer/dist/nccl_rules.h): pairing by order alone, a send held until its
// receive is posted, a group's operations progressing together. Two ranks,
// each a dist::Runtime on a thread over one in-memory store, pp 2.
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "trainer/dist/process_groups.h"

using namespace nnstrain;

namespace {

// Runs `body(rt)` on two ranks (pp 2, Gloo, NCCL's point-to-point rules);
// returns each rank's error ("" when none).
std::vector<std::string> two_ranks(std::chrono::milliseconds timeout, bool nccl_rules,
                                   const std::function<void(dist::Runtime&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::DistEnv env;
        env.rank = r;
        env.world_size = 2;
        dist::RuntimeOptions o;
        o.pp = 2;
        o.backend = "gloo";
        o.timeout = timeout;
        o.nccl_p2p_rules = nccl_rules;
        dist::Runtime rt(env, o, store);
        body(rt);
        rt.shutdown();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

at::Tensor value(float v) { return at::full({4}, v); }

}  // namespace

TEST_CASE("NCCL rules on Gloo: messages pair by order, whatever the receiver meant", "[nccl_rules]") {
  // Rank 0 sends 1 then 2 in one group; rank 1 posts its receives in one group
  // as if expecting them the other way round: the first receive gets the first send.
  std::vector<float> got(2, -1);
  const auto errors = two_ranks(std::chrono::seconds(30), true, [&](dist::Runtime& rt) {
    if (rt.pp.rank == 0) {
      rt.wait(rt.p2p_async(rt.pp, {{true, value(1), 1}, {true, value(2), 1}}, "test"), rt.pp, "test");
    } else {
      auto second = at::empty({4}), first = at::empty({4});
      rt.wait(rt.p2p_async(rt.pp, {{false, second, 0}, {false, first, 0}}, "test"), rt.pp, "test");
      got = {second[0].item<float>(), first[0].item<float>()};
    }
  });
  REQUIRE(errors == std::vector<std::string>{"", ""});
  CHECK(got == std::vector<float>{1, 2});
}

TEST_CASE("NCCL rules on Gloo: two lone sends toward each other hang, in one group they complete", "[nccl_rules]") {
  // The old tied-gradient exchange: each rank sends, then receives, as two
  // groups. Each send waits for a receive queued behind the other's send, so
  // neither completes: both waits end at the collective timeout.
  const auto t0 = std::chrono::steady_clock::now();
  const auto lone = two_ranks(std::chrono::milliseconds(1500), true, [&](dist::Runtime& rt) {
    const int peer = 1 - rt.pp.rank;
    auto in = at::empty({4});
    auto sent = rt.p2p_async(rt.pp, {{true, value(float(rt.pp.rank)), peer}}, "lone send");
    auto received = rt.p2p_async(rt.pp, {{false, in, peer}}, "lone receive");
    rt.wait(received, rt.pp, "lone receive");
    rt.wait(sent, rt.pp, "lone send");
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& e : lone) {
    INFO(e);
    CHECK(e.find("collective 'lone receive'") != std::string::npos);
    CHECK(e.find("on group pp") != std::string::npos);
  }
  CHECK(waited >= 1.5);  // it was the timeout that ended them, not an error on the way

  // The same transfers as one group each: they progress together.
  std::vector<float> got(2, -1);
  const auto grouped = two_ranks(std::chrono::seconds(30), true, [&](dist::Runtime& rt) {
    const int peer = 1 - rt.pp.rank;
    auto in = at::empty({4});
    rt.wait(rt.p2p_async(rt.pp, {{true, value(float(10 + rt.pp.rank)), peer}, {false, in, peer}}, "exchange"), rt.pp,
            "exchange");
    got[rt.pp.rank] = in[0].item<float>();
  });
  REQUIRE(grouped == std::vector<std::string>{"", ""});
  CHECK(got == std::vector<float>{11, 10});
}

TEST_CASE("NCCL rules on Gloo: a rank's groups run in issue order", "[nccl_rules]") {
  // Rank 1 posts a receive from rank 0 and then a send to rank 0; rank 0 first
  // waits for that send, then sends. Under NCCL's one stream per communicator,
  // rank 1's send cannot start before its receive completed, which needs rank
  // 0's send, which rank 0 posts only after receiving: a hang. Without the
  // rules (native Gloo) the same program completes, which is why CI needs them.
  auto program = [](dist::Runtime& rt) {
    auto in = at::empty({4});
    if (rt.pp.rank == 1) {
      auto r = rt.p2p_async(rt.pp, {{false, in, 0}}, "receive first");
      auto s = rt.p2p_async(rt.pp, {{true, value(7), 0}}, "send second");
      rt.wait(s, rt.pp, "send second");
      rt.wait(r, rt.pp, "receive first");
    } else {
      rt.wait(rt.p2p_async(rt.pp, {{false, in, 1}}, "wait for rank 1"), rt.pp, "wait for rank 1");
      rt.wait(rt.p2p_async(rt.pp, {{true, value(8), 1}}, "then send"), rt.pp, "then send");
    }
  };
  const auto native = two_ranks(std::chrono::seconds(30), false, program);
  CHECK(native == std::vector<std::string>{"", ""});
  const auto rules = two_ranks(std::chrono::milliseconds(1500), true, program);
  CHECK(!rules[0].empty());
  CHECK(!rules[1].empty());
}
