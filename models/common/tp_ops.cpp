#include "models/common/tp_ops.h"

#include <torch/torch.h>

#include "models/common/weight_grad.h"

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

// Sequence parallelism splits the micro-batch's B x T tokens, in [B, T] order,
// into tp contiguous runs: rank r holds tokens [r BT/tp, (r+1) BT/tp), shaped
// [B, T/tp, ...] (the shape only says how many: everything in the region is
// per token). So gathering and scattering are views of contiguous memory, with
// no transposing copy: what Megatron's [T, B, C] layout buys, without changing
// the models' layout.

// [tp, B, T/tp, ...] as gathered -> [B, T, ...], a view.
at::Tensor seq_from_gathered(const at::Tensor& all) {
  auto sizes = all.sizes().vec();
  const int64_t tp = sizes[0];
  sizes.erase(sizes.begin());
  sizes[1] *= tp;
  return all.view(sizes);
}

// [B, T/tp, ...] of every rank -> [B, T, ...].
at::Tensor seq_all_gather(TpComm& comm, const at::Tensor& x) { return seq_from_gathered(comm.all_gather(x)); }

// [B, T, ...] -> [tp, B, T/tp, ...], rank r's tokens at [r], as reduce_scatter takes them (a view when contiguous).
at::Tensor seq_rank_major(const at::Tensor& x, int64_t tp) {
  auto sizes = x.sizes().vec();
  TORCH_CHECK(sizes.size() >= 2 && sizes[1] % tp == 0, "sequence parallelism: sequence of ", sizes[1],
              " tokens is not divisible by tp ", tp);
  sizes[1] /= tp;
  sizes.insert(sizes.begin(), tp);
  return x.contiguous().view(sizes);
}

// [B, T, ...] partial sums -> this rank's [B, T/tp, ...] of their sum.
at::Tensor seq_reduce_scatter(TpComm& comm, const at::Tensor& x, int64_t tp) {
  return comm.reduce_scatter(seq_rank_major(x, tp));
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

// Forward reduce-scatter, then the replicated bias (if any) on the shard.
// Backward gathers the gradient whole for x anyway, so every rank sums the
// bias gradient over all tokens from it: whole, with no collective of its own.
struct ReduceScatterToSeq : torch::autograd::Function<ReduceScatterToSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                            const c10::intrusive_ptr<TpComm>& comm, int64_t tp) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    auto y = seq_reduce_scatter(*comm, x, tp);
    return bias.numel() ? y.add_(bias) : y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto full = seq_all_gather(comm_from(ctx->saved_data["comm"]), g[0]);
    at::Tensor grad_bias;
    if (ctx->needs_input_grad(1)) grad_bias = full.reshape({-1, full.size(-1)}).sum(0);
    return {full, grad_bias, at::Tensor(), at::Tensor()};
  }
};

// Identity forward; backward sums both parameters' gradients over the group in
// one collective (each rank saw only its own tokens' share).
struct SumGradsOverTp : torch::autograd::Function<SumGradsOverTp> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               const c10::intrusive_ptr<TpComm>& comm) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    ctx->saved_data["a"] = a.sizes().vec();
    ctx->saved_data["b"] = b.sizes().vec();
    return {a.view_as(a), b.view_as(b)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto sa = ctx->saved_data["a"].toIntVector(), sb = ctx->saved_data["b"].toIntVector();
    const auto opts = (g[0].defined() ? g[0] : g[1]).options();
    auto flat_of = [&](const at::Tensor& t, const std::vector<int64_t>& shape) {
      return t.defined() ? t.reshape({-1}) : at::zeros({c10::multiply_integers(shape)}, opts);
    };
    auto flat = at::cat({flat_of(g[0], sa), flat_of(g[1], sb)});
    comm_from(ctx->saved_data["comm"]).all_reduce(flat);
    const int64_t n = c10::multiply_integers(sa);
    auto gb = flat.numel() > n ? flat.narrow(0, n, flat.numel() - n).view(sb) : at::Tensor();
    return {flat.narrow(0, 0, n).view(sa), gb, at::Tensor()};
  }
};

// x [1 or B, T, ...], replicated -> this rank's tokens of it broadcast to B.
struct ScatterToSeq : torch::autograd::Function<ScatterToSeq> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm,
                            int64_t tp, int64_t rank, int64_t batch) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    ctx->saved_data["broadcast"] = x.size(0) != batch;
    auto sizes = x.sizes().vec();
    sizes[0] = batch;
    return seq_rank_major(x.expand(sizes), tp)[rank].clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto full = seq_all_gather(comm_from(ctx->saved_data["comm"]), g[0]);
    if (ctx->saved_data["broadcast"].toBool()) full = full.sum(0, /*keepdim=*/true);
    return {full, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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
    const int64_t tp = ctx->saved_data["tp"].toInt();
    if (auto* store = CaptureWeightGrads::current()) {
      // The split backward's I: grad_x only; W gathers the input again for grad_w.
      // (Every rank of the group runs the same W's in the same order.)
      auto capsule = ctx->saved_data["comm"];
      store->add({saved[1], at::Tensor(),
                  [x, capsule] {
                    const auto total = seq_from_gathered(comm_from(capsule).all_gather(x));
                    return total.reshape({-1, total.size(-1)});
                  },
                  g[0].reshape({-1, g[0].size(-1)})});
      return {seq_reduce_scatter(comm, g[0].matmul(w), tp), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // The input is gathered again (not kept from forward) while grad_x is
    // computed, and grad_x reduce-scattered while grad_w is: Megatron's overlap.
    auto gathering = comm.all_gather_start(x);
    auto scattering = comm.reduce_scatter_start(seq_rank_major(g[0].matmul(w), tp));
    const auto total = seq_from_gathered(gathering());
    const auto grad_w = linear_weight_grad(g[0].reshape({-1, g[0].size(-1)}), total.reshape({-1, total.size(-1)}));
    return {scattering(), grad_w, at::Tensor(), at::Tensor()};
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

at::Tensor reduce_scatter_to_seq(const at::Tensor& x, int tp, const c10::intrusive_ptr<TpComm>& comm,
                                 const at::Tensor& bias) {
  // An undefined tensor cannot enter an autograd function: no bias is an empty one.
  return ReduceScatterToSeq::apply(x, bias.defined() ? bias : at::empty({0}, x.options()), comm,
                                   static_cast<int64_t>(tp));
}

std::pair<at::Tensor, at::Tensor> sum_grads_over_tp(const at::Tensor& a, const at::Tensor& b,
                                                    const c10::intrusive_ptr<TpComm>& comm) {
  auto out = SumGradsOverTp::apply(a, b.defined() ? b : at::empty({0}, a.options()), comm);
  return {out[0], b.defined() ? out[1] : b};
}

at::Tensor scatter_to_seq(const at::Tensor& x, int tp, int rank, const c10::intrusive_ptr<TpComm>& comm,
                          int64_t batch) {
  return ScatterToSeq::apply(x, comm, static_cast<int64_t>(tp), static_cast<int64_t>(rank), batch);
}

at::Tensor copy_to_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return CopyToTp::apply(x, comm);
}

at::Tensor reduce_from_tp(const at::Tensor& x, const c10::intrusive_ptr<TpComm>& comm) {
  return ReduceFromTp::apply(x, comm);
}

}  // namespace nnstrain::models::common
