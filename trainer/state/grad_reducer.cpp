#include "trainer/state/grad_reducer.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::parallel {

GradientReducer::GradientReducer(TrainingState& state, dist::Runtime* rt, int blocks, int prefetch)
    : state_(state), rt_(rt), stage_(state.options().zero_stage) {
  if (rt_) dp_ = rt_->dp_cp.size();
  progress_.resize(state_.layout().buckets.size());
  for (size_t i = 0; i < progress_.size(); ++i) order_.push_back(i);
  if (stage_ == 3) units_ = std::make_shared<ParameterUnits>(state_, rt_, blocks, prefetch);
  // After a parameter's gradient is accumulated: into its slot (fp32 under
  // mixed, the bucket buffer under stages 2 and 3), and its bucket may be ready.
  if (dp_live() || state_.grads_via_hook()) {
    const auto& params = state_.params();
    for (size_t k = 0; k < params.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(params[k].tensor);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (state_.grads_via_hook()) state_.accumulate_into_slot(k);
            on_grad_ready(k);
            return outputs;
          }));
      accumulators_.push_back(acc);
    }
  }
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::begin_micro_step(bool last) {
  last_ = last;
  if (last) offloaded_in_backward_ = 0;
  in_backward_ = true;
  if (scheduled_) return;  // the executor's begin_backward
  if (stage_ >= 2) {
    drain();  // the previous micro-step's buckets (a no-op on the first)
    reducing_ = true;
  } else {
    reducing_ = last && dp_live();
  }
  const auto& buckets = state_.layout().buckets;
  for (size_t i = 0; i < buckets.size(); ++i)
    progress_[i] = {static_cast<int>(buckets[i].params.size()), false, false, {}, {}};
  next_launch_ = 0;
  if (units_) units_->begin_forward();
}

void GradientReducer::on_grad_ready(size_t k) {
  if (!reducing_) return;
  auto& p = progress_[state_.layout().bucket_of[k]];
  if (--p.pending == 0) {
    p.ready = true;
    launch_ready_in_order();
  }
}

// Every rank launches buckets in the same order, whatever order they got ready in.
void GradientReducer::launch_ready_in_order() {
  while (next_launch_ < order_.size() && progress_[order_[next_launch_]].ready) launch(order_[next_launch_++]);
}

dist::Group& GradientReducer::group_of(size_t bucket) const {
  const auto& b = state_.layout().buckets[bucket];
  if (stage_ > 0) return zero_group_of(b, *rt_);
  return b.expert && rt_->ep.size() > 1 ? rt_->edp : rt_->dp_cp;
}

void GradientReducer::launch(size_t i) {
  const auto& L = state_.layout();
  const auto& b = L.buckets[i];
  auto& p = progress_[i];
  p.launched = true;
  if (stage_ <= 1) {
    auto in = state_.flat_grad().narrow(0, b.begin, b.end - b.begin);
    auto& g = group_of(i);
    if (!g.backend) {  // experts no other rank holds: reduced as they are
      if (stage_ == 1) state_.shard_grad().narrow(0, L.shard_offset[i], L.chunk_size(b)).copy_(in);
      poll_offloaded();
      return;
    }
    sent_bytes_ += in.numel() * in.element_size();
    reduced_dtype_ = in.scalar_type();
    if (stage_ == 1) {
      auto out = state_.shard_grad().narrow(0, L.shard_offset[i], L.chunk_size(b));
      p.work = rt_->reduce_scatter_async(g, out, in, "gradient reduce-scatter");
    } else {
      p.work = rt_->all_reduce_async(g, in, "gradient all-reduce");
    }
    poll_offloaded();
    return;
  }
  // Stages 2 and 3: out of the bucket's own buffer, straight into the shard on
  // a step's first micro-step (the shard is zero), else into a chunk added into
  // it when done (always under a schedule, whose buckets reduce several times a step).
  auto& in = state_.bucket_grad(i);
  const bool add = accumulated_ || scheduled_;
  if (zero_live() && group_of(i).backend) {
    sent_bytes_ += in.numel() * in.element_size();
    reduced_dtype_ = in.scalar_type();
    auto shard = state_.shard_grad().narrow(0, L.shard_offset[i], L.chunk_size(b));
    if (add) p.chunk = torch::empty({L.chunk_size(b)}, in.options());
    p.work = rt_->reduce_scatter_async(group_of(i), add ? p.chunk : shard, in, "gradient reduce-scatter");
  } else {
    p.chunk = in.narrow(0, L.chunk_begin(b) - b.begin, L.chunk_size(b));  // one rank: its chunk is all
  }
  if (units_ && !scheduled_) units_->reduced(i);  // under a schedule the executor frees units
  in_flight_.push_back(i);
  while (in_flight_.size() > kBucketsInFlight) {
    complete(in_flight_.front());
    in_flight_.erase(in_flight_.begin());
  }
}

