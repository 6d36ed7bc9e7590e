// Optimizer post-validation's schedule side (pipeline_schedule.h): the prefix
// of leading forwards each rank runs before the previous step is validated,
// and the steady state of consecutive steps it gives.
//
// What to expect at equal costs. Synchronous steps start together, so the
// steady period is one step's makespan. Under post-validation rank r's prefix
// of step t + 1 starts once r finished step t; every other rank's first
// forward needs rank 0's (stage 0 is there). Every generator here ends each
// step on rank 0 (stage 0's backward closes the chain, rank 0 last or tied),
// so rank 0 cannot start early and nothing moves: the period is unchanged.
// A schedule whose last rank finishes after rank 0 gains: see the hand-made
// one below, derived by hand.
#include <catch2/catch.hpp>

#include <string>

#include "trainer/pipeline/schedule.h"

using namespace nnstrain::parallel::pipeline;

namespace {

// What every cut must satisfy: only forwards and activation transfers, and a
// message sent inside a prefix is received inside its receiver's, and back.
void check_consistent(const Schedule& lowered, const std::vector<int>& cut) {
  REQUIRE(static_cast<int>(cut.size()) == lowered.ranks);
  for (int r = 0; r < lowered.ranks; ++r) {
    const auto& row = lowered.actions[r];
    for (int k = 0; k < cut[r]; ++k) {
      const auto& a = row[k];
      INFO("rank " << r << " action " << k);
      CHECK((a.op == Op::F || ((a.op == Op::Send || a.op == Op::Recv) && !a.grad)));
      if (a.op != Op::Send && a.op != Op::Recv) continue;
      bool inside = false;
      const auto& other = lowered.actions[a.peer];
      for (int q = 0; q < cut[a.peer]; ++q)
        inside = inside || (other[q].op == (a.op == Op::Send ? Op::Recv : Op::Send) && other[q].stage == a.stage &&
                            other[q].micro == a.micro && !other[q].grad);
      CHECK(inside);
    }
  }
}

// Per rank, how many actions lead its row before the first that is neither a
// forward nor an activation transfer.
std::vector<int> forward_phase(const Schedule& lowered) {
  std::vector<int> n;
  for (const auto& row : lowered.actions) {
    int k = 0;
    while (k < static_cast<int>(row.size()) &&
           (row[k].op == Op::F || ((row[k].op == Op::Send || row[k].op == Op::Recv) && !row[k].grad)))
      ++k;
    n.push_back(k);
  }
  return n;
}

Schedule two_rank_tail() {
  // Rank 0 runs its forwards first; rank 1 keeps two W's to the end, so with
  // W twice I it finishes after rank 0.
  return from_text(
      "schedule tail ranks 2 stages 2 micros 3\n"
      "placement 0 1\n"
      "rank 0: F0.0 F0.1 F0.2 I0.0 W0.0 I0.1 W0.1 I0.2 W0.2\n"
      "rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2\n");
}

}  // namespace

TEST_CASE("post-validation prefix: forwards only, every message inside both prefixes or neither",
          "[pipeline][post_validation]") {
  for (const auto& [name, stages] : std::vector<std::pair<std::string, int>>{
           {"gpipe", 4}, {"1f1b", 4}, {"1f1b_interleaved", 8}, {"zb1p", 4}, {"zbv", 8}}) {
    INFO(name);
    const auto lowered = lower(make_schedule(name, 4, stages, 8));
    const auto cut = post_validation_prefix(lowered);
    check_consistent(lowered, cut);
    for (int r = 0; r < 4; ++r) CHECK(cut[r] > 0);  // every rank has some forward to run early
    // GPipe runs every forward before any backward, and each activation it sends
    // is received within the receiver's forward phase: the prefix is that whole
    // phase, counted here by a scan of the actions.
    if (name == "gpipe") CHECK(cut == forward_phase(lowered));
  }
}

TEST_CASE("post-validation prefix: the warm-up forwards, their sends, the receives posted early",
          "[pipeline][post_validation]") {
  // 1F1B at p 4: a rank posts a receive at the time its sender produces the
  // message (pipeline::lower), so rank 3's prefix is ra3.0 F3.0 ra3.1 (then
  // B3.0): it takes micro-batches 0 and 1 from rank 2, whose prefix sends both
  // and posts ra2.2 before its first gradient receive; rank 1 sends three and
  // posts ra1.3; rank 0 runs all four warm-up forwards and sends them.
  const auto lowered = lower(make_schedule("1f1b", 4, 4, 8));
  const auto cut = post_validation_prefix(lowered);
  check_consistent(lowered, cut);
  CHECK(cut == std::vector<int>{8, 10, 7, 3});
  const auto& r3 = lowered.actions[3];
  CHECK((r3[cut[3] - 1].op == Op::Recv && r3[cut[3] - 1].micro == 1));  // ra3.1 inside ...
  CHECK(r3[cut[3]].op == Op::B);                                         // ... B3.0 after validation
  const auto& r0 = lowered.actions[0];
  CHECK((r0[cut[0] - 1].op == Op::Send && r0[cut[0] - 1].micro == 3));  // sa1.3 inside
  CHECK((r0[cut[0]].op == Op::Recv && r0[cut[0]].grad));                 // rg0.0 outside
}

