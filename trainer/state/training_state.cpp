#include "trainer/state/training_state.h"

#include <torch/torch.h>

#include <limits>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/offload/nvme_tier.h"
#include "trainer/offload/offload.h"

namespace nnstrain::parallel {

namespace {
std::string st_dtype(c10::ScalarType t) { return checkpoint::dtype_name(checkpoint::to_dtype(t)); }

// A ZeRO-3 unit's storage comes and goes under the tensors that view it (the
// parameters, and what autograd saved of them), so they see it again when it
// is gathered again.
void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  const auto& s = t.storage();
  if (s.nbytes() == nbytes) return;
  s.set_data_ptr_noswap(nbytes ? s.allocator()->allocate(nbytes) : at::DataPtr(nullptr, t.device()));
  s.set_nbytes(nbytes);
}
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

FlatLayout FlatLayout::make(const std::vector<int64_t>& numels, int64_t cap, int zsize, int zrank,
                            const std::vector<int>& units, const std::vector<bool>& expert, int ezsize, int ezrank) {
  FlatLayout l;
  l.zsize = zsize;
  l.zrank = zrank;
  l.offset.assign(numels.size(), 0);
  l.bucket_of.assign(numels.size(), 0);
  auto is_expert = [&](size_t k) { return !expert.empty() && expert[k]; };
  // Every parameter and bucket starts, and every ZeRO chunk is cut, at a
  // multiple of 16 elements: 16-byte aligned views in every dtype (1-byte ones
  // too). CUDA kernels that load 16 bytes at a time (at::_grouped_mm checks it)
  // take the parameters as they lie in the flat buffers.
  constexpr int64_t kAlign = 16;
  auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  int64_t pos = 0;
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    cur.expert = is_expert(cur.params.front());
    cur.zsize = cur.expert ? ezsize : zsize;
    cur.zrank = cur.expert ? ezrank : zrank;
    pos = cur.begin + up(pos - cur.begin, kAlign * cur.zsize);  // chunks of whole 16-element runs
    cur.end = pos;
    l.buckets.push_back(cur);
    cur = Bucket{};
    cur.begin = pos;
  };
  for (size_t k = numels.size(); k-- > 0;) {
    if (!cur.params.empty() &&
        (pos - cur.begin + numels[k] > cap || (!units.empty() && units[k] != units[cur.params.back()]) ||
         is_expert(k) != is_expert(cur.params.back())))
      close();
    l.offset[k] = pos;
    l.bucket_of[k] = l.buckets.size();
    cur.params.push_back(k);
    pos += up(numels[k], kAlign);
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
  TORCH_CHECK(opts_.zero_stage >= 0 && opts_.zero_stage <= 3, "TrainingState: ZeRO stage ", opts_.zero_stage);
  const auto init_dtype = params_.front().tensor.scalar_type();
  for (const auto& p : params_)
    TORCH_CHECK(p.tensor.scalar_type() == init_dtype, "TrainingState: parameters of mixed dtypes (", p.name, ")");
  const int stage = opts_.zero_stage;
  // Stages 2 and 3 have no whole gradient buffer for autograd to accumulate into.
  grads_via_hook_ = opts_.grad_dtype != opts_.param_dtype || stage >= 2;

  std::vector<int64_t> numels;
  for (const auto& p : params_) numels.push_back(p.tensor.numel());
  // Expert parameters get buckets of their own (the layout's, from the shards).
  std::vector<bool> expert;
  for (const auto& p : params_) expert.push_back(p.expert);
  if (std::find(expert.begin(), expert.end(), true) == expert.end()) expert.clear();
  TORCH_CHECK(opts_.expert.empty() || opts_.expert == expert, "TrainingState: options name other expert parameters");
  opts_.expert = expert;
  const auto& units = opts_.units;
  TORCH_CHECK(stage < 3 || units.size() == params_.size(), "TrainingState: ZeRO-3 needs every parameter's unit");
  layout_ = layout_for(numels, opts_);
  const auto& L = layout_;
  {
    // ZeRO-2's pooled bucket buffers: every bucket within the cap fits one class,
    // the largest such bucket (not the cap itself: a model whose gradients are
    // smaller than one cap would pool 25 MiB buffers by default for a 1 MiB model).
    const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opts_.bucket_cap_mb * 1048576.0) /
                                                 static_cast<int64_t>(c10::elementSize(opts_.grad_dtype)));
    int64_t largest = 0;
    for (const auto& bk : L.buckets)
      if (bk.end - bk.begin <= cap) largest = std::max(largest, bk.end - bk.begin);
    pooled_class_ = (std::min(cap, largest) + L.zsize - 1) / L.zsize * L.zsize;
  }
  if (stage == 3) {
    for (size_t b = 0; b < L.buckets.size(); ++b) {
      const int u = units[L.buckets[b].params.front()];
      if (u >= static_cast<int>(unit_buckets_.size())) unit_buckets_.resize(u + 1);
      auto& mine = unit_buckets_[u];
      TORCH_CHECK(mine.empty() || mine.back() + 1 == b, "TrainingState: the parameters of ZeRO-3 unit ", u,
                  " are not consecutive");
      mine.push_back(b);
    }
  }

  // The initial values, as built (fp32), in the flat layout: the masters start
  // from them exactly, the compute copy is their cast. Streamed (ZeRO-3): only
  // this rank's chunks of them exist.
  const auto opt = params_.front().tensor.options();
  torch::NoGradGuard no_grad;
  const bool streamed = stage == 3 && opts_.initial_chunks.defined();
  at::Tensor init;
  if (!streamed) {
    init = torch::zeros({L.size}, opt);
    for (size_t k = 0; k < params_.size(); ++k)
      init.narrow(0, L.offset[k], numels[k]).copy_(params_[k].tensor.reshape({-1}));
  } else {
    TORCH_CHECK(opts_.initial_chunks.numel() == L.shard_size, "TrainingState: streamed chunks of the wrong size");
  }
  // This rank's chunks of the flat layout, bucket after bucket (ZeRO).
  auto chunks_of = [&](const at::Tensor& flat, c10::ScalarType dtype) {
    auto out = torch::empty({L.shard_size}, opt.dtype(dtype));
    for (size_t i = 0; i < L.buckets.size(); ++i)
      out.narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i]))
          .copy_(flat.narrow(0, L.chunk_begin(L.buckets[i]), L.chunk_size(L.buckets[i])));
    return out;
  };
  if (opts_.zero()) shard_grad_ = torch::zeros({L.shard_size}, opt.dtype(opts_.grad_dtype));
  // Offload: the first buckets in layout order (those backward finishes
  // first, so their copies have the longest to overlap), whole, until the
  // ratio's share of the optimizer's elements is reached.
  TORCH_CHECK(!opts_.offload_params || (stage == 3 && opts_.offload_ratio >= 1.0),
              "TrainingState: parameter offload needs ZeRO-3 and the whole optimizer offloaded");
  const int64_t opt_total = optimizer_elements();
  if (opts_.offload_ratio > 0) {
    while (host_buckets_ < L.buckets.size() && double(host_size_) < opts_.offload_ratio * double(opt_total))
      host_size_ += opt_len(host_buckets_++);
  }
  const bool pinned = params_.front().tensor.is_cuda();
  // The initial values in the optimizer's coordinates, fp32.
  at::Tensor opt_init;
  if (opts_.master_weights || host_size_ > 0)
    opt_init = streamed ? opts_.initial_chunks : opts_.zero() ? chunks_of(init, torch::kFloat32) : init.to(torch::kFloat32);
  if (host_size_ > 0) {
    const auto wdtype = opts_.master_weights ? torch::kFloat32 : opts_.param_dtype;
    if (!opts_.nvme_path.empty()) {
      // The NVMe tier: weights and moments in files, a bucket per chunk, through a ring of slots.
      std::vector<int64_t> lens;
      for (size_t b = 0; b < host_buckets_; ++b) lens.push_back(opt_len(b));
      nvme_ = std::make_unique<NvmeTier>(NvmeTierOptions{opts_.nvme_path, opts_.nvme_io, opts_.nvme_rank,
                                                         opts_.nvme_buffer_bytes, opts_.nvme_params},
                                         lens, wdtype, opts_.param_dtype);
      for (size_t b = 0; b < host_buckets_; ++b) nvme_->fill(b, opt_init.narrow(0, opt_begin(b), opt_len(b)));
      nvme_->finish();
    } else {
      host_weights_ = host_zeros(host_size_, wdtype, pinned);
      host_weights_.copy_(opt_init.narrow(0, 0, host_size_));
      host_moments_ = host_zeros(host_size_ + host_second_moments(), wdtype, pinned);
      host_stage_ = host_zeros(host_size_, opts_.param_dtype, pinned);  // what leaves for the device, compute dtype
    }
    host_grad_ = host_zeros(host_size_, opts_.grad_dtype, pinned);
    host_landing_ = opts_.offload_delayed ? host_zeros(host_size_, opts_.grad_dtype, pinned) : host_grad_;
    copier_ = std::make_unique<HostCopier>(params_.front().tensor.device(), host_buckets_);
    sent_.assign(host_buckets_, false);
  }
  if (opts_.master_weights) {
    TORCH_CHECK(init_dtype == torch::kFloat32, "TrainingState: master weights need fp32 initial parameters");
    // Offloaded: only what steps on the device stays there.
    flat_master_ = host_size_ == 0 ? opt_init : opt_init.narrow(0, host_size_, opt_total - host_size_).clone();
  }
  opt_init = at::Tensor();
  if (stage == 3) {
    shard_param_ = streamed ? opts_.initial_chunks.to(opts_.param_dtype) : chunks_of(init, opts_.param_dtype);
    if (opts_.offload_params && opts_.nvme_params) {
      for (size_t b = 0; b < L.buckets.size(); ++b)
        nvme_->fill_param(b, shard_param_.narrow(0, L.shard_offset[b], L.chunk_size(L.buckets[b])));
      nvme_->finish();
      shard_param_ = at::Tensor();  // in the file only
    } else if (opts_.offload_params) {
      auto host = host_zeros(L.shard_size, opts_.param_dtype, pinned);
      host.copy_(shard_param_);
      shard_param_ = host;
    }
    for (const auto& b : L.buckets) unit_param_.push_back(torch::empty({b.end - b.begin}, opt.dtype(opts_.param_dtype)));
  } else {
    flat_param_ = init.to(opts_.param_dtype);
  }
  if (stage < 2) flat_grad_ = torch::zeros({L.size}, opt.dtype(opts_.grad_dtype));
  bucket_grad_.resize(L.buckets.size());
  init = at::Tensor();
  // Parameters become views of the flat buffer (stage 3: of their unit's); their
  // gradients too where the dtypes agree and a whole gradient buffer exists.
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& t = params_[k].tensor;
    const auto b = L.bucket_of[k];
    t.set_data(stage == 3 ? unit_param_[b].narrow(0, L.offset[k] - L.buckets[b].begin, t.numel()).view(t.sizes())
                          : flat_param_.narrow(0, L.offset[k], t.numel()).view(t.sizes()));
    if (stage < 2) {
      grad_views_.push_back(flat_grad_.narrow(0, L.offset[k], t.numel()).view(t.sizes()));
      if (!grads_via_hook_) t.mutable_grad() = grad_views_.back();
    }
    params_[k].spec.dtype = st_dtype(opts_.param_dtype);
  }
  for (size_t b = 0; b < unit_param_.size(); ++b) free_unit(b);  // gathered when a forward needs them

  segments_ = make_segments(&segment_bucket_);
  bucket_segments_.assign(L.buckets.size(), {});
  for (size_t i = 0; i < segments_.size(); ++i) bucket_segments_[segment_bucket_[i]].push_back(i);
  std::vector<double> w;
  for (const auto& s : segments_) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    w.push_back(p.norm_weight);
  }
  // Built once: no host-to-device copy inside a step.
  norm_weights_ = torch::tensor(w, torch::kFloat64).to(opt.dtype(torch::kFloat32));
  opts_.initial_chunks = at::Tensor();  // what still needs them holds them (offloaded: nothing on the device)
  if (nvme_) nvme_->take_counters();    // the steps' I/O is counted from here (the files' first fill is not a step's)
}

