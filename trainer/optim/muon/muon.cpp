#include "trainer/optim/muon/muon.h"

#include <torch/torch.h>

#include <cmath>

#include "base/config/arg_map.h"

namespace nnstrain::optim::muon {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// The parameters Muon takes, by name: the globs, or every matrix inside the blocks.
std::vector<std::string> muon_params(const MuonConfig& c, const OptimizerContext& ctx) {
  std::vector<std::string> out;
  if (c.params.empty()) {
    for (const auto& p : ctx.params)
      if (p.global_shape.size() >= 2 && takes(c, p.name, p.in_block)) out.push_back(p.name);
    return out;
  }
  for (const auto& glob : c.params) {
    bool any = false;
    for (const auto& p : ctx.params) {
      if (!glob_match(glob, p.name)) continue;
      if (p.global_shape.size() < 2)
        throw config::ConfigError(c.params_where + ": '" + glob + "' takes " + p.name + " of shape " +
                                  shape_text(p.global_shape) + ", not a matrix; Muon takes matrices only");
      any = true;
      if (std::find(out.begin(), out.end(), p.name) == out.end()) out.push_back(p.name);
    }
    if (!any && ctx.whole_model)
      throw config::ConfigError(c.params_where + ": '" + glob + "' matches no parameter of the model");
  }
  return out;
}

}  // namespace

Muon::Muon(OptimizerContext ctx)
    : cfg_(dynamic_cast<const MuonConfig&>(*ctx.args->args)), adamw_lr_(ctx.args->lr),
      segments_(std::move(ctx.segments)), comm_(ctx.comm) {
  const auto names = muon_params(cfg_, ctx);
  if (names.empty() && ctx.whole_model)
    throw config::ConfigError(cfg_.params_where + ": Muon takes no parameter: the model has no matrices " +
                              (cfg_.params.empty() ? "inside its blocks" : "matching these names"));
  std::vector<Segment> rest;
  std::vector<sharding::ShardSpec> specs;
  for (size_t i = 0; i < segments_.size(); ++i) {
    const bool muon = std::find(names.begin(), names.end(), segments_[i].name) != names.end();
    muon_of_.push_back(muon ? static_cast<int>(muon_.size()) : -1);
    adamw_of_.push_back(muon ? -1 : static_cast<int>(rest.size()));
    if (!muon) {
      rest.push_back(segments_[i]);
      continue;
    }
    muon_.push_back(i);
    specs.push_back(ctx.specs[i]);
    auto& s = segments_[i];
    momentum_.push_back(s.exp_avg.defined() ? s.exp_avg : torch::zeros_like(s.param, at::MemoryFormat::Contiguous));
  }
  adamw_ = std::make_unique<AdamW>(std::move(rest), *ctx.args);
  exchange_ = std::make_unique<MatrixExchange>(specs, *comm_);
  shape_ = exchange_->piece_shape();
  const bool bf16 = cfg_.ns_dtype == "bf16" || (cfg_.ns_dtype == "auto" && ctx.cuda);
  ns_dtype_ = bf16 ? torch::kBFloat16 : torch::kFloat32;
}

void Muon::begin_step(const at::Tensor& found_inf) {
  torch::NoGradGuard no_grad;
  // found_inf is the same on every rank (reduced), so all skip or none does:
  // no collective is issued by some ranks only.
  skip_ = found_inf.defined() && found_inf.item<float>() != 0;
  prepared_ = true;
  if (skip_) return;
  const auto dev = comm_->device();
  auto local = torch::empty({exchange_->local_size()}, torch::TensorOptions().dtype(ns_dtype_).device(dev));
  int64_t at = 0;
  for (size_t k = 0; k < muon_.size(); ++k) {
    const auto& s = segments_[muon_[k]];
    const auto g = grad_as_param(s);
    auto& buf = momentum_[k];
    buf.lerp_(g, 1 - cfg_.momentum);
    const auto u = cfg_.nesterov ? g.lerp(buf, cfg_.momentum) : buf;
    local.narrow(0, at, u.numel()).copy_(u.reshape({-1}));
    at += u.numel();
  }
  auto owned = exchange_->gather(local);
  int64_t pos = 0;
  for (size_t m : exchange_->owned()) {
    const auto& mx = exchange_->matrices()[m];
    auto w = owned.narrow(0, pos, mx.rows * mx.cols).view({mx.rows, mx.cols});
    w.copy_(newton_schulz(w, cfg_.ns_coefficients, cfg_.ns_steps, cfg_.eps));
    pos += mx.rows * mx.cols;
  }
  updates_ = exchange_->scatter(owned);
}

