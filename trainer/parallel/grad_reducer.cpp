#include "trainer/parallel/grad_reducer.h"

#include <torch/torch.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::parallel {

GradientReducer::GradientReducer(TrainingState& state, dist::Runtime* rt)
    : state_(state), rt_(rt), zero_(state.options().zero) {
  if (rt_) dp_ = rt_->dp.size();
  progress_.resize(state_.layout().buckets.size());
  // After a parameter's gradient is accumulated: into its fp32 slot (mixed),
  // and its bucket may be ready for reduction.
  if (dp_ > 1 || state_.grads_via_hook()) {
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

void GradientReducer::begin_micro_step(bool sync) {
  sync_ = sync && dp_ > 1;
  if (!sync_) return;
  const auto& buckets = state_.layout().buckets;
  for (size_t i = 0; i < buckets.size(); ++i) progress_[i] = {static_cast<int>(buckets[i].params.size()), false, {}};
  next_launch_ = 0;
}

void GradientReducer::on_grad_ready(size_t k) {
  if (!sync_) return;
  auto& p = progress_[state_.layout().bucket_of[k]];
  if (--p.pending == 0) {
    p.ready = true;
    launch_ready_in_order();
  }
}

// Every rank launches buckets in the same order, whatever order they got ready in.
void GradientReducer::launch_ready_in_order() {
  while (next_launch_ < progress_.size() && progress_[next_launch_].ready) launch(next_launch_++);
}

void GradientReducer::launch(size_t i) {
  const auto& L = state_.layout();
  const auto& b = L.buckets[i];
  auto in = state_.flat_grad().narrow(0, b.begin, b.end - b.begin);
  if (zero_) {
    auto out = state_.shard_grad().narrow(0, L.shard_offset[i], L.chunk_size(b));
    progress_[i].work = rt_->reduce_scatter_async(rt_->zero, out, in, "gradient reduce-scatter");
  } else {
    progress_[i].work = rt_->all_reduce_async(rt_->dp, in, "gradient all-reduce");
  }
}

void GradientReducer::finish_gradients() {
  const auto& L = state_.layout();
  if (!sync_) {
    if (zero_ && dp_ == 1) {
      // One rank: its chunk is everything.
      for (size_t i = 0; i < L.buckets.size(); ++i)
        state_.shard_grad()
            .narrow(0, L.shard_offset[i], L.chunk_size(L.buckets[i]))
            .copy_(state_.flat_grad().narrow(0, L.buckets[i].begin, L.chunk_size(L.buckets[i])));
    }
    return;
  }
  // Buckets whose parameters got no gradient (unused) still take part.
  for (auto& p : progress_) p.ready = true;
  launch_ready_in_order();
  for (auto& p : progress_) rt_->wait(p.work, zero_ ? rt_->zero : rt_->dp, "gradient reduction");
  if (zero_ && rt_->zero_cross.size() > 1)
    rt_->all_reduce(rt_->zero_cross, state_.shard_grad(), "gradient all-reduce across ZeRO groups");
  state_.reduced_grads().mul_(1.0 / dp_);
  sync_ = false;
}

void GradientReducer::gather_params() {
  if (!zero_ || !rt_ || rt_->zero.size() < 2) return;
  const auto& L = state_.layout();
  auto& flat = state_.flat_param();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;  // kept alive until the gathers finish
  for (const auto& b : L.buckets) {
    inputs.push_back(flat.narrow(0, L.chunk_begin(b), L.chunk_size(b)).clone());
    works.push_back(rt_->all_gather_async(rt_->zero, flat.narrow(0, b.begin, b.end - b.begin), inputs.back(),
                                          "parameter all-gather"));
  }
  for (auto& w : works) rt_->wait(w, rt_->zero, "parameter all-gather");
}

int64_t GradientReducer::reduced_bytes_per_step() const {
  if (dp_ < 2) return 0;
  auto& g = state_.flat_grad();
  return g.numel() * g.element_size();
}

}  // namespace nnstrain::parallel
