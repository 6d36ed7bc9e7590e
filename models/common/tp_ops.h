// The communicating autograd functions of Megatron's tensor parallelism, on a
// TpComm (models/common/sharding.h). Autograd contexts hold the comm in an
// IValue capsule, so backward reaches it without a pointer cast.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "models/common/sharding.h"

namespace nnstrain::models::common {

// f: identity forward, all-reduce of the input gradient backward.
at::Tensor copy_to_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm);
// g: all-reduce forward, identity backward.
at::Tensor reduce_from_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm);

// For autograd functions: store a comm in / take it back from saved_data.
c10::IValue comm_capsule(const c10::intrusive_ptr<TpComm>& comm);
TpComm& comm_from(const c10::IValue& capsule);

}  // namespace nnstrain::models::common
