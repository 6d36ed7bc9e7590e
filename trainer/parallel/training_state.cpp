#include "trainer/parallel/training_state.h"

#include <torch/torch.h>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"

namespace nnstrain::parallel {

namespace {
std::string st_dtype(c10::ScalarType t) { return checkpoint::dtype_name(checkpoint::to_dtype(t)); }
}  // namespace

StateBytes state_bytes(c10::ScalarType param_dtype, c10::ScalarType grad_dtype, bool master_weights) {
  StateBytes b;
  b.param = c10::elementSize(param_dtype);
  b.grad = c10::elementSize(grad_dtype);
  b.master = master_weights ? 4 : 0;
  // AdamW's moments take the dtype of what it updates: the masters, or the parameters.
  b.moments = 2.0 * (master_weights ? 4 : c10::elementSize(param_dtype));
  return b;
}

FlatLayout FlatLayout::make(const std::vector<int64_t>& numels, int64_t cap, int zsize, int zrank) {
  FlatLayout l;
  l.zsize = zsize;
  l.zrank = zrank;
  l.offset.assign(numels.size(), 0);
  l.bucket_of.assign(numels.size(), 0);
  int64_t pos = 0;
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    const int64_t used = pos - cur.begin;
    pos = cur.begin + (used + zsize - 1) / zsize * zsize;
    cur.end = pos;
    l.buckets.push_back(cur);
    cur = Bucket{};
    cur.begin = pos;
  };
  for (size_t k = numels.size(); k-- > 0;) {
    if (!cur.params.empty() && pos - cur.begin + numels[k] > cap) close();
    l.offset[k] = pos;
    l.bucket_of[k] = l.buckets.size();
    cur.params.push_back(k);
    pos += numels[k];
  }
  close();
  l.size = pos;
  for (const auto& b : l.buckets) {
    l.shard_offset.push_back(l.shard_size);
    l.shard_size += l.chunk_size(b);
  }
  return l;
}

TrainingState::TrainingState(std::vector<ParamShard> params, const TrainingStateOptions& opts)
    : params_(std::move(params)), opts_(opts) {
  TORCH_CHECK(!params_.empty(), "TrainingState: no parameters");
  const auto init_dtype = params_.front().tensor.scalar_type();
  for (const auto& p : params_)
    TORCH_CHECK(p.tensor.scalar_type() == init_dtype, "TrainingState: parameters of mixed dtypes (", p.name, ")");
  grads_via_hook_ = opts_.grad_dtype != opts_.param_dtype;

  std::vector<int64_t> numels;
  for (const auto& p : params_) numels.push_back(p.tensor.numel());
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opts_.bucket_cap_mb * 1048576.0) /
                                               static_cast<int64_t>(c10::elementSize(opts_.grad_dtype)));
  layout_ = FlatLayout::make(numels, cap, opts_.zero ? opts_.zero_size : 1, opts_.zero ? opts_.zero_rank : 0);
  const auto& L = layout_;

  // The initial values, as built (fp32), in the flat layout: the masters start
  // from them exactly, the compute copy is their cast.
  const auto opt = params_.front().tensor.options();
  torch::NoGradGuard no_grad;
  auto init = torch::zeros({L.size}, opt);
  for (size_t k = 0; k < params_.size(); ++k)
    init.narrow(0, L.offset[k], numels[k]).copy_(params_[k].tensor.reshape({-1}));
  if (opts_.zero) shard_grad_ = torch::zeros({L.shard_size}, opt.dtype(opts_.grad_dtype));
  if (opts_.master_weights) {
    TORCH_CHECK(init_dtype == torch::kFloat32, "TrainingState: master weights need fp32 initial parameters");
    if (opts_.zero) {
      flat_master_ = torch::empty({L.shard_size}, opt.dtype(torch::kFloat32));
      for (size_t i = 0; i < L.buckets.size(); ++i)
        flat_master_.narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i]))
            .copy_(init.narrow(0, L.chunk_begin(L.buckets[i]), L.chunk_size(L.buckets[i])));
    } else {
      flat_master_ = init.to(torch::kFloat32);
    }
  }
  flat_param_ = init.to(opts_.param_dtype);
  flat_grad_ = torch::zeros({L.size}, opt.dtype(opts_.grad_dtype));
  // Parameters become views of the flat buffer; their gradients too where the dtypes agree.
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& t = params_[k].tensor;
    t.set_data(flat_param_.narrow(0, L.offset[k], t.numel()).view(t.sizes()));
    grad_views_.push_back(flat_grad_.narrow(0, L.offset[k], t.numel()).view(t.sizes()));
    if (!grads_via_hook_) t.mutable_grad() = grad_views_.back();
    params_[k].spec.dtype = st_dtype(opts_.param_dtype);
  }

  segments_ = make_segments();
  std::vector<double> w;
  for (const auto& s : segments_) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    w.push_back(p.norm_weight);
    norm_weighted_ |= p.norm_weight != 1.0;
  }
  // Built once: no host-to-device copy inside a step.
  norm_weights_ = torch::tensor(w, torch::kFloat64).to(opt.dtype(torch::kFloat32));
}

