#include "trainer/dist/env_command.h"

#include <iostream>

#include "trainer/dist/dist_env.h"

namespace nnstrain::dist {

int env_main(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "-h" || a == "--help") {
      std::cout << "usage: nnstrain env\n\n"
                   "Prints, as one line of JSON, the rank, world size, local rank, node and\n"
                   "rendezvous address this process would use, read from the variables of\n"
                   "torchrun / nnstrain launch, srun, PBS/PALS mpiexec, Open MPI or PMI\n"
                   "(docs/launching.md). Run it the way you run training: srun nnstrain env\n";
      return 0;
    }
    std::cerr << "nnstrain env: unexpected argument '" << a << "'\n";
    return 2;
  }
  try {
    std::cout << to_json(read_dist_env()) << std::endl;
    return 0;
  } catch (const DistEnvError& e) {
    std::cerr << "nnstrain env: " << e.what() << std::endl;
    return 2;
  }
}

}  // namespace nnstrain::dist
