// The flat layout's buckets under pipeline parallelism with ZeRO 2 and 3
// (TrainingStateOptions::units, pipeline_units): no bucket spans two units,
// the cap still cuts ZeRO-2's, and ZeRO-3 keeps one bucket per unit whatever the cap.
#include <catch2/catch.hpp>

#include <vector>

#include "trainer/state/training_state.h"

using nnstrain::parallel::FlatLayout;
using nnstrain::parallel::TrainingState;
using nnstrain::parallel::TrainingStateOptions;

namespace {

// Each bucket's parameter indices (layout order: registration order reversed).
std::vector<std::vector<size_t>> buckets_of(const FlatLayout& l) {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : l.buckets) out.push_back(b.params);
  return out;
}

TrainingStateOptions options(int zero_stage, std::vector<int> units, double cap_elements = 35) {
  TrainingStateOptions o;
  o.zero_stage = zero_stage;
  o.zero_size = 2;
  o.bucket_cap_mb = 4 * cap_elements / 1048576.0;  // fp32 elements
  o.units = std::move(units);
  return o;
}

}  // namespace

TEST_CASE("pipeline zero layout: ZeRO-2's buckets are capped and never hold two stages' parameters") {
  // Parameters of whole 16-element runs (FlatLayout's alignment adds no padding between them).
  const std::vector<int64_t> numels{16, 16, 16, 16};
  // Without units a cap of 52 elements puts three parameters in one bucket;
  // parameters 0-1 (stage 0) and 2-3 (stage 1) must stay apart.
  CHECK(buckets_of(TrainingState::layout_for(numels, options(2, {}, 52))) ==
        std::vector<std::vector<size_t>>{{3, 2, 1}, {0}});
  const auto l = TrainingState::layout_for(numels, options(2, {0, 0, 1, 1}, 52));
  CHECK(buckets_of(l) == std::vector<std::vector<size_t>>{{3, 2}, {1, 0}});
  // The cap still cuts within a stage.
  CHECK(buckets_of(TrainingState::layout_for(numels, options(2, {0, 0, 0, 0}, 52))) ==
        std::vector<std::vector<size_t>>{{3, 2, 1}, {0}});
  // Each bucket cut into ZeRO chunks of whole 16-element runs: each rank owns half of each.
  CHECK(l.size == 64);
  CHECK(l.shard_size == 32);
}

TEST_CASE("pipeline zero layout: a tied parameter alone is chunked alike whatever else the rank holds") {
  // The first stage holds the tied embedding (7 elements) and more; the last stage the tied
  // embedding and others: the tied parameter's own bucket has the same padding and chunks on both.
  const auto first = TrainingState::layout_for({7, 5, 9}, options(2, {2, 0, 0}));
  const auto last = TrainingState::layout_for({7, 12, 3}, options(2, {2, 1, 1}));
  const auto& a = first.buckets[first.bucket_of[0]];
  const auto& b = last.buckets[last.bucket_of[0]];
  CHECK(a.params == std::vector<size_t>{0});
  CHECK(b.params == std::vector<size_t>{0});
  CHECK(a.end - a.begin == 32);  // 7 elements, chunked over 2 ranks in whole 16-element runs
  CHECK(b.end - b.begin == 32);
  CHECK(first.chunk_size(a) == last.chunk_size(b));
}

TEST_CASE("pipeline zero layout: ZeRO-3 keeps one bucket per unit whatever the cap") {
  // Unit 0 holds 60 elements, beyond the cap of 35: still one bucket.
  const auto l = TrainingState::layout_for({20, 20, 20, 10}, options(3, {0, 0, 0, 1}));
  CHECK(buckets_of(l) == std::vector<std::vector<size_t>>{{3}, {2, 1, 0}});
}
