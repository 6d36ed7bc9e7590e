#include "trainer/parallel/data_parallel.h"

#include <torch/torch.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::parallel {

DataParallel::DataParallel(std::vector<ParamShard> params, dist::Runtime* rt, const DataParallelOptions& opts)
    : params_(std::move(params)), rt_(rt), opts_(opts) {
  TORCH_CHECK(!params_.empty(), "DataParallel: no parameters");
  if (rt_) {
    dp_ = rt_->dp.size();
    if (opts_.zero) {
      zsize_ = rt_->zero.size();
      zrank_ = rt_->zero.rank;
    }
  }
  const auto dtype = params_.front().tensor.scalar_type();
  for (const auto& p : params_)
    TORCH_CHECK(p.tensor.scalar_type() == dtype, "DataParallel: parameters of mixed dtypes (", p.name, ")");

  // Buckets over params in reverse order, each padded to a multiple of the ZeRO group size.
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opts_.bucket_cap_mb * 1048576.0) /
                                               static_cast<int64_t>(params_.front().tensor.element_size()));
  offset_.assign(params_.size(), 0);
  bucket_of_.assign(params_.size(), 0);
  int64_t pos = 0;
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    const int64_t used = pos - cur.begin;
    const int64_t padded = (used + zsize_ - 1) / zsize_ * zsize_;
    pos = cur.begin + padded;
    cur.end = pos;
    buckets_.push_back(cur);
    cur = Bucket{};
    cur.begin = pos;
  };
  cur.begin = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const int64_t n = params_[k].tensor.numel();
    if (!cur.params.empty() && pos - cur.begin + n > cap) close();
    offset_[k] = pos;
    bucket_of_[k] = buckets_.size();
    cur.params.push_back(k);
    pos += n;
  }
  close();

  // Parameters and gradients become views of the flat buffers.
  auto opt = params_.front().tensor.options();
  flat_param_ = torch::zeros({pos}, opt);
  flat_grad_ = torch::zeros({pos}, opt);
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < params_.size(); ++k) {
      auto& t = params_[k].tensor;
      auto pv = flat_param_.narrow(0, offset_[k], t.numel()).view(t.sizes());
      pv.copy_(t);
      t.set_data(pv);
      t.mutable_grad() = flat_grad_.narrow(0, offset_[k], t.numel()).view(t.sizes());
    }
  }
  if (opts_.zero) {
    int64_t total = 0;
    for (const auto& b : buckets_) {
      shard_offset_.push_back(total);
      total += chunk_size(b);
    }
    shard_grad_ = torch::zeros({total}, opt);
  }
  // Hooks: after a parameter's gradient is accumulated, its bucket may be ready.
  if (dp_ > 1) {
    for (size_t k = 0; k < params_.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[k].tensor);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_grad_ready(k);
            return outputs;
          }));
      accumulators_.push_back(acc);
    }
  }
}

DataParallel::~DataParallel() = default;

int64_t DataParallel::chunk_size(const Bucket& b) const { return (b.end - b.begin) / zsize_; }
int64_t DataParallel::chunk_begin(const Bucket& b) const { return b.begin + zrank_ * chunk_size(b); }

void DataParallel::zero_grad() { flat_grad_.zero_(); }

void DataParallel::begin_micro_step(bool sync) {
  sync_ = sync && dp_ > 1;
  if (!sync_) return;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.ready = b.launched = false;
    b.work.reset();
  }
  next_launch_ = 0;
}

void DataParallel::on_grad_ready(size_t k) {
  if (!sync_) return;
  auto& b = buckets_[bucket_of_[k]];
  if (--b.pending == 0) {
    b.ready = true;
    launch_ready_in_order();
  }
}

// Every rank launches buckets in the same order, whatever order they got ready in.
void DataParallel::launch_ready_in_order() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(buckets_[next_launch_++]);
}

void DataParallel::launch(Bucket& b) {
  auto in = flat_grad_.narrow(0, b.begin, b.end - b.begin);
  if (opts_.zero) {
    auto out = shard_grad_.narrow(0, shard_offset_[&b - buckets_.data()], chunk_size(b));
    b.work = rt_->reduce_scatter_async(rt_->zero, out, in, "gradient reduce-scatter");
  } else {
    b.work = rt_->all_reduce_async(rt_->dp, in, "gradient all-reduce");
  }
  b.launched = true;
}

