#include "trainer/state/tensor_parallel.h"

#include <torch/torch.h>

#include <algorithm>

#include "models/common/parallel_rng.h"
#include "models/model.h"
#include "trainer/checkpoint/tensor_io.h"

namespace nnstrain::parallel {

namespace {

class RuntimeTpComm : public models::common::TpComm {
 public:
  explicit RuntimeTpComm(dist::Runtime& rt) : rt_(rt) {}
  void all_reduce(at::Tensor& t) override { rt_.all_reduce(rt_.tp, t, "tensor-parallel all-reduce"); }
  void all_reduce_max(at::Tensor& t) override { rt_.all_reduce_max(rt_.tp, t, "tensor-parallel max all-reduce"); }
  at::Tensor all_gather(const at::Tensor& t) override { return all_gather_start(t)(); }
  at::Tensor reduce_scatter(const at::Tensor& t) override { return reduce_scatter_start(t)(); }
  Pending all_gather_start(const at::Tensor& t) override {
    static const char* what = "tensor-parallel all-gather";
    const auto in = t.contiguous();
    auto shape = in.sizes().vec();
    shape.insert(shape.begin(), rt_.tp.size());
    auto out = torch::empty(shape, in.options());
    auto work = rt_.all_gather_async(rt_.tp, out.view({-1}), in.reshape({-1}), what);
    return [this, work, out, in] {  // `in` lives until the collective is done
      rt_.wait(work, rt_.tp, what);
      return out;
    };
  }
  Pending reduce_scatter_start(const at::Tensor& t) override {
    static const char* what = "tensor-parallel reduce-scatter";
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == rt_.tp.size(), "reduce_scatter: expected [tp, ...], got ", t.sizes());
    const auto in = t.contiguous();
    auto out = torch::empty(in.sizes().slice(1), in.options());
    auto work = rt_.reduce_scatter_async(rt_.tp, out.view({-1}), in.view({-1}), what);
    return [this, work, out, in] {
      rt_.wait(work, rt_.tp, what);
      return out;
    };
  }

 private:
  dist::Runtime& rt_;
};

// Expert parallelism's collectives on the Runtime's ep group: the counts
// exchange (the host needs the split sizes, so on NCCL it round-trips through
// the device and syncs) and the rows' all-to-all.
class RuntimeEpComm : public models::common::EpComm {
 public:
  explicit RuntimeEpComm(dist::Runtime& rt, c10::Device device) : rt_(rt), device_(device) {}
  int size() const override { return rt_.ep.size(); }
  int rank() const override { return rt_.ep.rank; }
  at::Tensor exchange_counts(const at::Tensor& counts) override {
    static const char* what = "expert-parallel counts exchange";
    TORCH_CHECK(counts.dim() == 2 && counts.size(0) == size(), "exchange_counts: expected [ep, n], got ", counts.sizes());
    auto in = counts.to(device_, torch::kLong).reshape({-1}).contiguous();  // row d: to rank d
    auto out = torch::empty_like(in);
    const std::vector<int64_t> each(size(), counts.size(1));
    rt_.wait(rt_.all_to_all_async(rt_.ep, out, in, each, each, what), rt_.ep, what);
    return out.view(counts.sizes()).to(torch::kCPU);  // the host sync
  }
  at::Tensor all_to_all(const at::Tensor& t, const std::vector<int64_t>& send,
                        const std::vector<int64_t>& recv) override {
    static const char* what = "expert-parallel all-to-all";
    int64_t rows = 0;
    for (auto r : recv) rows += r;
    auto shape = t.sizes().vec();
    shape[0] = rows;
    auto out = torch::empty(shape, t.options());
    const auto in = t.contiguous();
    rt_.wait(rt_.all_to_all_async(rt_.ep, out, in, recv, send, what), rt_.ep, what);
    return out;
  }

 private:
  dist::Runtime& rt_;
  c10::Device device_;
};

}  // namespace

c10::intrusive_ptr<models::common::EpComm> make_ep_comm(dist::Runtime& rt, c10::Device device) {
  return c10::make_intrusive<RuntimeEpComm>(rt, device);
}

c10::intrusive_ptr<models::common::TpComm> make_tp_comm(dist::Runtime& rt) {
  return c10::make_intrusive<RuntimeTpComm>(rt);
}

models::common::ShardingContext sharding_context(dist::Runtime* rt, int64_t vocab_multiple, uint64_t seed,
                                                 bool sequence_parallel) {
  models::common::ShardingContext ctx;
  ctx.options = ctx.options.device(c10::kMeta);
  ctx.vocab_multiple = vocab_multiple;
  if (rt && rt->tp.size() > 1) {
    ctx.tp = rt->tp.size();
    ctx.rank = rt->tp.rank;
    ctx.comm = make_tp_comm(*rt);
    ctx.sequence_parallel = sequence_parallel;
    ctx.rng = std::make_shared<models::common::ParallelRng>(
        models::common::parallel_rng_seed(seed, rt->dp_cp.rank, rt->tp.rank));
  }
  return ctx;
}

std::vector<ParamShard> tensor_parallel_shards(models::CausalLM& model, dist::Runtime* rt, int world_size) {
  const int tp = rt ? rt->tp.size() : 1;
  std::vector<int> all(world_size);
  for (int r = 0; r < world_size; ++r) all[r] = r;
  // Ranks at my tensor-parallel position hold the same pieces as I do (over dp x cp);
  // the same experts, those at my place in every expert-parallel slice of it.
  std::vector<int> same_pos = rt ? rt->dp_cp.ranks : all;
  std::sort(same_pos.begin(), same_pos.end());
  std::vector<int> same_experts = rt ? rt->edp.ranks : all;
  std::sort(same_experts.begin(), same_experts.end());

  const auto layouts = model.param_layouts();
  const auto params = model.named_parameters();
  std::vector<ParamShard> out;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const auto& l = layouts[i];
    const auto& p = params[l.name];
    auto spec = sharding::ShardSpec::full(l.name, checkpoint::dtype_name(checkpoint::to_dtype(p.scalar_type())),
                                            l.global_shape);
    if (!l.split_here()) {
      spec.replica_ranks = all;
      out.push_back({l.name, p, spec, tp > 1 ? 1.0 / tp : 1.0});
      continue;
    }
    spec.offsets = l.blocks[0].offsets;
    spec.shape = l.blocks[0].shape;
    for (size_t b = 1; b < l.blocks.size(); ++b) spec.more_blocks.push_back({l.blocks[b].offsets, l.blocks[b].shape});
    if (l.split.style == models::SplitStyle::Expert && rt && rt->ep.size() > 1) {  // whole experts, the same on every tp rank
      spec.replica_ranks.clear();
      for (int r : same_experts)  // the edp ranks and their tensor-parallel peers
        for (int t = 0; t < tp; ++t) spec.replica_ranks.push_back(r - (rt ? rt->tp.rank : 0) + t);
      std::sort(spec.replica_ranks.begin(), spec.replica_ranks.end());
      out.push_back({l.name, p, spec, tp > 1 ? 1.0 / tp : 1.0, /*expert=*/true});
      continue;
    }
    spec.replica_ranks = same_pos;
    out.push_back({l.name, p, spec, 1.0});
  }
  return out;
}

}  // namespace nnstrain::parallel