void TrainingState::accumulate_into_slot(size_t k) {
  auto& g = params_[k].tensor.mutable_grad();
  if (!g.defined()) return;
  if (opts_.zero_stage >= 2) {
    const auto b = layout_.bucket_of[k];
    bucket_grad(b).narrow(0, layout_.offset[k] - layout_.buckets[b].begin, g.numel()).add_(g.reshape({-1}));
  } else {
    grad_views_[k].add_(g);
  }
  g.reset();
}

FlatLayout TrainingState::layout_for(const std::vector<int64_t>& numels, const TrainingStateOptions& opts) {
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opts.bucket_cap_mb * 1048576.0) /
                                               static_cast<int64_t>(c10::elementSize(opts.grad_dtype)));
  const std::vector<int> no_units;
  // ZeRO-3: a bucket per unit, whatever the cap; ZeRO-2 (under pp): capped
  // buckets that never hold two units.
  return FlatLayout::make(numels, opts.zero_stage == 3 ? std::numeric_limits<int64_t>::max() : cap,
                          opts.zero() ? opts.zero_size : 1, opts.zero() ? opts.zero_rank : 0,
                          opts.zero_stage >= 2 ? opts.units : no_units, opts.expert,
                          opts.zero() ? opts.expert_zero_size : 1, opts.zero() ? opts.expert_zero_rank : 0);
}

