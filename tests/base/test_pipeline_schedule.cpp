// Pipeline schedules as data: generation, validation, lowering, the dry run
// (deadlock) and the simulated bubble against the published formulas.
#include <catch2/catch.hpp>

#include <string>

#include "trainer/pipeline/schedule.h"

using namespace nnstrain::parallel::pipeline;
using Catch::Matchers::Contains;

namespace {

Schedule parse(const std::string& text) { return from_text(text, "test.schedule"); }

// Costs of one stage when a model of `ranks` unit-cost slices is cut into
// `stages` equal stages (interleaved and V stages are smaller): F = I = W.
Costs unit_costs(const Schedule& s) {
  const double chunk = double(s.ranks) / s.stages;
  Costs c;
  c.f = c.i = c.w = chunk;
  return c;
}

}  // namespace

TEST_CASE("every scheduler's lists validate and lower and run without deadlock", "[pipeline]") {
  for (const auto& name : scheduler_names()) {
    for (int p : {1, 2, 3, 4}) {
      for (int m : {1, 4, 8}) {
        int stages = p;
        if (name == "1f1b_interleaved") {
          if (m % p) continue;
          stages = 2 * p;
        }
        if (name == "zbv") stages = 2 * p;
        INFO(name << " p " << p << " m " << m);
        const auto s = make_schedule(name, p, stages, m);
        REQUIRE_NOTHROW(validate(s));
        const auto plain = simulate(s);
        const auto low = lower(s);
        const auto lowered = simulate(low);
        CHECK(lowered.makespan == Approx(plain.makespan));  // no transfer cost: the same timeline
        // Work is conserved: every rank computes all its stages' F and B.
        double busy = 0;
        for (double b : plain.busy) busy += b;
        CHECK(busy == Approx(3.0 * stages * m));
        CHECK(hash(parse(to_text(s))) == hash(s));
      }
    }
  }
}

TEST_CASE("simulated bubbles match the published formulas", "[pipeline]") {
  const int p = 4, m = 8;
  // 1F1B and GPipe: (p - 1) / (m + p - 1) = 27.3% on every rank.
  for (const char* name : {"1f1b", "gpipe"}) {
    const auto sim = simulate(make_schedule(name, p, p, m));
    for (int r = 0; r < p; ++r) CHECK(sim.bubble(r) == Approx(3.0 / 11).margin(1e-9));
  }
  // Memory: 1F1B's rank 0 holds p micro-batches at once, GPipe's all m.
  CHECK(simulate(make_schedule("1f1b", p, p, m)).peak_live[0] == p);
  CHECK(simulate(make_schedule("gpipe", p, p, m)).peak_live[0] == m);
  // Interleaved with v = 2 (stages half as long): (p - 1) / (v m + p - 1) = 15.8%.
  const auto il = make_schedule("1f1b_interleaved", p, 2 * p, m);
  const auto sim_il = simulate(il, unit_costs(il));
  CHECK(sim_il.bubble(0) == Approx(3.0 / 19).margin(0.01));
  // Zero bubble at F = I = W: ZB-H1 idles (p - 1)(F + I - W) = (p - 1) F per rank
  // (1F1B: (p - 1)(F + I + W)), within 1F1B's activation memory: 3 / 27 = 11.1%.
  const auto zb = make_schedule("zb1p", p, p, m);
  const auto sim_zb = simulate(zb);
  for (int r = 0; r < p; ++r) CHECK(sim_zb.bubble(r) == Approx(3.0 / 27).margin(1e-9));
  for (int r = 0; r < p; ++r) CHECK(sim_zb.peak_live[r] <= p);  // 1F1B's rank 0 (F until W)
  // ZB-V: only the V's fill and drain, (p - 1) half-stage forwards per rank:
  // (p - 1) / (6 m + p - 1) = 5.9% at m 8, 3.0% at m 16; 1F1B's rank-0 memory.
  for (int micros : {8, 16}) {
    const auto zbv = make_schedule("zbv", p, 2 * p, micros);
    const auto sim_zbv = simulate(zbv, unit_costs(zbv));
    CHECK(sim_zbv.mean_bubble() == Approx(3.0 / (6 * micros + 3)).margin(1e-9));
    for (int r = 0; r < p; ++r) CHECK(sim_zbv.peak_live[r] <= 2 * p);
  }
}

