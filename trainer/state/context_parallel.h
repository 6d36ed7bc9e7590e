// Context parallelism's communicator: the CpComm (models/common/sharding.h)
// that context-parallel attention (models/common/context_attention.h) calls,
// over the Runtime's context-parallel group (Gloo on CPU, NCCL on CUDA), so
// that its ring steps and gathers are counted, watched and diagnosed as every
// other collective of the run: a peer that dies inside a ring step ends this
// rank within compute_config.collective_timeout_s, naming the collective.
#pragma once

#include "models/common/sharding.h"
#include "trainer/dist/process_groups.h"

namespace nnstrain::parallel {

// Over rt.cp (rt outlives the result); at cp 1 its ops return their input.
c10::intrusive_ptr<models::common::CpComm> make_cp_comm(dist::Runtime& rt);

}  // namespace nnstrain::parallel
