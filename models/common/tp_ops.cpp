#include "models/common/tp_ops.h"

#include <torch/torch.h>

namespace nnstrain::models::common {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::IValue comm_capsule(const c10::intrusive_ptr<TpComm>& comm) {
  TORCH_CHECK(comm, "tensor-parallel layer without a communicator (tp > 1 needs ShardingContext::comm)");
  return c10::IValue::make_capsule(comm);
}

TpComm& comm_from(const c10::IValue& capsule) {
  auto* comm = dynamic_cast<TpComm*>(capsule.toCapsule().get());
  TORCH_CHECK(comm, "saved tensor-parallel communicator has the wrong type");
  return *comm;
}

namespace {

at::Tensor all_reduced(TpComm& comm, const at::Tensor& t) {
  auto y = t.contiguous().clone();
  comm.all_reduce(y);
  return y;
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(comm_from(ctx->saved_data["comm"]), g[0]), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
    TORCH_CHECK(comm, "tensor-parallel layer without a communicator");
    return all_reduced(*comm, x);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return CopyToTp::apply(x, comm);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return ReduceFromTp::apply(x, comm);
}

}  // namespace nnstrain::models::common
