#include "trainer/optim/muon/muon_config.h"
#include "trainer/optim/muon/newton_schulz.h"

namespace nnstrain::optim::muon {

StepCost step_cost(const config::OptimizerArgs& o, const std::vector<CostParam>& params, bool cuda) {
  static const MuonConfig defaults;  // TrainerArgs made in code may carry none
  const auto& m = o.args ? dynamic_cast<const MuonConfig&>(*o.args) : defaults;
  StepCost c = adamw_step_cost(o, params, cuda);
  c.bf16 = m.ns_dtype == "bf16" || (m.ns_dtype == "auto" && cuda);
  c.what = "Newton-Schulz (" + std::to_string(m.ns_steps) + " steps, " + (c.bf16 ? "bf16" : "fp32") + ")";
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (p.shape.size() < 2 || !takes(m, p.name, p.in_block)) continue;  // (a glob taking a vector is refused at build)
    c.state_tensors[i] = 1;
    c.matrix_flops[i] = newton_schulz_flops(p.shape[p.shape.size() - 2], p.shape.back(), m.ns_steps);
  }
  return c;
}

}  // namespace nnstrain::optim::muon