void TrainingState::accumulate_into_slot(size_t k) {
  auto& g = params_[k].tensor.mutable_grad();
  if (!g.defined()) return;
  grad_views_[k].add_(g);
  g.reset();
}

void TrainingState::zero_grad() {
  flat_grad_.zero_();
  if (grads_via_hook_)
    for (auto& p : params_) p.tensor.mutable_grad().reset();
}

void TrainingState::scale_gradients(const at::Tensor& coef) {
  reduced_grads().mul_(coef.to(flat_grad_.scalar_type()));
}

std::vector<optim::Segment> TrainingState::make_segments() const {
  std::vector<optim::Segment> segs;
  const auto& L = layout_;
  auto wd = [&](size_t k) { return optim::weight_decay_for(params_[k].tensor, opts_.weight_decay); };
  if (!opts_.zero) {
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& t = params_[k].tensor;
      auto param = opts_.master_weights ? flat_master_.narrow(0, L.offset[k], t.numel()).view(t.sizes()) : t;
      segs.push_back({params_[k].name, param, grad_views_[k], wd(k), 0});
    }
    return segs;
  }
  for (size_t bi = 0; bi < L.buckets.size(); ++bi) {
    const auto& b = L.buckets[bi];
    const int64_t c0 = L.chunk_begin(b), c1 = c0 + L.chunk_size(b);
    for (auto k : b.params) {
      const int64_t p0 = L.offset[k], p1 = p0 + params_[k].tensor.numel();
      const int64_t lo = std::max(c0, p0), hi = std::min(c1, p1);
      if (lo >= hi) continue;
      const int64_t in_shard = L.shard_offset[bi] + (lo - c0);
      auto param = opts_.master_weights ? flat_master_.narrow(0, in_shard, hi - lo) : flat_param_.narrow(0, lo, hi - lo);
      segs.push_back({params_[k].name, param, shard_grad_.narrow(0, in_shard, hi - lo), wd(k), lo - p0});
    }
  }
  return segs;
}

std::vector<sharding::ShardSpec> TrainingState::segment_specs(const std::string& prefix) const {
  std::vector<sharding::ShardSpec> specs;
  for (const auto& s : segments_) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    auto spec = p.spec;
    spec.name = prefix + s.name;
    spec.dtype = st_dtype(s.param.scalar_type());
    if (opts_.zero) {
      spec.flat_begin = s.offset;
      spec.flat_end = s.offset + s.param.numel();
      spec.replica_ranks = opts_.zero_replicas;
      std::sort(spec.replica_ranks.begin(), spec.replica_ranks.end());
    }
    specs.push_back(spec);
  }
  return specs;
}

std::vector<sharding::StateTensor> TrainingState::weight_state() const {
  std::vector<sharding::StateTensor> out;
  if (!opts_.master_weights) {
    for (const auto& p : params_) {
      auto spec = p.spec;
      spec.name = "model/" + p.name;
      out.push_back({spec, p.tensor});
    }
    return out;
  }
  const auto specs = segment_specs("model/");
  for (size_t i = 0; i < segments_.size(); ++i) out.push_back({specs[i], segments_[i].param});
  return out;
}

void TrainingState::refresh_compute_copy() {
  if (!opts_.master_weights) return;
  if (!opts_.zero) {
    flat_param_.copy_(flat_master_);
    return;
  }
  const auto& L = layout_;
  for (size_t i = 0; i < L.buckets.size(); ++i)
    flat_param_.narrow(0, L.chunk_begin(L.buckets[i]), L.chunk_size(L.buckets[i]))
        .copy_(flat_master_.narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i])));
}

StateBytes TrainingState::held_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? double(t.nbytes()) : 0.0; };
  return {bytes(flat_param_), bytes(flat_grad_) + bytes(shard_grad_), bytes(flat_master_), 0.0};
}

}  // namespace nnstrain::parallel
