// The pipeline's plan from pas_config: the user's split kept and checked, each
// stage's blocks contiguous, a combination that cannot run refused.
#include <catch2/catch.hpp>

#include "base/config/arg_map.h"
#include "trainer/pipeline/stages.h"

using namespace nnstrain;
using Catch::Matchers::Contains;

TEST_CASE("the pipeline plan takes stages, micro-batches and layers from pas_config", "[pipeline]") {
  config::PipelineArgs a;
  a.pp_size = 2;
  a.scheduler = "zbv";
  auto p = parallel::pipeline_plan(a, 4, 7);  // auto: two stages per rank
  CHECK(p.pp == 2);
  CHECK(p.stages == 4);
  CHECK(p.nmicros == 4);
  CHECK(p.stage_layers.empty());  // the planner's balance (test_planner: balanced_stage_split)
  p.stage_layers = {2, 2, 2, 1};
  const auto blocks = parallel::stage_blocks(p);
  REQUIRE(blocks.size() == 4);
  CHECK(blocks[0].begin == 0);
  CHECK(blocks[3].end == 7);
  for (size_t s = 1; s < blocks.size(); ++s) CHECK(blocks[s].begin == blocks[s - 1].end);

  a.scheduler = "1f1b";
  a.layers = {1, 3};
  p = parallel::pipeline_plan(a, 2, 4);
  CHECK(p.stages == 2);
  CHECK(p.stage_layers == std::vector<int>{1, 3});
  CHECK_THROWS_WITH(parallel::pipeline_plan(a, 2, 5), Contains("pipeline_layers") && Contains("4 layers") &&
                                                          Contains("has 5"));
  a.layers.clear();
  a.pp_size = 4;
  CHECK_THROWS_WITH(parallel::pipeline_plan(a, 4, 3), Contains("pipeline_nstages") && Contains("only 3 layers"));
  a.scheduler = "1f1b_interleaved";
  CHECK_THROWS_AS(parallel::pipeline_plan(a, 6, 16), config::ConfigError);  // micro-batches not a multiple of pp
  CHECK_THROWS_WITH(parallel::pipeline_plan(a, 6, 16), Contains("pipeline_scheduler") && Contains("multiple of pp_size"));
}
