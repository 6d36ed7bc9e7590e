#include "trainer/optim/precision.h"

#include <torch/torch.h>

namespace nnstrain::optim {

PrecisionSetup precision_setup(const std::string& precision, const std::string& reduce_dtype) {
  PrecisionSetup p;
  if (precision.rfind("bf16", 0) == 0) p.param = torch::kBFloat16;
  else if (precision.rfind("16", 0) == 0) p.param = torch::kHalf;
  p.master_weights = precision.size() > 6 && precision.compare(precision.size() - 6, 6, "-mixed") == 0;
  p.loss_scaling = p.param == torch::kHalf;
  if (reduce_dtype == "fp32") p.grad = torch::kFloat;
  else if (reduce_dtype == "bf16") p.grad = torch::kBFloat16;
  else if (reduce_dtype == "fp16") p.grad = torch::kHalf;
  else p.grad = p.master_weights ? torch::kFloat : p.param;  // auto
  return p;
}

LossScaler::LossScaler(const config::LossScalerArgs& args, const at::TensorOptions& device) : args_(args) {
  scale_ = torch::full({1}, args.init_scale, device.dtype(torch::kFloat32));
  growth_tracker_ = torch::zeros({1}, device.dtype(torch::kInt32));
}

void LossScaler::update(const at::Tensor& found_inf) {
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, args_.growth_factor, args_.backoff_factor,
                         args_.growth_interval);
}

}  // namespace nnstrain::optim
