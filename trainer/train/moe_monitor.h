// Mixture-of-Experts layers as the loop sees them (models/common/moe.h): after
// every step, each layer's tokens per expert summed over the data-parallel
// ranks (dp x cp: the ranks that see different tokens), from which
// DeepSeek-V3's aux-loss-free balancing updates the routers' selection bias,
// identically on every rank; at logging steps the interval's balancing loss,
// the busiest expert's load over the mean per layer (imbalance) and the
// dropped assignments, for metrics.jsonl and TensorBoard.
//
// Backend rules: one all-reduce over dp x cp per step, issued by every rank
// after its backward whatever it routed (a pipeline stage's group holds the
// ranks of the same stage, so the same layers); no host sync of its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trainer/sharding/state_tensor.h"

namespace nnstrain::dist {
class Runtime;
}
namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::train {

class MoeMonitor {
 public:
  // The model's layers are known from take_moe_stats() at once (before any
  // forward it reports each layer with zero counts and its bias).
  MoeMonitor(models::CausalLM& model, dist::Runtime* rt);
  // After each step's backward: this step's statistics taken from the model
  // (`micro_batches` forwards on this rank), the load summed over dp x cp, the
  // selection biases updated.
  void after_step(int64_t micro_batches);
  // At logging steps: "moe_aux_loss" (the balancing losses, coefficients applied,
  // summed over layers: the mean over every micro-batch of the interval),
  // "moe_imbalance" (per layer: the busiest expert's tokens over the mean),
  // "moe_imbalance_max", "moe_dropped" (assignments per step); the interval restarts.
  void report(nlohmann::json& rec);
  // The routers' selection biases, for checkpoints ("moe/<layer>.expert_bias",
  // replicated on `holders`: every rank holding the layer). Under pipeline
  // parallelism only this stage's layers (CausalLM::take_moe_stats reports the
  // layers this rank holds), so no stage writes another's bias.
  std::vector<sharding::StateTensor> state(const std::vector<int>& holders) const;

 private:
  models::CausalLM& model_;
  dist::Runtime* rt_;
  bool moe_model_ = false;  // the model has MoE layers (on any stage): the same on every rank
  c10::Device device_{c10::kCPU};  // where the collectives' tensors go (the parameters')
  std::vector<std::string> layers_;
  std::vector<at::Tensor> biases_;   // per layer (undefined: no selection bias)
  std::vector<double> speeds_;
  std::vector<int64_t> expert_counts_;  // per layer, its experts
  at::Tensor interval_;  // the all-reduced vectors of the steps since the last report, summed (device)
  int64_t interval_steps_ = 0;
};

}  // namespace nnstrain::train
