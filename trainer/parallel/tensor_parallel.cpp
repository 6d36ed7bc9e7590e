#include "trainer/parallel/tensor_parallel.h"

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

}  // namespace

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
  // Ranks at my tensor-parallel position hold the same pieces as I do (over dp x cp).
  std::vector<int> same_pos = rt ? rt->dp_cp.ranks : all;
  std::sort(same_pos.begin(), same_pos.end());

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
    spec.replica_ranks = same_pos;
    out.push_back({l.name, p, spec, 1.0});
  }
  return out;
}

}  // namespace nnstrain::parallel