void GradientReducer::complete(size_t i) {
  const auto& L = state_.layout();
  auto& p = progress_[i];
  if (p.work) rt_->wait(p.work, group_of(i), "gradient reduce-scatter");
  p.work.reset();
  if (p.chunk.defined()) state_.shard_grad().narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i])).add_(p.chunk);
  p.chunk = at::Tensor();
  state_.release_bucket_grad(i);  // reusable now: the current stream is past its collective
  // Final now, unless the shard is still to be all-reduced across ZeRO groups.
  if (last_ && !cross_live()) send_offloaded(i);
}

void GradientReducer::send_offloaded(size_t b) {
  if (b >= state_.host_buckets()) return;
  state_.gradient_final(b);
  if (in_backward_) ++offloaded_in_backward_;
}

void GradientReducer::drain() {
  if (!reducing_) return;
  torch::NoGradGuard no_grad;
  // Buckets whose parameters got no gradient (unused) still take part.
  for (auto& p : progress_) p.ready = true;
  launch_ready_in_order();
  if (stage_ >= 2) {
    complete_in_flight();
    accumulated_ = true;
  } else {
    for (size_t i = 0; i < progress_.size(); ++i)
      if (progress_[i].work) rt_->wait(progress_[i].work, group_of(i), "gradient reduction");
  }
  reducing_ = false;
}

void GradientReducer::finish_gradients() {
  in_backward_ = false;
  const auto& L = state_.layout();
  if (stage_ <= 1 && !reducing_) {
    if (stage_ == 1 && dp_ == 1) {
      // One rank: its chunk is everything.
      for (size_t i = 0; i < L.buckets.size(); ++i)
        state_.shard_grad()
            .narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i]))
            .copy_(state_.flat_grad().narrow(0, L.buckets[i].begin, L.chunk_size(L.buckets[i])));
    }
    hand_over_offloaded();
    return;
  }
  if (scheduled_) complete_reductions();
  else drain();
  accumulated_ = false;
  state_.drop_bucket_buffers();
  if (units_) units_->release_all();
  if (stage_ >= 1 && cross_live()) {
    sent_bytes_ += state_.shard_grad().numel() * state_.shard_grad().element_size();
    reduced_dtype_ = state_.shard_grad().scalar_type();
    rt_->all_reduce(rt_->zero_cross, state_.shard_grad(), "gradient all-reduce across ZeRO groups");
  }
  hand_over_offloaded();
}

// Stages 0 and 1: an offloaded bucket whose reduction has completed leaves for
// the host now, while backward goes on (a completed work's wait only orders
// the current stream after it). Not under HSDP: its cross-group all-reduce comes later.
void GradientReducer::poll_offloaded() {
  if (cross_live()) return;
  const size_t n = std::min(next_launch_, state_.host_buckets());
  for (size_t j = 0; j < n; ++j) {
    auto& p = progress_[j];
    if (state_.gradient_sent(j) || !p.work || !p.work->isCompleted()) continue;
    rt_->wait(p.work, group_of(j), "gradient reduction");
    send_offloaded(j);
  }
}

