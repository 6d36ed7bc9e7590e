// Precision modes (`precision:`, `compute_config.reduce_dtype`) as dtypes, and
// the dynamic loss scaler of the fp16 modes. See docs/precision.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "base/config/trainer_args.h"

namespace nnstrain::optim {

struct PrecisionSetup {
  c10::ScalarType param = c10::ScalarType::Float;  // what the model computes with
  c10::ScalarType grad = c10::ScalarType::Float;   // gradient buffer and reduction
  bool master_weights = false;                     // fp32 masters (*-mixed)
  bool loss_scaling = false;                       // fp16 modes
};
PrecisionSetup precision_setup(const std::string& precision, const std::string& reduce_dtype);

// torch.amp.GradScaler's dynamic scaling, all on the device: the loss is
// multiplied by scale(); after each step update(found_inf) backs the scale off
// on a non-finite step and grows it after growth_interval finite ones.
class LossScaler {
 public:
  LossScaler(const config::LossScalerArgs& args, const at::TensorOptions& device);
  const at::Tensor& scale() const { return scale_; }           // float32 [1]
  at::Tensor& scale() { return scale_; }
  at::Tensor& growth_tracker() { return growth_tracker_; }    // int32 [1]: finite steps in a row
  void update(const at::Tensor& found_inf);

 private:
  config::LossScalerArgs args_;
  at::Tensor scale_, growth_tracker_;
};

}  // namespace nnstrain::optim
