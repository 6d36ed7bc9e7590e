// Tensor parallelism, Megatron style. The models build it themselves: their
// typed layers (models/common/layers.h) allocate this rank's pieces from a
// ShardingContext and communicate through its TpComm. What lives here is the
// communicator over dist::Runtime's tensor-parallel group, the context a rank
// builds its model with, and the ShardSpecs of what the rank then holds.
#pragma once

#include <vector>

#include "models/common/sharding.h"
#include "trainer/dist/process_groups.h"
#include "trainer/state/training_state.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::parallel {

// The tensor-parallel group's collectives, as the models' layers call them.
c10::intrusive_ptr<models::common::TpComm> make_tp_comm(dist::Runtime& rt);
// The expert-parallel group's collectives (counts exchange, all-to-all) on tensors of `device`.
c10::intrusive_ptr<models::common::EpComm> make_ep_comm(dist::Runtime& rt, c10::Device device);

// This rank's context: tp degree and position from rt (tp 1 without one),
// parameters built on the meta device, to be materialised on the run's device;
// the vocabulary padded to a multiple of vocab_multiple x tp; under tp > 1 a
// model-parallel RNG for sharded regions, seeded from (seed, dp x cp rank, tp rank).
// Sequence parallelism with it when `sequence_parallel`.
models::common::ShardingContext sharding_context(dist::Runtime* rt, int64_t vocab_multiple = 1, uint64_t seed = 0,
                                                 bool sequence_parallel = false);

// Every parameter as this rank holds it, with its ShardSpec from its layer's
// layout; the replicas of a split piece are the ranks at the same
// tensor-parallel position (the dp x cp group), of a replicated one every rank.
std::vector<ParamShard> tensor_parallel_shards(models::CausalLM& model, dist::Runtime* rt, int world_size);

}  // namespace nnstrain::parallel
