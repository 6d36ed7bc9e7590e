#include "models/common/block_runner.h"

#include "models/common/recompute.h"

namespace nnstrain::models::common {

torch::Tensor run_block(size_t i, const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x,
                        bool recompute_it, BlockHooks* hooks, ParallelRng* rng) {
  auto in = hooks ? hooks->before(i, x) : x;
  auto y = recompute_it ? recompute(fn, in, rng) : fn(in);
  return hooks ? hooks->after(i, y) : y;
}

}  // namespace nnstrain::models::common