TEST_CASE("a malformed schedule is refused with its grid", "[pipeline]") {
  const std::string head = "schedule t ranks 2 stages 2 micros 2\nplacement 0 1\n";
  // Backward before forward.
  CHECK_THROWS_WITH(parse(head + "rank 0: B0.0 F0.0 F0.1 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\n"),
                    Contains("stage 0 micro-batch 0: its backward comes before its forward") &&
                        Contains("rank 0 | B0.0 F0.0"));
  // A missing micro-batch, an action on the wrong rank, a duplicate, W before I.
  CHECK_THROWS_WITH(parse(head + "rank 0: F0.0 B0.0\nrank 1: F1.0 B1.0 F1.1 B1.1\n"),
                    Contains("stage 0 micro-batch 1 has no forward"));
  CHECK_THROWS_WITH(parse(head + "rank 0: F0.0 F0.1 B0.0 B0.1 F1.0\nrank 1: F1.0 B1.0 F1.1 B1.1\n"),
                    Contains("F1.0 on rank 0: stage 1 lives on rank 1"));
  CHECK_THROWS_WITH(parse(head + "rank 0: F0.0 F0.0 F0.1 B0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\n"),
                    Contains("F0.0 on rank 0 appears twice"));
  CHECK_THROWS_WITH(parse(head + "rank 0: F0.0 F0.1 W0.0 I0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\n"),
                    Contains("stage 0 micro-batch 0: W comes before I"));
  // Syntax: the line at fault is named.
  CHECK_THROWS_WITH(parse(head + "rank 0: F0.0 X0.1\n"), Contains("test.schedule line 3") && Contains("'X0.1'"));
  CHECK_THROWS_WITH(parse(head + "rank 7: F0.0\n"), Contains("line 3: rank 7 outside 0..1"));
  CHECK_THROWS_WITH(parse("placement 0 1\n"), Contains("line 1: placement before the schedule line"));
}

TEST_CASE("a deadlock is found by the dry run, naming the actions waited on", "[pipeline]") {
  // Rank 1 wants micro-batch 1 first; rank 0 sends it only after micro-batch 0's
  // backward, which rank 1 runs only after that forward: a cycle.
  const auto s = parse(
      "schedule cycle ranks 2 stages 2 micros 2\nplacement 0 1\n"
      "rank 0: F0.0 B0.0 F0.1 B0.1\n"
      "rank 1: F1.1 F1.0 B1.0 B1.1\n");
  CHECK_THROWS_WITH(simulate(s), Contains("deadlock") && Contains("rank 0 on B0.0") &&
                                     Contains("rank 1 on F1.1") && Contains("[F1.1]"));
  CHECK_THROWS_WITH(simulate(lower(s)), Contains("deadlock"));
}

TEST_CASE("lowering inserts a send and a receive per crossing and none within a rank", "[pipeline]") {
  const auto s = lower(make_schedule("zbv", 2, 4, 2));
  int sends = 0, recvs = 0;
  for (const auto& row : s.actions)
    for (const auto& a : row) {
      sends += a.op == Op::Send;
      recvs += a.op == Op::Recv;
    }
  // V placement 0 1 1 0: stages 1 -> 2 share rank 1, so per micro-batch two
  // activations and two gradients cross: 4 x 2 micro-batches each way.
  CHECK(sends == 8);
  CHECK(recvs == 8);
}

TEST_CASE("impossible scheduler settings are refused naming the keys", "[pipeline]") {
  CHECK_THROWS_WITH(make_schedule("1f1b", 4, 8, 8), Contains("pipeline_nstages == pp_size"));
  CHECK_THROWS_WITH(make_schedule("1f1b_interleaved", 4, 8, 6), Contains("pipeline_nmicros a multiple of pp_size"));
  CHECK_THROWS_WITH(make_schedule("zbv", 4, 4, 8), Contains("pipeline_nstages == 2 x pp_size"));
  CHECK_THROWS_WITH(make_schedule("pipedream", 4, 4, 8), Contains("is not one of gpipe, 1f1b"));
}
