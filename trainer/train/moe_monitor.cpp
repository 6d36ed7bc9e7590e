#include "trainer/train/moe_monitor.h"

#include <torch/torch.h>

#include <algorithm>

#include "models/common/moe.h"
#include "models/model.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/dist/process_groups.h"

namespace nnstrain::train {

MoeMonitor::MoeMonitor(models::CausalLM& model, dist::Runtime* rt)
    : model_(model), rt_(rt), moe_model_(model.dims().experts > 0) {
  device_ = c10::Device(c10::kCPU);
  for (const auto& p : model_.parameters())
    if (!p.is_meta()) device_ = p.device();
  // The layers (and biases, for a resume's load) before any step: nothing counted yet.
  for (const auto& s : model_.take_moe_stats()) {
    layers_.push_back(s.layer);
    biases_.push_back(s.expert_bias);
    speeds_.push_back(s.bias_update_speed);
    expert_counts_.push_back(static_cast<int64_t>(s.tokens_per_expert.size()));
  }
}

void MoeMonitor::after_step(int64_t micro_batches) {
  if (layers_.empty()) return;
  auto stats = model_.take_moe_stats();
  TORCH_CHECK(stats.size() == layers_.size(), "MoeMonitor: the model reported ", stats.size(), " MoE layers, then ",
              layers_.size());
  for (size_t l = 0; l < stats.size(); ++l) biases_[l] = stats[l].expert_bias;  // moved to the device at the first forward
  // One vector: every layer's tokens per expert, then the dropped assignments
  // per layer, then the balancing loss; summed over the ranks that see other tokens.
  std::vector<double> v;
  for (const auto& s : stats) v.insert(v.end(), s.tokens_per_expert.begin(), s.tokens_per_expert.end());
  for (const auto& s : stats) v.push_back(double(s.dropped));
  const auto aux_at = static_cast<int64_t>(v.size());
  v.push_back(0.0);  // the balancing losses: added on the device below
  // Each micro-batch's balancing loss is its mean over its sequences (a cp rank holds its
  // sequences' whole figure): their mean over every rank's micro-batches is the step's, at any plan.
  v.push_back(double(micro_batches));
  auto t = torch::tensor(v, torch::kDouble).to(device_);
  for (const auto& s : stats)
    if (s.aux_loss.defined()) t.narrow(0, aux_at, 1).add_(s.aux_loss.detach().to(t.device(), torch::kDouble).reshape({1}));
  if (rt_ && rt_->dp_cp.size() > 1) rt_->all_reduce(rt_->dp_cp, t, "MoE load all-reduce");
  // Sequence parallelism: the tp ranks routed different tokens. Summed over tp the balancing
  // loss and micro-batch count grow alike (tp x), so their ratio, the step's mean, holds.
  // Every tp rank has the same layers, so all of them issue it (NCCL's rule).
  if (rt_ && rt_->tp.size() > 1 && stats.front().tokens_split_over_tp)
    rt_->all_reduce(rt_->tp, t, "MoE load all-reduce (sequence parallel)");
  // DeepSeek-V3: an expert above the mean load is chosen less next step, one below more.
  int64_t at = 0;
  torch::NoGradGuard no_grad;
  for (size_t l = 0; l < stats.size(); ++l) {
    const auto E = static_cast<int64_t>(stats[l].tokens_per_expert.size());
    const auto load = t.narrow(0, at, E);
    at += E;
    if (biases_[l].defined() && speeds_[l] > 0) models::common::update_expert_bias(biases_[l], load, speeds_[l]);
  }
  if (interval_.defined()) interval_.add_(t);
  else interval_ = t.clone();
  ++interval_steps_;
}

void MoeMonitor::report(nlohmann::json& rec) {
  if (!moe_model_) return;
  // This rank's layers (under pp: its stage's) over the interval.
  nlohmann::json imbalance = nlohmann::json::object(), dropped = nlohmann::json::object();
  double worst = 0, dropped_total = 0, aux = 0, micro = 0, steps = double(interval_steps_);
  if (interval_.defined() && interval_steps_ > 0) {
    const auto h = interval_.to(torch::kCPU).contiguous();  // logging steps sync anyway
    const double* v = h.data_ptr<double>();
    int64_t at = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const int64_t E = expert_counts_[l];
      double sum = 0, top = 0;
      for (int64_t e = 0; e < E; ++e) sum += v[at + e], top = std::max(top, v[at + e]);
      at += E;
      const double ratio = sum > 0 ? top / (sum / double(E)) : 0.0;
      imbalance[layers_[l]] = ratio;
      worst = std::max(worst, ratio);
    }
    for (size_t l = 0; l < layers_.size(); ++l) dropped[layers_[l]] = v[at + l] / steps, dropped_total += v[at + l];
    at += static_cast<int64_t>(layers_.size());
    aux = v[at], micro = v[at + 1];
  }
  // Under pp every stage's layers count: the balancing losses and drops summed over the
  // stages, the worst imbalance and the micro-batch count (the same on every stage with
  // MoE layers) their maximum. Every pp rank issues both, layers or not (NCCL's rule).
  if (rt_ && rt_->pp.size() > 1) {
    auto sum = torch::tensor({aux, dropped_total}, torch::kDouble).to(device_);
    auto most = torch::tensor({worst, micro, steps}, torch::kDouble).to(device_);
    rt_->all_reduce(rt_->pp, sum, "MoE figures all-reduce (pipeline)");
    rt_->all_reduce_max(rt_->pp, most, "MoE figures max all-reduce (pipeline)");
    const auto s = sum.to(torch::kCPU), m = most.to(torch::kCPU);
    aux = s[0].item<double>(), dropped_total = s[1].item<double>();
    worst = m[0].item<double>(), micro = m[1].item<double>(), steps = m[2].item<double>();
  }
  rec["moe_aux_loss"] = micro > 0 ? aux / micro : 0.0;  // mean over the interval's micro-batches
  rec["moe_imbalance"] = imbalance;                       // this rank's layers
  rec["moe_imbalance_max"] = worst;
  rec["moe_dropped"] = steps > 0 ? dropped_total / steps : 0.0;
  rec["moe_dropped_per_layer"] = dropped;
  interval_ = at::Tensor();
  interval_steps_ = 0;
}

std::vector<sharding::StateTensor> MoeMonitor::state(const std::vector<int>& holders) const {
  std::vector<sharding::StateTensor> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!biases_[l].defined()) continue;
    const auto& b = biases_[l];
    auto spec = sharding::ShardSpec::full("moe/" + layers_[l] + ".expert_bias",
                                          checkpoint::dtype_name(checkpoint::to_dtype(b.scalar_type())), b.sizes().vec());
    spec.replica_ranks = holders;
    out.push_back({spec, b});
  }
  return out;
}

}  // namespace nnstrain::train
