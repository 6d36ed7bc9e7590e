// DistEnv: which rank this process is, read from the variables of whatever started
// it (torchrun or `nnstrain launch`, SLURM's srun, PBS/PALS mpiexec, Open MPI,
// an MPICH-style PMI launcher). No LibTorch here: the process group is built from
// a DistEnv elsewhere. docs/launching.md lists every variable read.
#pragma once

#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

namespace nnstrain::dist {

// Partial or contradictory launch variables. The message names the variables
// and their values; the CLI prints it and exits with status 2.
struct DistEnvError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1, node_rank = 0, num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // torchrun | slurm | pbs | openmpi | pmi | none
};

// Looks up one environment variable; nullopt when unset. Tests pass a fake.
using GetEnv = std::function<std::optional<std::string>(const std::string&)>;

// The launcher that started this process wins over the allocation it runs in:
// torchrun/`nnstrain launch` (RANK, WORLD_SIZE), then Open MPI's mpirun, PALS
// mpiexec (PBS), an MPICH/Hydra-style PMI launcher, then srun (SLURM). Nothing
// set: a single process. MASTER_ADDR / MASTER_PORT override the derived
// rendezvous address for every source. Throws DistEnvError.
DistEnv read_dist_env(const GetEnv& getenv);
DistEnv read_dist_env();  // the process environment

// First host of a SLURM hostlist: "gpu-[01-04,07],cpu3" -> "gpu-01",
// "a[1-2]-ib" -> "a1-ib", "n1,n2" -> "n1". The whole list is validated;
// a malformed one throws DistEnvError.
std::string slurm_first_host(const std::string& nodelist);

// One line of JSON with every field, for `nnstrain env` and logs.
std::string to_json(const DistEnv& env);

}  // namespace nnstrain::dist
