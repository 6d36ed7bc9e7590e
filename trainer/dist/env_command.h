// `nnstrain env`: prints the DistEnv this process would train with, as one line
// of JSON, so a cluster user can check what srun / mpiexec / torchrun handed it.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::dist {

// 0 after printing; 2 (with the message on stderr) when the launch variables
// are partial or contradictory, or on an unexpected argument.
int env_main(const std::vector<std::string>& args);

}  // namespace nnstrain::dist