void TrainingState::move_into_chunks(const FlatLayout& L, size_t k, at::Tensor& value, at::Tensor& chunks) {
  torch::NoGradGuard no_grad;
  const auto b = L.bucket_of[k];
  const auto& bk = L.buckets[b];
  const int64_t c0 = L.chunk_begin(bk), c1 = c0 + L.chunk_size(bk);
  const int64_t p0 = L.offset[k], p1 = p0 + value.numel();
  const int64_t lo = std::max(c0, p0), hi = std::min(c1, p1);
  if (lo < hi)
    chunks.narrow(0, L.shard_offset[b] + (lo - c0), hi - lo).copy_(value.reshape({-1}).narrow(0, lo - p0, hi - lo));
  set_storage_bytes(value, 0);
}

int64_t TrainingState::bucket_class(size_t b) const {
  const auto& bk = layout_.buckets[b];
  const int64_t n = bk.end - bk.begin;
  if (opts_.zero_stage == 3) return n;  // units: identical blocks share a size
  return std::max(n, pooled_class_);
}

at::Tensor& TrainingState::bucket_grad(size_t b) {
  auto& g = bucket_grad_[b];
  if (!g.defined()) {
    if (bucket_base_.size() != bucket_grad_.size()) bucket_base_.resize(bucket_grad_.size());
    const auto& bk = layout_.buckets[b];
    const int64_t cls = bucket_class(b);
    auto& free = free_buffers_[cls];
    if (free.empty()) {
      bucket_base_[b] = torch::empty({cls}, shard_grad_.options());
    } else {
      bucket_base_[b] = std::move(free.back());
      free.pop_back();
    }
    g = bucket_base_[b].narrow(0, 0, bk.end - bk.begin).zero_();
  }
  return g;
}

