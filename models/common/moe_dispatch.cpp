#include "models/common/moe_dispatch.h"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>

namespace nnstrain::models::common {

namespace {

class AllToAllRows : public torch::autograd::Function<AllToAllRows> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& t, std::vector<int64_t> send,
                            std::vector<int64_t> recv, c10::intrusive_ptr<EpComm> comm) {
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    ctx->saved_data["comm"] = c10::IValue::make_capsule(comm);
    return comm->all_to_all(t.contiguous(), send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* comm = dynamic_cast<EpComm*>(ctx->saved_data["comm"].toCapsule().get());
    TORCH_CHECK(comm, "saved expert-parallel communicator has the wrong type");
    const auto send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {comm->all_to_all(grads[0].contiguous(), recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const auto c = t.to(torch::kCPU, torch::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& t, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                           const c10::intrusive_ptr<EpComm>& comm) {
  return AllToAllRows::apply(t, send, recv, comm);
}

at::Tensor run_experts(const at::Tensor& x, const at::Tensor& expert, int64_t num_experts, const ShardingContext& ctx,
                       const ExpertsFn& experts, DispatchStats* stats) {
  TORCH_CHECK(x.dim() == 2 && expert.dim() == 2 && expert.size(0) == x.size(0), "run_experts: x [N, C], expert [N, k]");
  const int64_t N = x.size(0), k = expert.size(1), C = x.size(1);
  const int ep = ctx.ep_comm ? ctx.ep_comm->size() : 1;
  TORCH_CHECK(num_experts % ep == 0, "run_experts: ", num_experts, " experts over ", ep, " ranks");
  const int64_t local = num_experts / ep;

  // Assignments sorted by expert (stable: a token's order within an expert is
  // its order in the batch), the dropped ones (-1) left out.
  const auto flat = expert.reshape({-1});
  const auto kept = flat.ge(0).nonzero().reshape({-1});
  const auto ids = flat.index_select(0, kept);
  const auto order = std::get<1>(ids.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const auto assignment = kept.index_select(0, order);  // sorted position -> assignment index (token * k + j)
  const auto counts = to_vector(torch::bincount(ids, /*weights=*/{}, num_experts));  // the host sync
  if (stats) stats->tokens_per_expert = counts;
  auto rows = x.index_select(0, assignment.div(k, "floor"));

  at::Tensor y;
  if (ep == 1) {
    y = experts(rows, counts);
  } else {
    // counts by destination rank and its local expert; what comes back: by source rank.
    const auto sent = torch::tensor(counts, torch::kLong).view({ep, local});
    const auto got = ctx.ep_comm->exchange_counts(sent).to(torch::kLong).contiguous();
    std::vector<int64_t> send(ep), recv(ep), per_expert(local, 0);
    const auto* g = got.data_ptr<int64_t>();
    for (int d = 0; d < ep; ++d) {
      send[d] = sent[d].sum().item<int64_t>();
      for (int64_t j = 0; j < local; ++j) recv[d] += g[d * local + j], per_expert[j] += g[d * local + j];
    }
    if (stats) {
      const int me = ctx.ep_comm->rank();
      stats->rows_sent = std::accumulate(send.begin(), send.end(), int64_t{0}) - send[me];
      stats->rows_received = std::accumulate(recv.begin(), recv.end(), int64_t{0}) - recv[me];
    }
    auto arrived = all_to_all_rows(rows, send, recv, ctx.ep_comm);  // by source rank, then local expert
    // By local expert, then source rank: the order the grouped GEMM takes.
    std::vector<int64_t> start(ep * local), perm;
    perm.reserve(arrived.size(0));
    int64_t at = 0;
    for (int s = 0; s < ep; ++s)
      for (int64_t j = 0; j < local; ++j) start[s * local + j] = at, at += g[s * local + j];
    for (int64_t j = 0; j < local; ++j)
      for (int s = 0; s < ep; ++s)
        for (int64_t r = 0; r < g[s * local + j]; ++r) perm.push_back(start[s * local + j] + r);
    // Through pinned memory: on CUDA an asynchronous copy (a pageable one blocks the host).
    auto host = torch::empty({static_cast<int64_t>(perm.size())},
                             torch::TensorOptions().dtype(torch::kLong).pinned_memory(x.is_cuda()));
    std::copy(perm.begin(), perm.end(), host.data_ptr<int64_t>());
    const auto perm_t = x.is_cuda() ? host.to(x.device(), /*non_blocking=*/true) : host;
    auto out = experts(arrived.index_select(0, perm_t), per_expert);
    const auto back = torch::empty_like(perm_t).scatter_(0, perm_t, torch::arange(perm_t.numel(), perm_t.options()));
    y = all_to_all_rows(out.index_select(0, back), recv, send, ctx.ep_comm);
  }
  // Each assignment's row (the dropped: a zero row past the end).
  auto where = torch::full({N * k}, assignment.numel(), assignment.options());
  where.index_copy_(0, assignment, torch::arange(assignment.numel(), assignment.options()));
  const auto padded = torch::cat({y, torch::zeros({1, C}, y.options())});
  return padded.index_select(0, where).view({N, k, C});
}

}  // namespace nnstrain::models::common
