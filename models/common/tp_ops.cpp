#include "models/common/tp_ops.h"

#include <torch/torch.h>

namespace nnstrain::models::common {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::IValue comm_capsule(const c10::intrusive_ptr<TpComm>& comm) {
  TORCH_CHECK(comm, "tensor-parallel layer without a communicator (tp > 1 needs ShardingContext::comm)");
  return c10::IValue::make_capsule(comm);
}

c10::intrusive_ptr<TpComm> solo_comm() {
  struct Solo : TpComm {
    void all_reduce(at::Tensor&) override {}
    void all_reduce_max(at::Tensor&) override {}
    at::Tensor all_gather(const at::Tensor& t) override { return t.unsqueeze(0); }
    at::Tensor reduce_scatter(const at::Tensor& t) override { return t.squeeze(0); }
  };
  static const auto solo = c10::make_intrusive<Solo>();
  return solo;
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

// [B, T/tp, ...] of every rank -> [B, T, ...].
at::Tensor seq_all_gather(TpComm& comm, const at::Tensor& x) {
  auto all = comm.all_gather(x.contiguous());  // [tp, B, T/tp, ...]
  auto sizes = x.sizes().vec();
  sizes[1] = -1;
  return all.movedim(0, 1).reshape(sizes);     // [B, tp, T/tp, ...] -> [B, T, ...]
}

// [B, T, ...] partial sums -> this rank's [B, T/tp, ...] of their sum.
at::Tensor seq_reduce_scatter(TpComm& comm, const at::Tensor& x, int64_t tp) {
  auto sizes = x.sizes().vec();
  TORCH_CHECK(sizes.size() >= 2 && sizes[1] % tp == 0, "sequence parallelism: sequence of ", sizes[1],
              " tokens is not divisible by tp ", tp);
  sizes[1] /= tp;
  sizes.insert(sizes.begin() + 1, tp);                           // [B, tp, T/tp, ...]
  return comm.reduce_scatter(x.reshape(sizes).movedim(1, 0).contiguous());
}

struct GatherFromSeq : torch::autograd::Function<GatherFromSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm,
                            int64_t tp) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    ctx->saved_data["tp"] = tp;
    return seq_all_gather(*comm, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {seq_reduce_scatter(comm_from(ctx->saved_data["comm"]), g[0], ctx->saved_data["tp"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterToSeq : torch::autograd::Function<ReduceScatterToSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm,
                            int64_t tp) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    return seq_reduce_scatter(*comm, x, tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {seq_all_gather(comm_from(ctx->saved_data["comm"]), g[0]), at::Tensor(), at::Tensor()};
  }
};

struct ScatterToSeq : torch::autograd::Function<ScatterToSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm,
                            int64_t tp, int64_t rank) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    TORCH_CHECK(x.size(1) % tp == 0, "sequence parallelism: sequence of ", x.size(1), " tokens is not divisible by tp ",
                tp);
    const int64_t n = x.size(1) / tp;
    return x.narrow(1, rank * n, n).clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {seq_all_gather(comm_from(ctx->saved_data["comm"]), g[0]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct SequenceParallelLinear : torch::autograd::Function<SequenceParallelLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::intrusive_ptr<TpComm>& comm, int64_t tp) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    ctx->saved_data["tp"] = tp;
    ctx->save_for_backward({x, weight});
    return torch::nn::functional::linear(seq_all_gather(*comm, x), weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& comm = comm_from(ctx->saved_data["comm"]);
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const auto total = seq_all_gather(comm, x);  // gathered again, not kept from forward
    const auto go = g[0].reshape({-1, g[0].size(-1)});
    const auto grad_x = seq_reduce_scatter(comm, g[0].matmul(w), ctx->saved_data["tp"].toInt());
    const auto grad_w = go.t().mm(total.reshape({-1, total.size(-1)}));
    return {grad_x, grad_w, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor sequence_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int tp,
                                    const c10::intrusive_ptr<TpComm>& comm) {
  auto y = SequenceParallelLinear::apply(x, weight, comm, static_cast<int64_t>(tp));
  return bias.defined() ? y + bias : y;  // an undefined tensor cannot enter an autograd function
}

at::Tensor gather_from_seq(const at::Tensor& x, int tp, const c10::intrusive_ptr<TpComm>& comm) {
  return GatherFromSeq::apply(x, comm, static_cast<int64_t>(tp));
}

at::Tensor reduce_scatter_to_seq(const at::Tensor& x, int tp, const c10::intrusive_ptr<TpComm>& comm) {
  return ReduceScatterToSeq::apply(x, comm, static_cast<int64_t>(tp));
}

at::Tensor scatter_to_seq(const at::Tensor& x, int tp, int rank, const c10::intrusive_ptr<TpComm>& comm) {
  return ScatterToSeq::apply(x, comm, static_cast<int64_t>(tp), static_cast<int64_t>(rank));
}

at::Tensor copy_to_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return CopyToTp::apply(x, comm);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return ReduceFromTp::apply(x, comm);
}

}  // namespace nnstrain::models::common
