// `nnstrain eval SOURCE --tasks FILE...`: lm-evaluation-harness's scores of a
// checkpoint, merged folder or Hugging Face folder (docs/eval.md).
#pragma once

#include <string>
#include <vector>

namespace nnstrain::eval {

int eval_main(const std::vector<std::string>& args);

}  // namespace nnstrain::eval
