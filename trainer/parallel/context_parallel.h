// Context parallelism's communicator: the CpComm (models/common/sharding.h)
// that context-parallel attention (models/common/context_attention.h) calls,
// over the c10d backend of the context-parallel group: Gloo on CPU, NCCL on
// CUDA (each ring step's send and receive batched into one NCCL group, so two
// ranks sending to each other at cp 2 never wait on one another).
#pragma once

#include <chrono>

#include "models/common/sharding.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace nnstrain::parallel {

// Over `backend` (its rank and size are the group's); null: a group of one.
// Failures and waits longer than `timeout` throw, naming the operation.
c10::intrusive_ptr<models::common::CpComm> make_cp_comm(c10::intrusive_ptr<c10d::Backend> backend,
                                                        std::chrono::milliseconds timeout);

}  // namespace nnstrain::parallel
