// AdamW over "segments": a segment is a parameter tensor (or, under ZeRO, a flat
// slice of one) with its gradient. The update is elementwise, so the same code
// serves whole parameters and ZeRO partitions. Matches torch.optim.AdamW.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "base/config/trainer_args.h"
#include "trainer/optim/optimizer.h"

namespace nnstrain::optim {

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Segment> segments, const config::OptimizerArgs& args);

  // One update with learning rate lr. Gradients must already be final (reduced,
  // clipped, unscaled). found_inf (optional, float [1] on the device): where it
  // is 1 the update is skipped whole (weights, moments and step count
  // unchanged), decided on the device by the fused kernel without a host sync;
  // the foreach and loop implementations read it on the host.
  // lr_device (optional, fused only): the learning rate read from a device
  // scalar instead, so a captured CUDA graph follows the schedule.
  // subset (optional): only these segments (indices), e.g. one offloaded
  // bucket at a time; each segment keeps its own step count. Segments may lie
  // on different devices (offload): each group's kernel runs where its
  // segments are, reading found_inf there.
  void step(double lr, const at::Tensor& found_inf = {}, const at::Tensor& lr_device = {},
            const std::vector<size_t>& subset = {}) override;

  std::vector<Segment>& segments() override { return segments_; }
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) override {
    return {{"exp_avg", exp_avg_[i]}, {"exp_avg_sq", exp_avg_sq_[i]}};
  }
  // Updates applied (skipped ones not counted); reads the device (checkpoints, logs).
  int64_t step_count() const override;
  void set_step_count(int64_t s) override;
  // exp_avg and exp_avg_sq of segment i, same shape as its param.
  at::Tensor& exp_avg(size_t i) { return exp_avg_[i]; }
  at::Tensor& exp_avg_sq(size_t i) { return exp_avg_sq_[i]; }
  std::string impl() const override { return impl_; }

  // Each segment's parameter, moments and step count.
  void back_up(Backup& into) const override;
  void restore(const Backup& from) override;

 private:
  void step_loop(double lr, const std::vector<size_t>& idx);
  void step_foreach(double lr, const std::vector<size_t>& idx);
  void step_fused(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device, const std::vector<size_t>& idx);
  template <typename Fn>
  void for_each_group(const std::vector<size_t>& idx, Fn fn);  // per group of segments one multi-tensor kernel call can take

  std::vector<Segment> segments_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_, state_steps_;
  config::OptimizerArgs args_;
  std::string impl_;
  int64_t step_ = 0;
};

// nanoGPT's parameter groups: weight decay only on tensors of two or more dims.
double weight_decay_for(const at::Tensor& param, double weight_decay);

}  // namespace nnstrain::optim