void DataParallel::finish_gradients() {
  if (!sync_) {
    if (opts_.zero && dp_ == 1) {
      // One rank: its chunk is everything.
      for (size_t i = 0; i < buckets_.size(); ++i)
        shard_grad_.narrow(0, shard_offset_[i], chunk_size(buckets_[i]))
            .copy_(flat_grad_.narrow(0, buckets_[i].begin, chunk_size(buckets_[i])));
    }
    return;
  }
  // Buckets whose parameters got no gradient (unused) still take part.
  for (auto& b : buckets_) b.ready = true;
  launch_ready_in_order();
  for (auto& b : buckets_) rt_->wait(b.work, opts_.zero ? rt_->zero : rt_->dp, "gradient reduction");
  const double inv = 1.0 / dp_;
  if (opts_.zero) {
    if (rt_->zero_cross.size() > 1) rt_->all_reduce(rt_->zero_cross, shard_grad_, "gradient all-reduce across ZeRO groups");
    shard_grad_.mul_(inv);
  } else {
    flat_grad_.mul_(inv);
  }
  sync_ = false;
}

at::Tensor DataParallel::grad_norm() {
  bool weighted = false;
  for (const auto& p : params_) weighted |= p.norm_weight != 1.0;
  at::Tensor sq;
  if (!opts_.zero && !weighted) {
    sq = torch::linalg_vector_norm(flat_grad_, 2, {}, false, torch::kFloat32).pow(2).reshape({1});
  } else {
    // Sum of squares per segment, weighted so tensor-parallel replicas count once.
    std::vector<at::Tensor> grads;
    std::vector<double> w;
    for (const auto& s : optimizer_segments()) {
      grads.push_back(s.grad);
      w.push_back(std::find_if(params_.begin(), params_.end(), [&](const ParamShard& p) { return p.name == s.name; })
                      ->norm_weight);
    }
    auto norms = torch::stack(at::_foreach_norm(grads)).to(torch::kFloat32);
    auto weights = torch::tensor(w, torch::kFloat64).to(norms.options());
    sq = (norms.pow(2) * weights).sum().reshape({1});
  }
  // ZeRO chunks are disjoint within the ZeRO group; TP pieces within the TP group.
  if (rt_ && opts_.zero && rt_->zero.size() > 1) rt_->all_reduce(rt_->zero, sq, "gradient norm all-reduce (ZeRO)");
  if (rt_ && rt_->tp.size() > 1) rt_->all_reduce(rt_->tp, sq, "gradient norm all-reduce (TP)");
  return sq.sqrt().reshape({});
}

void DataParallel::scale_gradients(const at::Tensor& coef) {
  auto c = coef.to(flat_grad_.scalar_type());
  (opts_.zero ? shard_grad_ : flat_grad_).mul_(c);
}

std::vector<optim::Segment> DataParallel::optimizer_segments() const {
  std::vector<optim::Segment> segs;
  auto wd = [&](size_t k) { return optim::weight_decay_for(params_[k].tensor, opts_.weight_decay); };
  if (!opts_.zero) {
    for (size_t k = 0; k < params_.size(); ++k)
      segs.push_back({params_[k].name, params_[k].tensor, params_[k].tensor.grad(), wd(k), 0});
    return segs;
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const auto& b = buckets_[bi];
    const int64_t c0 = chunk_begin(b), c1 = c0 + chunk_size(b);
    for (auto k : b.params) {
      const int64_t p0 = offset_[k], p1 = p0 + params_[k].tensor.numel();
      const int64_t lo = std::max(c0, p0), hi = std::min(c1, p1);
      if (lo >= hi) continue;
      segs.push_back({params_[k].name, flat_param_.narrow(0, lo, hi - lo),
                      shard_grad_.narrow(0, shard_offset_[bi] + (lo - c0), hi - lo), wd(k), lo - p0});
    }
  }
  return segs;
}

std::vector<checkpoint::ShardSpec> DataParallel::segment_specs(const std::string& prefix) const {
  std::vector<checkpoint::ShardSpec> specs;
  for (const auto& s : optimizer_segments()) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    auto spec = p.spec;
    spec.name = prefix + s.name;
    if (opts_.zero) {
      spec.flat_begin = s.offset;
      spec.flat_end = s.offset + s.param.numel();
      spec.replica_ranks = rt_ ? rt_->zero_cross.ranks : std::vector<int>{0};
      std::sort(spec.replica_ranks.begin(), spec.replica_ranks.end());
    }
    specs.push_back(spec);
  }
  return specs;
}

void DataParallel::after_optimizer_step() {
  if (!opts_.zero || !rt_ || rt_->zero.size() < 2) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;  // kept alive until the gathers finish
  for (auto& b : buckets_) {
    inputs.push_back(flat_param_.narrow(0, chunk_begin(b), chunk_size(b)).clone());
    works.push_back(rt_->all_gather_async(rt_->zero, flat_param_.narrow(0, b.begin, b.end - b.begin),
                                          inputs.back(), "parameter all-gather"));
  }
  for (auto& w : works) rt_->wait(w, rt_->zero, "parameter all-gather");
}

int64_t DataParallel::reduced_bytes_per_step() const {
  if (dp_ < 2) return 0;
  return flat_grad_.numel() * flat_grad_.element_size();
}

}  // namespace nnstrain::parallel
