#include "trainer/optim/muon/muon_config.h"

#include "base/config/load.h"

namespace nnstrain::optim::muon {

std::shared_ptr<const config::OptimizerConfig> parse(config::ArgMap& optimizer, config::OptimizerArgs& o) {
  auto c = std::make_shared<MuonConfig>();
  config::ArgMap a = optimizer.child("args");
  c->lr = a.get_float("lr", c->lr);
  if (c->lr <= 0) a.fail("lr", "must be > 0");
  c->weight_decay = a.get_float("weight_decay", c->weight_decay, 0.0);
  c->momentum = a.get_float("momentum", c->momentum, 0.0);
  if (c->momentum >= 1) a.fail("momentum", "must be in [0, 1)");
  c->nesterov = a.get_bool("nesterov", c->nesterov);
  const auto coef = a.get_float_list("ns_coefficients", std::vector<double>(c->ns_coefficients.begin(), c->ns_coefficients.end()));
  if (coef.size() != 3) a.fail("ns_coefficients", "expected three numbers [a, b, c], got " + std::to_string(coef.size()));
  for (int i = 0; i < 3; ++i) c->ns_coefficients[i] = coef[i];
  // PyTorch's bound: more than 99 iterations is never what was meant.
  c->ns_steps = static_cast<int>(a.get_int("ns_steps", c->ns_steps, 0, 99));
  c->eps = a.get_float("eps", c->eps);
  if (c->eps <= 0) a.fail("eps", "must be > 0");
  c->adjust_lr_fn = a.get_string("adjust_lr_fn", c->adjust_lr_fn, {"original", "match_rms_adamw"});
  c->ns_dtype = a.get_string("ns_dtype", c->ns_dtype, {"auto", "bf16", "fp32"});
  c->params_where = a.where("params");
  c->params = a.get_string_list("params", std::vector<std::string>{});
  config::ArgMap w = optimizer.child("adamw_args");
  config::read_adamw_args(w, o);
  return c;
}

bool takes(const MuonConfig& c, const std::string& name, bool in_block) {
  if (c.params.empty()) return in_block;
  for (const auto& g : c.params)
    if (glob_match(g, name)) return true;
  return false;
}

bool glob_match(const std::string& p, const std::string& s) {
  // Iterative wildcard match with backtracking to the last *.
  size_t i = 0, j = 0, star = std::string::npos, mark = 0;
  while (j < s.size()) {
    if (i < p.size() && p[i] == '*') {
      star = i++;
      mark = j;
    } else if (i < p.size() && p[i] == s[j]) {
      ++i, ++j;
    } else if (star != std::string::npos) {
      i = star + 1;
      j = ++mark;
    } else {
      return false;
    }
  }
  while (i < p.size() && p[i] == '*') ++i;
  return i == p.size();
}

}  // namespace nnstrain::optim::muon
