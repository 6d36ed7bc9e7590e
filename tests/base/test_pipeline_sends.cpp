// When the pipeline executor may drop a sent tensor (retired_sends): only
// once the wait before an action has completed the send's group (groups of a
// communicator complete in order); and the sends held at once stay bounded
// where an executor holding every send to the step's end would hold them all.
#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "trainer/pipeline/schedule.h"

using namespace nnstrain::parallel::pipeline;

namespace {

// Sends held at once on rank r: each from its Send until the action retiring it.
int most_held(const Schedule& s, const std::vector<std::vector<int>>& retire, int r) {
  int held = 0, most = 0;
  for (size_t k = 0; k < s.actions[r].size(); ++k) {
    held += s.actions[r][k].op == Op::Send;
    most = std::max(most, held);
    held -= static_cast<int>(retire[k].size());
  }
  return most;
}

struct Case {
  std::string name;
  int p, stages, m;
};

std::vector<Case> every_schedule() {
  std::vector<Case> out;
  for (const auto& name : scheduler_names())
    for (int p : {2, 3, 4})
      for (int m = 1; m <= 8; ++m) {
        if (name == "1f1b_interleaved" && m % p) continue;
        out.push_back({name, p, default_stages(name, p), m});
      }
  return out;
}

}  // namespace

TEST_CASE("every retired send's group is complete where it is retired, in every schedule", "[pipeline]") {
  // The executor waits, before an action consuming a receive, for that
  // receive's group; a communicator's groups complete in order (one NCCL
  // stream), so every group up to it is done and its sends delivered.
  for (const auto& c : every_schedule()) {
    INFO(c.name << " p " << c.p << " m " << c.m);
    const auto s = lower(make_schedule(c.name, c.p, c.stages, c.m));
    for (int r = 0; r < c.p; ++r) {
      const auto retire = retired_sends(s, r);
      const auto waits = group_waits(s, r);
      REQUIRE(retire.size() == s.actions[r].size());
      std::set<int> seen;
      int waited = -1;  // the latest group waited for so far
      for (int k = 0; k < static_cast<int>(retire.size()); ++k) {
        waited = std::max(waited, waits[k]);
        if (!retire[k].empty()) REQUIRE(waits[k] >= 0);
        for (int i : retire[k]) {
          INFO("rank " << r << " retires its action " << i << " at " << k);
          REQUIRE(s.actions[r][i].op == Op::Send);
          CHECK(i < k);
          CHECK(s.actions[r][i].group <= waits[k]);
          CHECK(seen.insert(i).second);  // once
        }
      }
      // What no wait retired is in groups after the last one waited for (the step's end).
      for (int k = 0; k < static_cast<int>(s.actions[r].size()); ++k)
        if (s.actions[r][k].op == Op::Send && !seen.count(k)) CHECK(s.actions[r][k].group > waited);
    }
  }
}

TEST_CASE("the sends held at once are bounded, gpipe's by its micro-batches", "[pipeline]") {
  for (const auto& c : every_schedule()) {
    INFO(c.name << " p " << c.p << " m " << c.m);
    const auto s = lower(make_schedule(c.name, c.p, c.stages, c.m));
    for (int r = 0; r < c.p; ++r) {
      const int held = most_held(s, retired_sends(s, r), r);
      INFO("rank " << r << " holds " << held);
      // GPipe runs every forward first: rank 0 holds all m activations sent
      // (their outputs are held for backward anyway). The others: at most
      // two per stage the rank holds per pipeline rank, whatever m.
      const int stages_here = c.stages / c.p;
      CHECK(held <= (c.name == "gpipe" ? c.m : 2 * stages_here * c.p));
    }
  }
  // Whatever m: at 32 micro-batches the same bounds (GPipe aside).
  for (const auto& name : scheduler_names()) {
    if (name == "gpipe") continue;
    for (int p : {2, 4}) {
      const int stages = default_stages(name, p);
      const auto s = lower(make_schedule(name, p, stages, 32));
      for (int r = 0; r < p; ++r) CHECK(most_held(s, retired_sends(s, r), r) <= 2 * (stages / p) * p);
    }
  }
  // Where the executor used to hold every send to the step's end, 1F1B's
  // first rank at pp 2 now holds at most two of its eight.
  const auto s = lower(make_schedule("1f1b", 2, 2, 8));
  CHECK(most_held(s, retired_sends(s, 0), 0) == 2);
}