void TrainingState::release_bucket_grad(size_t b) {
  if (!bucket_grad_[b].defined()) return;
  bucket_grad_[b] = at::Tensor();
  free_buffers_[bucket_class(b)].push_back(std::move(bucket_base_[b]));
}

void TrainingState::allocate_unit(size_t b) {
  const auto& t = unit_param_[b];
  set_storage_bytes(t, t.numel() * t.element_size());
}

void TrainingState::free_unit(size_t b) { set_storage_bytes(unit_param_[b], 0); }

bool TrainingState::unit_allocated(size_t b) const { return unit_param_[b].storage().nbytes() > 0; }

at::Tensor TrainingState::shard_chunk(size_t b) const {
  return shard_param_.narrow(0, layout_.shard_offset[b], layout_.chunk_size(layout_.buckets[b]));
}

void TrainingState::zero_grad() {
  if (flat_grad_.defined()) flat_grad_.zero_();
  if (shard_grad_.defined()) shard_grad_.zero_();
  if (grads_via_hook_)
    for (auto& p : params_) p.tensor.mutable_grad().reset();
}

void TrainingState::scale_gradients(const at::Tensor& coef) {
  device_reduced_grads().mul_(coef.to(reduced_grads().scalar_type()));
  if (host_size_ > 0) host_grad_.mul_(coef.to(host_grad_.device(), host_grad_.scalar_type()));
}

