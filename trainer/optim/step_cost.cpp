#include "trainer/optim/step_cost.h"

#include <algorithm>

#include "trainer/optim/muon/muon_config.h"

namespace nnstrain::optim {

StepCost adamw_step_cost(const config::OptimizerArgs&, const std::vector<CostParam>& params, bool) {
  StepCost c;
  c.state_tensors.assign(params.size(), 2);
  c.matrix_flops.assign(params.size(), 0.0);
  return c;
}

StepCost muon_step_cost(const config::OptimizerArgs& o, const std::vector<CostParam>& params, bool cuda) {
  static const muon::MuonConfig defaults;  // TrainerArgs made in code may carry none
  const auto& m = o.args ? dynamic_cast<const muon::MuonConfig&>(*o.args) : defaults;
  StepCost c = adamw_step_cost(o, params, cuda);
  c.bf16 = m.ns_dtype == "bf16" || (m.ns_dtype == "auto" && cuda);
  c.what = "Newton-Schulz (" + std::to_string(m.ns_steps) + " steps, " + (c.bf16 ? "bf16" : "fp32") + ")";
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (p.shape.size() < 2) continue;  // a glob taking a vector is refused when the optimizer is built
    // The rule Muon applies (muon.cpp muon_params): the globs, else every matrix inside the blocks.
    const bool takes = m.params.empty() ? p.in_block
                                        : std::any_of(m.params.begin(), m.params.end(), [&](const std::string& g) {
                                            return muon::glob_match(g, p.name);
                                          });
    if (!takes) continue;
    const double rows = double(p.shape[p.shape.size() - 2]), cols = double(p.shape.back());
    const double s = std::min(rows, cols), l = std::max(rows, cols);
    c.state_tensors[i] = 1;
    c.matrix_flops[i] = m.ns_steps * (4 * s * s * l + 2 * s * s * s);
  }
  return c;
}

}  // namespace nnstrain::optim