void GradientReducer::hand_over_offloaded() {
  // Offloaded buckets not yet on their way leave now.
  for (size_t b = 0; b < state_.host_buckets(); ++b)
    if (!state_.gradient_sent(b)) send_offloaded(b);
  if (state_.host_buckets() > 0) state_.wait_host_grads();
}

void GradientReducer::gather_params() {
  if (stage_ == 0 || stage_ == 3 || !zero_live()) return;
  const auto& L = state_.layout();
  auto& flat = state_.flat_param();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;  // kept alive until the gathers finish
  std::vector<size_t> gathered;
  for (size_t i = 0; i < L.buckets.size(); ++i) {
    const auto& b = L.buckets[i];
    auto& g = group_of(i);
    if (!g.backend) continue;  // experts no other rank holds: whole here
    inputs.push_back(flat.narrow(0, L.chunk_begin(b), L.chunk_size(b)).clone());
    sent_bytes_ += (b.end - b.begin) * flat.element_size();
    works.push_back(rt_->all_gather_async(g, flat.narrow(0, b.begin, b.end - b.begin), inputs.back(),
                                          "parameter all-gather"));
    gathered.push_back(i);
  }
  for (size_t w = 0; w < works.size(); ++w) rt_->wait(works[w], group_of(gathered[w]), "parameter all-gather");
}

void GradientReducer::begin_forward() {
  if (units_ && !scheduled_) units_->begin_forward();
}

void GradientReducer::complete_in_flight() {
  for (auto i : in_flight_) complete(i);
  in_flight_.clear();
}

void GradientReducer::follow_schedule() {
  TORCH_CHECK(stage_ >= 2, "GradientReducer: only ZeRO 2 and 3 follow a pipeline schedule");
  scheduled_ = true;
}

void GradientReducer::begin_backward(const std::vector<size_t>& buckets) {
  complete_in_flight();
  const auto& L = state_.layout();
  // Buckets outside this backward never count down to ready (a tied
  // parameter's other stage may still add into their buffers: they reduce
  // with their own stage's next backward).
  for (auto& p : progress_) p = {std::numeric_limits<int>::max(), false, false, {}, {}};
  for (auto i : buckets) progress_[i].pending = static_cast<int>(L.buckets[i].params.size());
  order_ = buckets;
  next_launch_ = 0;
  reducing_ = true;
}

void GradientReducer::end_backward() {
  torch::NoGradGuard no_grad;
  for (auto i : order_) progress_[i].ready = true;  // a parameter no gradient reached still takes part
  launch_ready_in_order();
  reducing_ = false;
}

void GradientReducer::complete_reductions() {
  torch::NoGradGuard no_grad;
  complete_in_flight();
}

void GradientReducer::gather_buckets(const std::vector<size_t>& buckets, bool wait) {
  if (!units_) return;
  for (auto b : buckets) units_->gather_bucket(b, false);  // all issued, then waited for in order
  if (wait)
    for (auto b : buckets) units_->gather_bucket(b, true);
}

void GradientReducer::free_buckets(const std::vector<size_t>& buckets) {
  if (!units_) return;
  for (auto b : buckets) units_->free_bucket(b);
}

void GradientReducer::release_params() {
  if (units_) units_->release_all();
}

int64_t GradientReducer::reduced_bytes_per_step() const {
  if (!(stage_ == 0 ? dp_live() : zero_live())) return 0;
  int64_t n = 0;
  for (const auto& b : state_.layout().buckets) n += b.end - b.begin;
  return n * static_cast<int64_t>(c10::elementSize(state_.options().grad_dtype));
}

int64_t GradientReducer::communicated_bytes() const {
  return sent_bytes_ + (units_ && zero_live() ? units_->gathered_bytes() : 0);
}

}  // namespace nnstrain::parallel
