// The optimizer's collectives (trainer/optim/comm.h) over the Runtime's stage
// group: every rank at this pipeline index. Under NCCL these are collectives on
// a communicator of their own, issued by every member in the same order (the
// optimizer step's), so they never pair with another group's work.
#pragma once

#include <memory>

#include "trainer/optim/comm.h"

namespace nnstrain::dist {
class Runtime;
}

namespace nnstrain::parallel {

// rt null: one process (optim::local_comm).
std::shared_ptr<optim::OptimizerComm> make_optimizer_comm(dist::Runtime* rt, c10::Device device);

}  // namespace nnstrain::parallel