std::vector<optim::Segment> TrainingState::make_segments(std::vector<size_t>* bucket_of_segment) const {
  std::vector<optim::Segment> segs;
  const auto& L = layout_;
  auto wd = [&](size_t k) { return optim::weight_decay_for(params_[k].tensor, opts_.weight_decay); };
  // An offloaded segment (at pos < host_size_ in the optimizer's coordinates)
  // updates host weights from a host gradient, its moments on the host too.
  // NVMe tier: the views lie in bucket b's slot, at the same place within the bucket.
  // Host tier: second moments packed after the first, in segment order, for
  // the parameters whose optimizer keeps two (host_second_moments()).
  int64_t second = host_size_;
  auto host_segment = [&](optim::Segment& sg, size_t k, size_t b, int64_t pos, int64_t n, at::IntArrayRef shape) {
    sg.grad = host_grad_.narrow(0, pos, n).view(shape);
    if (nvme_) {
      const int64_t at = pos - opt_begin(b);
      sg.param = nvme_->weights(b).narrow(0, at, n).view(shape);
      sg.exp_avg = nvme_->exp_avg(b).narrow(0, at, n).view(shape);
      sg.exp_avg_sq = nvme_->exp_avg_sq(b).narrow(0, at, n).view(shape);
      return;
    }
    sg.param = host_weights_.narrow(0, pos, n).view(shape);
    sg.exp_avg = host_moments_.narrow(0, pos, n).view(shape);
    if (opts_.one_state.count(params_[k].name)) return;
    sg.exp_avg_sq = host_moments_.narrow(0, second, n).view(shape);
    second += n;
  };
  // Every packed second moment has its segment (host_second_moments() counted the same pieces).
  auto all_placed = [&] {
    TORCH_CHECK(!host_moments_.defined() || second == host_moments_.numel(), "TrainingState: host second moments for ",
                host_moments_.numel() - host_size_, " elements, the segments hold ", second - host_size_);
  };
  if (!opts_.zero()) {
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto& t = params_[k].tensor;
      const int64_t pos = L.offset[k];
      optim::Segment sg{params_[k].name, at::Tensor(), grad_views_[k], wd(k), 0};
      if (pos < host_size_) host_segment(sg, k, L.bucket_of[k], pos, t.numel(), t.sizes());
      else sg.param = opts_.master_weights ? flat_master_.narrow(0, pos - host_size_, t.numel()).view(t.sizes()) : t;
      segs.push_back(sg);
      bucket_of_segment->push_back(L.bucket_of[k]);
    }
    all_placed();
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
      optim::Segment sg{params_[k].name, at::Tensor(), shard_grad_.narrow(0, in_shard, hi - lo), wd(k), lo - p0};
      if (in_shard < host_size_) {
        host_segment(sg, k, bi, in_shard, hi - lo, {hi - lo});
      } else {
        sg.param = opts_.master_weights    ? flat_master_.narrow(0, in_shard - host_size_, hi - lo)
                   : opts_.zero_stage == 3 ? shard_param_.narrow(0, in_shard, hi - lo)
                                           : flat_param_.narrow(0, lo, hi - lo);
      }
      segs.push_back(sg);
      bucket_of_segment->push_back(bi);
    }
  }
  all_placed();
  return segs;
}

std::vector<sharding::ShardSpec> TrainingState::segment_specs(const std::string& prefix) const {
  std::vector<sharding::ShardSpec> specs;
  for (const auto& s : segments_) {
    const auto& p = *std::find_if(params_.begin(), params_.end(), [&](const ParamShard& x) { return x.name == s.name; });
    auto spec = p.spec;
    spec.name = prefix + s.name;
    spec.dtype = st_dtype(s.param.scalar_type());
    if (opts_.zero()) {
      spec.flat_begin = s.offset;
      spec.flat_end = s.offset + s.param.numel();
      spec.replica_ranks = p.expert ? opts_.expert_zero_replicas : opts_.zero_replicas;
      std::sort(spec.replica_ranks.begin(), spec.replica_ranks.end());
    }
    specs.push_back(spec);
  }
  return specs;
}

