#include "trainer/optim/step_cost.h"

#include <algorithm>


namespace nnstrain::optim {

StepCost adamw_step_cost(const config::OptimizerArgs&, const std::vector<CostParam>& params, bool) {
  StepCost c;
  c.state_tensors.assign(params.size(), 2);
  c.matrix_flops.assign(params.size(), 0.0);
  return c;
}

}  // namespace nnstrain::optim
