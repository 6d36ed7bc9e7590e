// The communicating autograd functions of Megatron's tensor parallelism, on a
// TpComm (models/common/sharding.h). Autograd contexts hold the comm in an
// IValue capsule, so backward reaches it without a pointer cast.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <utility>

#include "models/common/sharding.h"

namespace nnstrain::models::common {

// f: identity forward, all-reduce of the input gradient backward.
at::Tensor copy_to_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm);
// g: all-reduce forward, identity backward.
at::Tensor reduce_from_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm);

// Sequence parallelism: rank r holds the r-th contiguous 1/tp of the B x T
// tokens in [B, T] order, shaped [B, T/tp, ...] (tp_ops.cpp says why).
// all-gather forward, reduce-scatter of the gradient backward (before a
// column-parallel linear, the LM head);
at::Tensor gather_from_seq(const at::Tensor& x, int tp, const c10::intrusive_ptr<TpComm>& comm);
// reduce-scatter forward, all-gather backward (after a row-parallel linear, the embedding),
// then + bias if defined (its gradient summed from the gathered one: no collective);
at::Tensor reduce_scatter_to_seq(const at::Tensor& x, int tp, const c10::intrusive_ptr<TpComm>& comm,
                                 const at::Tensor& bias = {});
// this rank's part forward, all-gather backward (a replicated input entering the
// region; x [1, T, ...] is broadcast to `batch` first).
at::Tensor scatter_to_seq(const at::Tensor& x, int tp, int rank, const c10::intrusive_ptr<TpComm>& comm,
                          int64_t batch);

// A column-parallel linear on a sequence shard, as Megatron's: forward
// all-gathers x and applies the linear; only the shard is kept for backward,
// which gathers it again (so the gathered input costs no activation memory)
// and reduce-scatters the input's gradient.
at::Tensor sequence_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int tp,
                                    const c10::intrusive_ptr<TpComm>& comm);

// Identity forward; backward all-reduces the gradients of a and b (b may be
// undefined) in one collective: parameters used on a sequence shard (norms).
std::pair<at::Tensor, at::Tensor> sum_grads_over_tp(const at::Tensor& a, const at::Tensor& b,
                                                    const c10::intrusive_ptr<TpComm>& comm);

// A group of one: every collective is the identity (the vocab-parallel loss
// over a whole vocabulary is the plain one).
c10::intrusive_ptr<TpComm> solo_comm();

// For autograd functions: store a comm in / take it back from saved_data.
c10::IValue comm_capsule(const c10::intrusive_ptr<TpComm>& comm);
TpComm& comm_from(const c10::IValue& capsule);

}  // namespace nnstrain::models::common
