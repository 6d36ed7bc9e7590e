// `nnstrain launch`: a torchrun-style launcher built in.
//
//   nnstrain launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A
//                   --master-port P] [--exec] -- ARGS...
//
// Starts N local workers with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; and
// OMP_NUM_THREADS=1 unless set), runs `self_exe ARGS...` in each (with --exec:
// ARGS[0] is any program), echoes every line they print as "[rank N] line",
// forwards SIGINT/SIGTERM/SIGHUP to them, and stops them all when one fails.
// On the node of rank 0 it listens on the rendezvous port before any worker
// starts and hands the socket to rank 0 (rendezvous_socket.h), so that two
// launches never race for one port; a --master-port in use is a one-line error.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::dist {

struct LaunchOptions {
  int out_fd = 1;  // workers' stdout lines go here
  int err_fd = 2;  // workers' stderr lines and the launcher's own messages
  // After a worker fails: how long the others get between SIGTERM and SIGKILL.
  double grace_period_s = 5.0;
};

// Returns the exit status for the launcher process: 0 when every worker exits 0;
// 2 for bad flags; the failing worker's status (128+signal when it was killed);
// 128+signal when the launcher itself was interrupted.
int launch_main(const std::vector<std::string>& args, const std::string& self_exe);
int launch_main(const std::vector<std::string>& args, const std::string& self_exe,
                const LaunchOptions& options);

// This binary's path, for `self_exe`: /proc/self/exe where there is one, else argv0.
std::string self_executable(const std::string& argv0);

}  // namespace nnstrain::dist