std::vector<sharding::StateTensor> TrainingState::weight_state() const {
  std::vector<sharding::StateTensor> out;
  if (!opts_.master_weights && opts_.zero_stage < 3) {
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
  if (offloaded()) {
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      nvme_acquire(b);
      refresh_bucket(b);
      nvme_release(b, false);
    }
    finish_refresh();
    nvme_finish();
    return;
  }
  if (!opts_.master_weights) return;
  if (!opts_.zero()) {
    flat_param_.copy_(flat_master_);
    return;
  }
  if (opts_.zero_stage == 3) {  // the rest is gathered when a forward needs it
    shard_param_.copy_(flat_master_);
    return;
  }
  const auto& L = layout_;
  for (size_t i = 0; i < L.buckets.size(); ++i)
    flat_param_.narrow(0, L.chunk_begin(L.buckets[i]), L.chunk_size(L.buckets[i]))
        .copy_(flat_master_.narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i])));
}

int64_t TrainingState::opt_begin(size_t b) const {
  return opts_.zero() ? layout_.shard_offset[b] : layout_.buckets[b].begin;
}

int64_t TrainingState::opt_len(size_t b) const {
  const auto& bk = layout_.buckets[b];
  return opts_.zero() ? layout_.chunk_size(bk) : bk.end - bk.begin;
}

int64_t TrainingState::host_second_moments() const {
  const auto& L = layout_;
  int64_t n = 0;
  for (size_t b = 0; b < host_buckets_; ++b) {  // the host buckets' pieces (a segment each), as make_segments cuts them
    const auto& bk = L.buckets[b];
    const int64_t c0 = opts_.zero() ? L.chunk_begin(bk) : bk.begin, c1 = c0 + opt_len(b);
    for (auto k : bk.params) {
      if (opts_.one_state.count(params_[k].name)) continue;
      const int64_t p0 = L.offset[k], p1 = p0 + params_[k].tensor.numel();
      n += std::max<int64_t>(0, std::min(c1, p1) - std::max(c0, p0));
    }
  }
  return n;
}

std::vector<size_t> TrainingState::device_segments() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < segments_.size(); ++i)
    if (!segment_on_host(i)) out.push_back(i);
  return out;
}

bool TrainingState::segment_on_host(size_t i) const { return segment_bucket_[i] < host_buckets_; }

void TrainingState::gradient_final(size_t b) {
  if (b >= host_buckets_) return;
  const int64_t o = opt_begin(b), n = opt_len(b);
  copier_->to_host(b, host_landing_.narrow(0, o, n), reduced_grads().narrow(0, o, n));
  sent_[b] = true;
}

void TrainingState::wait_host_grads() {
  for (size_t b = 0; b < host_buckets_; ++b) {
    TORCH_CHECK(sent_[b], "TrainingState: offloaded bucket ", b, "'s gradient never left for the host");
    copier_->wait_to_host(b);
    sent_[b] = false;
  }
}

void TrainingState::promote_host_grads() {
  if (host_landing_.defined() && !host_landing_.is_same(host_grad_)) host_grad_.copy_(host_landing_);
}

at::Tensor TrainingState::device_reduced_grads() {
  auto& g = reduced_grads();
  return host_size_ == 0 ? g : g.narrow(0, host_size_, g.numel() - host_size_);
}

