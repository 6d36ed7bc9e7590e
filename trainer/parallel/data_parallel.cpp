#include "trainer/parallel/data_parallel.h"

#include <torch/torch.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

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
  const auto init_dtype = params_.front().tensor.scalar_type();
  for (const auto& p : params_)
    TORCH_CHECK(p.tensor.scalar_type() == init_dtype, "DataParallel: parameters of mixed dtypes (", p.name, ")");
  grads_via_hook_ = opts_.grad_dtype != opts_.param_dtype;

  // Buckets over params in reverse order, each padded to a multiple of the ZeRO group size.
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opts_.bucket_cap_mb * 1048576.0) /
                                               static_cast<int64_t>(c10::elementSize(opts_.grad_dtype)));
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
  if (opts_.zero) {
    int64_t total = 0;
    for (const auto& b : buckets_) {
      shard_offset_.push_back(total);
      total += chunk_size(b);
    }
    shard_grad_ = torch::zeros({total}, params_.front().tensor.options().dtype(opts_.grad_dtype));
  }

  // The initial values, as built (fp32), in the flat layout: the masters start
  // from them exactly, the compute copy is their cast.
  const auto opt = params_.front().tensor.options();
  {
    torch::NoGradGuard no_grad;
    auto init = torch::zeros({pos}, opt);
    for (size_t k = 0; k < params_.size(); ++k)
      init.narrow(0, offset_[k], params_[k].tensor.numel()).copy_(params_[k].tensor.reshape({-1}));
    if (opts_.master_weights) {
      TORCH_CHECK(init_dtype == torch::kFloat32, "DataParallel: master weights need fp32 initial parameters");
      if (opts_.zero) {
        flat_master_ = torch::empty({shard_grad_.numel()}, opt.dtype(torch::kFloat32));
        for (size_t i = 0; i < buckets_.size(); ++i)
          flat_master_.narrow(0, shard_offset_[i], chunk_size(buckets_[i]))
              .copy_(init.narrow(0, chunk_begin(buckets_[i]), chunk_size(buckets_[i])));
      } else {
        flat_master_ = init.to(torch::kFloat32);
      }
    }
    flat_param_ = init.to(opts_.param_dtype);
    flat_grad_ = torch::zeros({pos}, opt.dtype(opts_.grad_dtype));
    // Parameters become views of the flat buffer; their gradients too where the dtypes agree.
    for (size_t k = 0; k < params_.size(); ++k) {
      auto& t = params_[k].tensor;
      t.set_data(flat_param_.narrow(0, offset_[k], t.numel()).view(t.sizes()));
      grad_views_.push_back(flat_grad_.narrow(0, offset_[k], t.numel()).view(t.sizes()));
      if (!grads_via_hook_) t.mutable_grad() = grad_views_.back();
      params_[k].spec.dtype = st_dtype(opts_.param_dtype);
    }
  }

  // Hooks: after a parameter's gradient is accumulated, move it into its fp32
  // slot (mixed), and its bucket may be ready for reduction.
  if (dp_ > 1 || grads_via_hook_) {
    for (size_t k = 0; k < params_.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[k].tensor);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (grads_via_hook_) {
              auto& g = params_[k].tensor.mutable_grad();
              if (g.defined()) {
                grad_views_[k].add_(g);
                g.reset();
              }
            }
            on_grad_ready(k);
            return outputs;
          }));
      accumulators_.push_back(acc);
    }
  }

  segments_ = make_segments();
  std::vector<double> w;
  for (const auto& s : segments_)
    w.push_back(std::find_if(params_.begin(), params_.end(), [&](const ParamShard& p) { return p.name == s.name; })
                    ->norm_weight);
  // Built once: no host-to-device copy inside a step.
  norm_weights_ = torch::tensor(w, torch::kFloat64).to(opt.dtype(torch::kFloat32));
}

DataParallel::~DataParallel() = default;

int64_t DataParallel::chunk_size(const Bucket& b) const { return (b.end - b.begin) / zsize_; }
int64_t DataParallel::chunk_begin(const Bucket& b) const { return b.begin + zrank_ * chunk_size(b); }

void DataParallel::zero_grad() {
  flat_grad_.zero_();
  if (grads_via_hook_)
    for (auto& p : params_) p.tensor.mutable_grad().reset();
}

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
    for (const auto& s : segments_) grads.push_back(s.grad);
    auto norms = torch::stack(at::_foreach_norm(grads)).to(torch::kFloat32);
    sq = (norms.pow(2) * norm_weights_).sum().reshape({1});
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

std::vector<optim::Segment> DataParallel::optimizer_segments() const { return segments_; }

std::vector<optim::Segment> DataParallel::make_segments() const {
  std::vector<optim::Segment> segs;
  auto wd = [&](size_t k) { return optim::weight_decay_for(params_[k].tensor, opts_.weight_decay); };
  if (!opts_.zero) {
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& t = params_[k].tensor;
      auto param = opts_.master_weights ? flat_master_.narrow(0, offset_[k], t.numel()).view(t.sizes()) : t;
      segs.push_back({params_[k].name, param, grad_views_[k], wd(k), 0});
    }
    return segs;
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const auto& b = buckets_[bi];
    const int64_t c0 = chunk_begin(b), c1 = c0 + chunk_size(b);
    for (auto k : b.params) {
      const int64_t p0 = offset_[k], p1 = p0 + params_[k].tensor.numel();
      const int64_t lo = std::max(c0, p0), hi = std::min(c1, p1);
      if (lo >= hi) continue;
      const int64_t in_shard = shard_offset_[bi] + (lo - c0);
      auto param = opts_.master_weights ? flat_master_.narrow(0, in_shard, hi - lo) : flat_param_.narrow(0, lo, hi - lo);
      segs.push_back({params_[k].name, param, shard_grad_.narrow(0, in_shard, hi - lo), wd(k), lo - p0});
    }
  }
  return segs;
}

std::vector<checkpoint::ShardSpec> DataParallel::segment_specs(const std::string& prefix) const {
  std::vector<checkpoint::ShardSpec> specs;
  for (const auto& s : segments_) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    auto spec = p.spec;
    spec.name = prefix + s.name;
    spec.dtype = st_dtype(s.param.scalar_type());
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

std::vector<checkpoint::StateTensor> DataParallel::weight_state() const {
  std::vector<checkpoint::StateTensor> out;
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

void DataParallel::after_optimizer_step() {
  if (opts_.master_weights) {
    if (!opts_.zero) {
      flat_param_.copy_(flat_master_);
    } else {
      for (size_t i = 0; i < buckets_.size(); ++i)
        flat_param_.narrow(0, chunk_begin(buckets_[i]), chunk_size(buckets_[i]))
            .copy_(flat_master_.narrow(0, shard_offset_[i], chunk_size(buckets_[i])));
    }
  }
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

StateBytes DataParallel::held_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? double(t.nbytes()) : 0.0; };
  return {bytes(flat_param_), bytes(flat_grad_) + bytes(shard_grad_), bytes(flat_master_), 0.0};
}

int64_t DataParallel::reduced_bytes_per_step() const {
  if (dp_ < 2) return 0;
  return flat_grad_.numel() * flat_grad_.element_size();
}

}  // namespace nnstrain::parallel
