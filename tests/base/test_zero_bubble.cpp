// The zero-bubble generators: ZB-H1 (zb1p) and ZB-V (zbv) against their
// closed forms at equal F, I and W costs, their memory against 1F1B's, and
// validate()'s bound on pending weight-gradient passes.
//
// ZB-H1's bubble, derived: the last rank starts (p - 1) F late; the first rank
// waits for micro-batch 0's I chain (p I's and p F's after its first F) with
// only p forwards it may run (1F1B's memory), so it idles (p - 1)(F + I - W)
// once W's fill the rest; every rank busy m (F + I + W). Bubble fraction
// (p - 1)(F + I - W) / (m (F + I + W) + (p - 1)(F + I - W)); at F = I = W:
// (p - 1) / (3 m + p - 1) = 3 / 27 = 1/9 = 11.1% at p 4, m 8 (1F1B: 3/11 =
// 27.3%; the bubble's *time* is a third of 1F1B's, the fraction is not).
//
// ZB-V's lower bound: the stage on rank p - 1 waits p - 1 half-stage forwards
// for its first input, and every rank computes 2 m (F + I + W) of half-stage
// work, so no V schedule beats (p - 1) / (6 m + p - 1) at F = I = W: 5.9% at
// m 8, 3.0% at m 16. The generator reaches it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "trainer/pipeline/schedule.h"

using namespace nnstrain::parallel::pipeline;
using Catch::Matchers::Contains;

namespace {

// The most W's waiting after their I on `rank` at once.
int peak_pending_w(const Schedule& s, int rank) {
  int pending = 0, peak = 0;
  for (const auto& a : s.actions[rank]) {
    pending += a.op == Op::I ? 1 : a.op == Op::W ? -1 : 0;
    peak = std::max(peak, pending);
  }
  return peak;
}

Costs chunk_costs(double per_stage) {
  Costs c;
  c.f = c.i = c.w = per_stage;
  return c;
}

}  // namespace

TEST_CASE("zb1p is ZB-H1: (p-1)/(3m+p-1) idle at 1F1B's peak memory", "[pipeline][zero_bubble]") {
  const int p = 4, m = 8;
  const auto zb = make_schedule("zb1p", p, p, m);
  const auto sim = simulate(zb);
  const auto one = simulate(make_schedule("1f1b", p, p, m));
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r);
    CHECK(sim.bubble(r) == Approx(1.0 / 9).margin(1e-9));
    // Live stage-activations (F until W): p on every rank, 1F1B's rank 0.
    CHECK(sim.peak_live[r] <= one.peak_live[0]);
    CHECK(peak_pending_w(zb, r) == r + 1);
  }
  CHECK(one.peak_live[0] == p);
  // The closed form over shapes: makespan 3 m + p - 1 whenever m >= p, never
  // above 1F1B's, memory never above 1F1B's peak.
  for (int pp = 1; pp <= 6; ++pp)
    for (int mm = 1; mm <= 12; ++mm) {
      INFO("p " << pp << " m " << mm);
      const auto s = make_schedule("zb1p", pp, pp, mm);
      REQUIRE_NOTHROW(validate(s));
      const auto z = simulate(s), o = simulate(make_schedule("1f1b", pp, pp, mm));
      if (mm >= pp) CHECK(z.makespan == Approx(3.0 * mm + pp - 1));
      CHECK(z.makespan <= o.makespan + 1e-9);
      CHECK(*std::max_element(z.peak_live.begin(), z.peak_live.end()) <=
            *std::max_element(o.peak_live.begin(), o.peak_live.end()));
    }
  // A cheaper W (attention-heavy layers) still gains on 1F1B.
  Costs c;
  c.f = 1, c.i = 1, c.w = 0.5;
  CHECK(simulate(zb, c).mean_bubble() < simulate(make_schedule("1f1b", p, p, m), c).mean_bubble());
}

TEST_CASE("zbv reaches the V's lower bound at 1F1B's peak memory", "[pipeline][zero_bubble]") {
  const int p = 4;
  for (int m : {8, 16}) {
    INFO("m " << m);
    const auto s = make_schedule("zbv", p, 2 * p, m);
    const auto sim = simulate(s, chunk_costs(0.5));  // half-size stages
    CHECK(sim.mean_bubble() == Approx(double(p - 1) / (6 * m + p - 1)).margin(1e-9));
    for (int r = 0; r < p; ++r) {
      CHECK(sim.peak_live[r] <= 2 * p);  // half-stages: p whole stages, 1F1B's rank 0
      CHECK(peak_pending_w(s, r) <= 2 * p);
    }
  }
  // 4.8% at m 10: the first m below 5% at p 4.
  const auto s10 = make_schedule("zbv", p, 2 * p, 10);
  CHECK(simulate(s10, chunk_costs(0.5)).mean_bubble() < 0.05);
}

TEST_CASE("validate bounds the W's pending after their I", "[pipeline][zero_bubble]") {
  // Every W deferred to the end of the step, as the first zero-bubble generator did: 4 pending on a rank of one stage of p 2.
  const std::string text =
      "schedule lazy ranks 2 stages 2 micros 4\nplacement 0 1\n"
      "rank 0: F0.0 F0.1 F0.2 F0.3 I0.0 I0.1 I0.2 I0.3 W0.0 W0.1 W0.2 W0.3\n"
      "rank 1: F1.0 I1.0 F1.1 I1.1 F1.2 I1.2 F1.3 I1.3 W1.0 W1.1 W1.2 W1.3\n";
  CHECK_THROWS_WITH(from_text(text, "lazy.schedule"),
                    Contains("rank 0 has 3 weight-gradient passes (W) pending after their I at I0.2") &&
                        Contains("pp_size x its stages = 2") && Contains("rank 0 | F0.0"));
  // Two pending per rank is within the bound.
  const std::string ok =
      "schedule ok ranks 2 stages 2 micros 2\nplacement 0 1\n"
      "rank 0: F0.0 F0.1 I0.0 I0.1 W0.0 W0.1\n"
      "rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 W1.1\n";
  CHECK_NOTHROW(from_text(ok, "ok.schedule"));
}
