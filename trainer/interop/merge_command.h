// `nnstrain merge CKPT --out DIR [--hf] [--dtype fp32|bf16|fp16]` (what it
// writes: trainer/checkpoint/merge.h).
#pragma once

#include <string>
#include <vector>

namespace nnstrain::interop {

// args: what follows "merge". Returns the exit status (0, 1 error, 2 usage).
int merge_main(const std::vector<std::string>& args);

}  // namespace nnstrain::interop