TEST_CASE("post-validation prefix: a forward whose send shares a group with backward work sends after validation",
          "[pipeline][post_validation]") {
  // The two-rank tail schedule: rank 0's F0.2 ends when rank 1's I1.0 does, so
  // its send sa1.2 is posted in one group with the gradient receive rg0.0.
  // The group is whole or not at all: F0.2 runs early, sa1.2 after validation.
  const auto lowered = lower(two_rank_tail());
  const auto cut = post_validation_prefix(lowered);
  check_consistent(lowered, cut);
  CHECK(cut == std::vector<int>{5, 3});  // F0.0 sa1.0 F0.1 sa1.1 F0.2 | sa1.2+rg0.0; ra1.0 F1.0 ra1.1 | I1.0
  const auto& r0 = lowered.actions[0];
  CHECK((r0[cut[0] - 1].op == Op::F && r0[cut[0] - 1].micro == 2));
  CHECK((r0[cut[0]].op == Op::Send && r0[cut[0]].micro == 2 && r0[cut[0] + 1].grad && r0[cut[0] + 1].group == r0[cut[0]].group));
}

TEST_CASE("steady state: synchronous steps repeat one step's makespan, post-validation changes nothing where "
          "rank 0 closes every step, and removes zbv's bubble",
          "[pipeline][post_validation]") {
  for (const auto& [name, stages, micros] : std::vector<std::tuple<std::string, int, int>>{
           {"gpipe", 4, 8}, {"1f1b", 4, 8}, {"1f1b_interleaved", 8, 8}, {"zb1p", 4, 8}, {"zbv", 8, 8}, {"zbv", 8, 16}}) {
    INFO(name << " m " << micros);
    const auto s = make_schedule(name, 4, stages, micros);
    const auto one = simulate(s);
    const auto sync = simulate_steady(s, {}, false), pv = simulate_steady(s, {}, true);
    CHECK(sync.period == Approx(one.makespan));
    for (int r = 0; r < 4; ++r) CHECK(sync.busy[r] == Approx(one.busy[r]));
    if (name == "zbv") {
      // The zero-bubble paper's V order ends a step on the last ranks' weight
      // gradients while rank 0 is done: the next step's leading forwards fill
      // what the synchronous step leaves idle, every rank busy the whole
      // period (6m half-stage actions), as the paper's ZB-V with its post-validation.
      CHECK(pv.period == Approx(6.0 * micros));
      for (int r = 0; r < 4; ++r) CHECK(pv.bubble(r) == Approx(0).margin(1e-12));
    } else {
      // The others end every step on rank 0 (stage 0's backward closes the
      // chain), whose forwards every other rank waits for.
      CHECK(pv.period == Approx(one.makespan));
      for (int r = 0; r < 4; ++r) CHECK(pv.bubble(r) == Approx(one.bubble(r)));
    }
  }
  // The published figures at p 4, m 8: 1F1B 3/11, ZB-H1 3/27, ZB-V 3/51 (steps that start together).
  CHECK(simulate_steady(make_schedule("1f1b", 4, 4, 8), {}, false).mean_bubble() == Approx(3.0 / 11));
  CHECK(simulate_steady(make_schedule("zbv", 4, 8, 8), {}, false).mean_bubble() == Approx(3.0 / 51));
}

TEST_CASE("steady state: a last rank finishing after rank 0 lets the next step start early",
          "[pipeline][post_validation]") {
  // By hand, F = I = 1, W = 2. One step alone: rank 0 runs F0.0 F0.1 F0.2
  // in [0,3], I0.0 [3,4] W0.0 [4,6] I0.1 [6,7] W0.1 [7,9] I0.2 [9,10] W0.2
  // [10,12]; rank 1 F1.0 [1,2] I1.0 [2,3] F1.1 [3,4] I1.1 [4,5] W1.0 [5,7]
  // F1.2 [7,8] I1.2 [8,9] W1.1 [9,11] W1.2 [11,13]: makespan 13, 12 busy
  // each, bubble 1/13. Under post-validation, with rank 1 done at B, rank 0
  // (done at B - 1) runs the next F0.0 in [B-1,B] and F0.1 in [B,B+1], rank 1
  // its F1.0 in [B,B+1]; the rest follows as above shifted by B - 1, so rank
  // 1 ends at B + 12 and rank 0 at B + 11: period 12, no bubble.
  Costs c;
  c.f = 1, c.i = 1, c.w = 2;
  const auto s = two_rank_tail();
  const auto one = simulate(s, c);
  CHECK(one.makespan == Approx(13));
  const auto sync = simulate_steady(s, c, false), pv = simulate_steady(s, c, true);
  CHECK(sync.period == Approx(13));
  CHECK(sync.mean_bubble() == Approx(1.0 / 13));
  CHECK(pv.period == Approx(12));
  CHECK(pv.bubble(0) == Approx(0).margin(1e-12));
  CHECK(pv.bubble(1) == Approx(0).margin(1e-12));
  const auto cut = post_validation_prefix(lower(s));
  check_consistent(lower(s), cut);
  CHECK(cut == std::vector<int>{5, 3});  // F0.0 sa1.0 F0.1 sa1.1 F0.2 | sa1.2+rg0.0 deferred; ra1.0 F1.0 ra1.1
}
