// The scores as a table, one row per task and metric (nnstrain eval's output).
#pragma once

#include <ostream>
#include <vector>

#include "trainer/eval/evaluator.h"

namespace nnstrain::eval {

void print_results(std::ostream& out, const std::vector<TaskResult>& results);

}  // namespace nnstrain::eval
