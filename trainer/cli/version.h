// `nnstrain --version`: what this binary is and what it was built with, one
// "key: value" line each (tests/integration/test_cli_front.py reads them):
//   nnstrain 0.1.0
//   commit: <40 hex> | unknown          (the source tree's HEAD at build time)
//   tree: clean | dirty | unknown       (tracked files changed since that commit)
//   libtorch: 2.11.0                    (the LibTorch headers it was compiled against)
//   cuda: compiled in (CUDA 13.0, NCCL 2.28.9) | not compiled in (CPU-only build)
//   cpu capability: AVX512              (the kernels LibTorch picks on this CPU)
#pragma once

#include <ostream>

namespace nnstrain::cli {

void print_version(std::ostream& out);

}  // namespace nnstrain::cli
