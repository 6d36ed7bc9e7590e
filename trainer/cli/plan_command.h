// `nnstrain plan`: load a config, build the model without allocating its
// weights, run the planner and print the plan, per-rank memory and step time.
#pragma once

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "base/config/trainer_args.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::cli {

// `args`: the words after `plan`. Returns the exit status: 0 planned, 1 no plan
// (infeasible split, budget too small: the message has the numbers), 2 usage or
// config error.
int plan_main(const std::vector<std::string>& args);
int plan_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// The configured model with parameters on the meta device: shapes without
// storage, so planning a 1.3B model costs no memory. Falls back to an ordinary
// CPU build if the model's constructor needs real data.
std::shared_ptr<models::CausalLM> build_model_for_planning(const config::TrainerArgs& args);

}  // namespace nnstrain::cli