void Muon::step(double lr, const at::Tensor& found_inf, const at::Tensor& lr_device, const std::vector<size_t>& subset) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(!lr_device.defined(), "Muon: a device learning rate (CUDA graphs) is not supported");
  const bool whole = subset.empty();
  if (whole) begin_step(found_inf);
  TORCH_CHECK(prepared_, "Muon: step() on a subset without begin_step() first");
  const double muon_lr = other_learning_rates(lr)[0].second;
  std::vector<size_t> rest;
  std::vector<size_t> all;
  if (whole)
    for (size_t i = 0; i < segments_.size(); ++i) all.push_back(i);
  int64_t offset = 0;
  std::vector<int64_t> offsets;
  for (size_t k = 0; k < muon_.size(); ++k) offsets.push_back(offset), offset += segments_[muon_[k]].param.numel();
  for (size_t i : whole ? all : subset) {
    if (adamw_of_[i] >= 0) {
      rest.push_back(static_cast<size_t>(adamw_of_[i]));
      continue;
    }
    if (skip_) continue;
    const int k = muon_of_[i];
    auto& p = segments_[i].param;
    const auto [rows, cols] = shape_[k];
    const double ratio = cfg_.adjust_lr_fn == "match_rms_adamw"
                             ? 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)))
                             : std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
    p.mul_(1 - muon_lr * cfg_.weight_decay);
    p.add_(updates_.narrow(0, offsets[k], p.numel()).view(p.sizes()).to(p.device()), -muon_lr * ratio);
  }
  if (!rest.empty()) adamw_->step(lr, found_inf, {}, rest);  // (an empty subset would mean all)
  if (whole) {
    prepared_ = false;
    if (!skip_) ++step_;
  }
}

void Muon::set_step_count(int64_t s) {
  step_ = s;
  adamw_->set_step_count(s);
}

std::vector<std::pair<std::string, at::Tensor>> Muon::state(size_t i) {
  if (muon_of_[i] >= 0) return {{"momentum_buffer", momentum_[muon_of_[i]]}};
  return adamw_->state(static_cast<size_t>(adamw_of_[i]));
}

std::string Muon::impl() const {
  return std::string("muon (") + exchange_->describe() + "; Newton-Schulz in " +
         (ns_dtype_ == torch::kBFloat16 ? "bf16" : "fp32") + ") + " + adamw_->impl() + " adamw";
}

std::vector<at::Tensor> Muon::live_tensors() const {
  std::vector<at::Tensor> live;
  for (size_t k = 0; k < muon_.size(); ++k) live.push_back(segments_[muon_[k]].param), live.push_back(momentum_[k]);
  return live;
}

void Muon::back_up(Backup& into) const {
  Backup rest;
  rest.tensors.assign(into.tensors.begin() + std::min(into.tensors.size(), 2 * muon_.size()), into.tensors.end());
  adamw_->back_up(rest);
  std::vector<at::Tensor> mine(into.tensors.begin(), into.tensors.begin() + std::min(into.tensors.size(), 2 * muon_.size()));
  save_tensors(live_tensors(), mine);
  into.tensors = mine;
  into.tensors.insert(into.tensors.end(), rest.tensors.begin(), rest.tensors.end());
  into.step = step_;
}

void Muon::restore(const Backup& from) {
  const auto n = 2 * muon_.size();
  load_tensors({from.tensors.begin(), from.tensors.begin() + n}, live_tensors());
  Backup rest;
  rest.tensors.assign(from.tensors.begin() + n, from.tensors.end());
  rest.step = from.step;
  adamw_->restore(rest);
  step_ = from.step;
}

}  // namespace nnstrain::optim::muon
