#include "trainer/optim/adamw.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

namespace nnstrain::optim {

double weight_decay_for(const at::Tensor& param, double weight_decay) {
  return param.dim() >= 2 ? weight_decay : 0.0;
}


AdamW::AdamW(std::vector<Segment> segments, const config::OptimizerArgs& args)
    : segments_(std::move(segments)), args_(args) {
  for (auto& s : segments_) {
    // Buffers given for its state (offload's host moments) come in pairs.
    TORCH_CHECK(s.exp_avg.defined() == s.exp_avg_sq.defined(), "AdamW: ", s.name,
                " was given one of its two moment buffers");
    exp_avg_.push_back(s.exp_avg.defined() ? s.exp_avg : torch::zeros_like(s.param, at::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(s.exp_avg_sq.defined() ? s.exp_avg_sq
                                                 : torch::zeros_like(s.param, at::MemoryFormat::Contiguous));
    state_steps_.push_back(torch::zeros({}, s.param.options().dtype(torch::kFloat32)));
  }
  impl_ = args.impl;
  if (impl_ == "auto") {
    // The fused kernel wants floating params on CPU or CUDA: our case.
    impl_ = "fused";
  }
}

void AdamW::set_step_count(int64_t s) {
  step_ = s;
  for (auto& t : state_steps_) t.fill_(static_cast<double>(s));
}

void AdamW::back_up(Backup& into) const {
  std::vector<at::Tensor> live;
  for (const auto& s : segments_) live.push_back(s.param);
  for (const auto* v : {&exp_avg_, &exp_avg_sq_, &state_steps_}) live.insert(live.end(), v->begin(), v->end());
  save_tensors(live, into.tensors);
  into.step = step_;
}

void AdamW::restore(const Backup& from) {
  std::vector<at::Tensor> live;
  for (const auto& s : segments_) live.push_back(s.param);
  for (const auto* v : {&exp_avg_, &exp_avg_sq_, &state_steps_}) live.insert(live.end(), v->begin(), v->end());
  load_tensors(from.tensors, live);
  step_ = from.step;
}

int64_t AdamW::step_count() const {
  return state_steps_.empty() ? step_ : static_cast<int64_t>(state_steps_.front().item<double>());
}

void AdamW::step(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device,
                 const std::vector<size_t>& subset) {
  std::vector<size_t> all;
  if (subset.empty()) {
    for (size_t i = 0; i < segments_.size(); ++i) all.push_back(i);
  }
  const auto& idx = subset.empty() ? all : subset;
  if (idx.empty()) return;
  torch::NoGradGuard no_grad;
  if (impl_ == "fused") {
    ++step_;
    step_fused(lr, found_inf, lr_device, idx);
    return;
  }
  TORCH_CHECK(!lr_device.defined(), "AdamW: a device learning rate needs the fused implementation");
  // The reference implementations skip on the host, as torch.optim does without a fused kernel.
  if (found_inf.defined() && found_inf.item<double>() != 0) return;
  // The count of these segments (a subset stepped before the rest may be ahead of segment 0).
  step_ = static_cast<int64_t>(state_steps_[idx.front()].item<double>()) + 1;
  if (impl_ == "foreach") step_foreach(lr, idx);
  else step_loop(lr, idx);
}

// The reference: torch.optim.AdamW's single-tensor algorithm, spelled out.
void AdamW::step_loop(double lr, const std::vector<size_t>& idx) {
  const double b1 = args_.beta1, b2 = args_.beta2;
  const double bc1 = 1 - std::pow(b1, step_), bc2 = 1 - std::pow(b2, step_);
  for (size_t i : idx) {
    auto& p = segments_[i].param;
    const auto g = grad_as_param(segments_[i]);
    state_steps_[i].add_(1);
    p.mul_(1 - lr * segments_[i].weight_decay);
    exp_avg_[i].lerp_(g, 1 - b1);
    exp_avg_sq_[i].mul_(b2).addcmul_(g, g, 1 - b2);
    auto denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bc2)).add_(args_.eps);
    p.addcdiv_(exp_avg_[i], denom, -lr / bc1);
  }
}

// Groups segments by weight decay and device; one kernel launch per group.
// One group's tensors, as the foreach and fused kernels take them.
struct GroupTensors {
  std::vector<at::Tensor> p, g, m, v, steps;
};

// Calls fn(weight_decay, tensors) per group of segments with the same weight
// decay, device and dtype (what one multi-tensor kernel call can take).
template <typename Fn>
void AdamW::for_each_group(const std::vector<size_t>& segs, Fn fn) {
  std::map<std::pair<double, std::string>, std::vector<size_t>> groups;
  for (size_t i : segs)
    groups[{segments_[i].weight_decay,
            segments_[i].param.device().str() + c10::toString(segments_[i].param.scalar_type())}]
        .push_back(i);
  for (auto& [key, idx] : groups) {
    GroupTensors t;
    for (auto i : idx) {
      t.p.push_back(segments_[i].param);
      t.g.push_back(grad_as_param(segments_[i]));
      t.m.push_back(exp_avg_[i]);
      t.v.push_back(exp_avg_sq_[i]);
      t.steps.push_back(state_steps_[i]);
    }
    fn(key.first, t);
  }
}

void AdamW::step_fused(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device,
                       const std::vector<size_t>& idx) {
  for_each_group(idx, [&](double wd, GroupTensors& t) {
    auto& [p, g, m, v, steps] = t;
    at::_foreach_add_(steps, 1);
    // Offloaded segments step on the host: the flag is read there (the host step
    // needs the gradient norm on the host anyway).
    const auto dev = p.front().device();
    const auto flag = !found_inf.defined() || found_inf.device() == dev ? found_inf : found_inf.to(dev);
    const auto inf = flag.defined() ? std::optional<at::Tensor>(flag) : std::nullopt;
    if (lr_device.defined())
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr_device, args_.beta1, args_.beta2, wd,
                        args_.eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
    else
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, args_.beta1, args_.beta2, wd,
                        args_.eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
    // A skipped update does not count (torch.optim.adam's fused path does the same).
    if (flag.defined()) at::_foreach_sub_(steps, std::vector<at::Tensor>(steps.size(), flag.reshape({})));
  });
}

void AdamW::step_foreach(double lr, const std::vector<size_t>& idx) {
  const double b1 = args_.beta1, b2 = args_.beta2;
  const double bc1 = 1 - std::pow(b1, step_), bc2 = 1 - std::pow(b2, step_);
  for_each_group(idx, [&](double wd, GroupTensors& t) {
    auto& [p, g, m, v, steps] = t;
    at::_foreach_add_(steps, 1);
    if (wd != 0) at::_foreach_mul_(p, 1 - lr * wd);
    at::_foreach_lerp_(m, g, 1 - b1);
    at::_foreach_mul_(v, b2);
    at::_foreach_addcmul_(v, g, g, 1 - b2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, std::sqrt(bc2));
    at::_foreach_add_(denom, args_.eps);
    at::_foreach_addcdiv_(p, m, denom, -lr / bc1);
  });
}

}  // namespace nnstrain::optim