void TrainingState::refresh_bucket(size_t b) {
  torch::NoGradGuard no_grad;
  const auto& L = layout_;
  const auto& bk = L.buckets[b];
  const int64_t o = opt_begin(b), n = opt_len(b);
  if (nvme_ && b < host_buckets_) {
    copier_->host_wait_to_device();  // the slot's stage may still be leaving for the device (CUDA)
    auto stage = nvme_->stage(b);
    stage.copy_(nvme_->weights(b));
    // Parameters on NVMe: nvme_release writes the stage to their file; else it goes to the device.
    if (!opts_.nvme_params) {
      const auto target = opts_.zero_stage == 3 ? shard_param_.narrow(0, L.shard_offset[b], n)
                          : opts_.zero()        ? flat_param_.narrow(0, L.chunk_begin(bk), n)
                                                : flat_param_.narrow(0, bk.begin, n);
      if (opts_.offload_params) target.copy_(stage);
      else copier_->to_device(target, stage);
    }
    return;
  }
  const auto target = opts_.zero_stage == 3 ? shard_param_.narrow(0, L.shard_offset[b], n)
                      : opts_.zero()        ? flat_param_.narrow(0, L.chunk_begin(bk), n)
                                            : flat_param_.narrow(0, bk.begin, n);
  if (b < host_buckets_) {
    // Cast on the host, so what crosses to the device is the compute dtype.
    auto stage = host_stage_.narrow(0, o, n);
    stage.copy_(host_weights_.narrow(0, o, n));
    if (opts_.offload_params) target.copy_(stage);  // ZeRO-3's chunks live on the host too
    else copier_->to_device(target, stage);
  } else if (opts_.master_weights) {
    target.copy_(flat_master_.narrow(0, o - host_size_, n));
  }
}

void TrainingState::finish_refresh() {
  if (copier_) copier_->device_wait();
}

void TrainingState::pull_host_weights() {
  if (host_size_ == 0 || opts_.master_weights || opts_.zero_stage == 3) return;
  torch::NoGradGuard no_grad;
  const auto& L = layout_;
  for (size_t b = 0; b < host_buckets_; ++b) {
    const auto& bk = L.buckets[b];
    const int64_t o = opt_begin(b), n = opt_len(b);
    nvme_acquire(b);
    (nvme_ ? nvme_->weights(b) : host_weights_.narrow(0, o, n))
        .copy_(opts_.zero() ? flat_param_.narrow(0, L.chunk_begin(bk), n) : flat_param_.narrow(0, bk.begin, n));
    nvme_release(b, true);
  }
  nvme_finish();
}

void TrainingState::nvme_acquire(size_t b) {
  if (nvme_ && b < host_buckets_) nvme_->acquire(b);
}

void TrainingState::nvme_release(size_t b, bool dirty) {
  if (nvme_ && b < host_buckets_) nvme_->release(b, dirty, opts_.nvme_params);
}

void TrainingState::nvme_finish() {
  if (nvme_) nvme_->finish();
}

at::Tensor TrainingState::gather_input(size_t b) const {
  if (!opts_.offload_params) return shard_chunk(b);
  // Parameters on NVMe: read from the file (ahead, where the order is known).
  const auto chunk = opts_.nvme_params ? nvme_->param_chunk(b) : shard_chunk(b);
  // A device copy of the host chunk, for the collective (and counted as the device's while it lives).
  auto dev = torch::empty({chunk.numel()}, unit_param_[b].options());
  copier_->to_device(dev, chunk);
  copier_->device_wait();
  if (nvme_) copier_->host_wait_to_device();  // the read-ahead buffer is reused two gathers on
  return dev;
}

StateBytes TrainingState::held_bytes() const {
  // Storage bytes: a freed ZeRO-3 unit counts nothing; host buffers are host_held_bytes'.
  auto bytes = [](const at::Tensor& t) { return t.defined() ? double(t.storage().nbytes()) : 0.0; };
  const double shard = opts_.offload_params ? 0.0 : bytes(shard_param_);
  StateBytes b{bytes(flat_param_) + shard, bytes(flat_grad_) + bytes(shard_grad_), bytes(flat_master_), 0.0};
  for (const auto& u : unit_param_) b.param += bytes(u);
  for (const auto& g : bucket_grad_) b.grad += bytes(g);
  for (const auto& [cls, v] : free_buffers_)
    for (const auto& t : v) b.grad += bytes(t);
  return b;
}

StateBytes TrainingState::host_held_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? double(t.storage().nbytes()) : 0.0; };
  const double landing = opts_.offload_delayed ? bytes(host_landing_) : 0.0;
  // The NVMe tier's ring of slots counts as staging (weights and moments live in its files).
  return {bytes(host_stage_) + (opts_.offload_params ? bytes(shard_param_) : 0.0) + (nvme_ ? double(nvme_->slot_bytes()) : 0.0),
          bytes(host_grad_) + landing,
          bytes(host_weights_), bytes(host_moments_)};
}

TrainingState::~TrainingState() = default;

}  // namespace nnstrain::parallel
