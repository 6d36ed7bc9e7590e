// `nnstrain tokenize`: run a tokenizer from the command line (inspect it, encode a
// file or JSON lines, check that decoding gives the text back). Torch-free.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::tok {

// `args` are the words after `tokenize`. Exit status: 0 done, 1 a file or text that
// cannot be used, 2 usage error.
int tokenize_main(const std::vector<std::string>& args);

}  // namespace nnstrain::tok
