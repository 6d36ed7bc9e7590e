// Routed tokens to the experts that hold them and back: the token dispatcher
// of a Mixture-of-Experts layer. At ep 1 a permutation (tokens sorted by
// expert, so the experts run as one grouped GEMM); under expert parallelism
// (ShardingContext::ep > 1) the sorted rows travel to their experts' ranks by
// all-to-all and return the same way, after the per-rank counts are exchanged.
// Forward and backward are exact: the backward of each all-to-all is the
// all-to-all of the gradients with the splits swapped.
//
// Backend rules (docs/parallelism.md, "Expert parallelism"): every rank of the
// ep group issues, per MoE layer and micro-batch, one counts exchange and two
// all-to-alls forward (two backward), in layer order, whatever it routed, with
// zero rows where it has none; the counts exchange is a host sync (split sizes
// must be on the host), the only one expert parallelism adds.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "models/common/sharding.h"

namespace nnstrain::models::common {

// The experts of this rank on rows sorted by local expert: rows [sum(counts), C]
// (counts[j] rows for local expert j, in order). Returns [sum(counts), C].
using ExpertsFn = std::function<at::Tensor(const at::Tensor& rows, const std::vector<int64_t>& counts)>;

// What one dispatch moved, for the layer's metrics.
struct DispatchStats {
  std::vector<int64_t> tokens_per_expert;  // global experts, this rank's assignments (dropped ones excluded)
  int64_t rows_sent = 0, rows_received = 0;  // to and from other ranks (0 at ep 1)
};

// x [N, C]: the layer's tokens; expert [N, k] int64: each token's k global
// expert ids in [0, num_experts), -1 for an assignment dropped (capacity).
// Returns [N, k, C]: each assignment's expert output (zeros where dropped).
at::Tensor run_experts(const at::Tensor& x, const at::Tensor& expert, int64_t num_experts,
                       const ShardingContext& ctx, const ExpertsFn& experts, DispatchStats* stats = nullptr);

// The all-to-all as an autograd function (backward: the gradients' all-to-all, splits swapped).
at::Tensor all_to_all_rows(const at::Tensor& t, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                           const c10::intrusive_ptr<EpComm>& comm);

}  // namespace nnstrain::models::common
