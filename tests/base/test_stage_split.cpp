// The layer split for schedules with several stages per rank (zbv,
// 1f1b_interleaved; pipeline_stages.h fastest_split) and the V schedule under
// unequal stage costs. A rank's time per micro-batch is the sum of the stages
// it holds, so a split balancing each stage can leave one rank heavier: under
// V, rank 0 holds both the first stage and the last (the head's).
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "trainer/pipeline/schedule.h"
#include "trainer/pipeline/stages.h"

using namespace nnstrain::parallel;
using namespace nnstrain::parallel::pipeline;

namespace {

std::vector<double> head_on_last(int stages, double head) {
  std::vector<double> extra(stages, 0.0);
  extra.back() = head;
  return extra;
}

// The heaviest rank's work per micro-batch, in layers.
double busiest_rank(const Schedule& s, const std::vector<int>& n, const std::vector<double>& extra) {
  std::vector<double> load(s.ranks, 0.0);
  for (int st = 0; st < s.stages; ++st) load[s.stage_rank[st]] += n[st] + extra[st];
  return *std::max_element(load.begin(), load.end());
}

double makespan(const Schedule& s, const std::vector<int>& n, const std::vector<double>& extra) {
  Costs c;
  for (int st = 0; st < s.stages; ++st) c.stage.push_back({n[st] + extra[st], n[st] + extra[st], n[st] + extra[st]});
  return simulate(s, c).makespan;
}

void check_layers_kept(const std::vector<int>& split, int layers, int stages) {
  REQUIRE(static_cast<int>(split.size()) == stages);
  CHECK(std::accumulate(split.begin(), split.end(), 0) == layers);
  CHECK(*std::min_element(split.begin(), split.end()) >= 1);
}

}  // namespace

TEST_CASE("the split for zbv and interleaved balances what each rank holds", "[pipeline][split]") {
  SECTION("zbv, Llama 3 70B at pp 2: the head's stage shares rank 0 with the first") {
    // balanced_stage_split(80, 4, 0, 1.15) (test_planner pins its rule): the
    // head (6 V h FLOPs at vocab 128256, hidden 8192) is 1.15 layers.
    const std::vector<int> per_stage{21, 20, 20, 19};
    const auto extra = head_on_last(4, 1.15);
    const auto s = make_schedule("zbv", 2, 4, 64);
    // Rank 0 holds stages 0 and 3: 21 + 19 + 1.15 against rank 1's 40.
    CHECK(busiest_rank(s, per_stage, extra) == Approx(41.15));
    const auto split = fastest_split("zbv", 2, 4, 64, per_stage, extra);
    check_layers_kept(split, 80, 4);
    // The least any split of whole layers reaches: rank 0 a + 1.15, rank 1
    // 80 - a, at a = 39.
    CHECK(busiest_rank(s, split, extra) == Approx(41.0));
    CHECK(makespan(s, split, extra) < makespan(s, per_stage, extra));
  }
  SECTION("1f1b_interleaved: rank 1 holds stages 1 and 3 (the head's)") {
    const std::vector<int> per_stage{2, 2, 1, 1};  // balanced_stage_split(6, 4, 0, 1.5)
    const auto extra = head_on_last(4, 1.5);
    const auto s = make_schedule("1f1b_interleaved", 2, 4, 8);
    CHECK(busiest_rank(s, per_stage, extra) == Approx(4.5));  // 2 + 1 + 1.5, rank 0 3
    const auto split = fastest_split("1f1b_interleaved", 2, 4, 8, per_stage, extra);
    check_layers_kept(split, 6, 4);
    CHECK(busiest_rank(s, split, extra) == Approx(4.0));  // rank 0 a, rank 1 7.5 - a: a = 4
    CHECK(makespan(s, split, extra) < makespan(s, per_stage, extra));
  }
  SECTION("one stage per rank keeps the per-stage balance") {
    CHECK(fastest_split("1f1b", 4, 4, 8, {3, 3, 3, 1}, head_on_last(4, 2.0)) == std::vector<int>{3, 3, 3, 1});
  }
}

TEST_CASE("the split is the fastest an exhaustive search finds on small pipelines", "[pipeline][split]") {
  // Every split of the layers into stages of 1 up to the per-stage balance's
  // largest (fastest_split's bound: a stage's activations grow with its
  // layers), simulated in full: 8 micro-batches are 2 per stage, all the
  // search simulates.
  for (const char* scheduler : {"zbv", "1f1b_interleaved"})
    for (int layers : {6, 8, 9, 11})
      for (double head : {0.0, 1.5, 2.5}) {
        INFO(scheduler << " layers " << layers << " head " << head);
        const int stages = 4, micros = 8;
        const auto extra = head_on_last(stages, head);
        const auto per_stage = deal_layers(layers, extra, std::vector<int>(stages, 1));  // balanced_stage_split's
        const int most = *std::max_element(per_stage.begin(), per_stage.end());
        const auto s = make_schedule(scheduler, 2, stages, micros);
        double optimum = 1e300;
        std::vector<int> n(stages);
        std::function<void(int, int)> each = [&](int st, int left) {
          if (st == stages - 1) {
            if (left < 1 || left > most) return;
            n[st] = left;
            optimum = std::min(optimum, makespan(s, n, extra));
            return;
          }
          for (n[st] = 1; n[st] <= std::min(most, left - (stages - 1 - st)); ++n[st]) each(st + 1, left - n[st]);
        };
        each(0, layers);
        const auto split = fastest_split(scheduler, 2, stages, micros, per_stage, extra);
        check_layers_kept(split, layers, stages);
        CHECK(*std::max_element(split.begin(), split.end()) <= most);
        CHECK(makespan(s, split, extra) == Approx(optimum).epsilon(1e-12));
      }
}

TEST_CASE("zbv stays at the V's bound when stages and F, I, W differ", "[pipeline][zero_bubble][split]") {
  // The 70B plan's pp 2 case: stages of 20, 21, 20, 19 layers (rank 1 the
  // busiest, 41), the head 1.15 layers on stage 3, and F and I each carrying
  // tensor-parallel all-reduces (0.3 of a layer's forward) that W does not.
  const std::vector<int> split{20, 21, 20, 19};
  const int m = 64;
  const auto s = make_schedule("zbv", 2, 4, m);
  Costs c;
  for (int st = 0; st < 4; ++st) {
    const double n = split[st] + (st == 3 ? 1.15 : 0.0);
    c.stage.push_back({1.3 * n, 1.3 * n, n});
  }
  const auto sim = simulate(s, c);
  const double busiest = std::max(sim.busy[0], sim.busy[1]);
  CHECK(busiest == Approx(m * (1.3 + 1.3 + 1) * 41));
  // The V's bound at equal costs, (p - 1) / (6m + p - 1): the rank after the
  // first waits p - 1 forwards of the stages before it for its first input,
  // and nothing else. Here too the busiest rank idles exactly stage 0's one
  // forward: 26 of 9472, 0.27% (the bound at equal costs: 0.26%; the
  // list-scheduled order zbv had before idled 4.5% at these costs).
  CHECK(sim.makespan == Approx(busiest + c.stage[0].f).epsilon(1e-12));
  CHECK(1 - busiest / sim.makespan < 0.003);
  // Equal stages with I longer than W: 3.3% idle at p 4, m 16 (the bound at
  // equal costs 3.0%; the list-scheduled order idled 11%).
  Costs skew;
  skew.f = 1, skew.i = 1.1, skew.w = 0.9;
  CHECK(simulate(make_schedule("zbv", 4, 8, 16), skew).mean_bubble() < 0.04);
}
