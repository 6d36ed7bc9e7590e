#include "models/common/moe.h"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "models/common/kernels/grouped_gemm.h"
#include "models/common/kernels/kernels.h"
#include "models/common/moe_dispatch.h"
#include "models/common/recompute.h"
#include "models/common/tp_ops.h"

namespace nnstrain::models::common {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Autocast off for the router (its logits, scores and weights stay fp32).
class NoAutocast {
 public:
  explicit NoAutocast(c10::DeviceType d) : d_(d), was_(at::autocast::is_autocast_enabled(d)) {
    at::autocast::set_autocast_enabled(d_, false);
  }
  ~NoAutocast() { at::autocast::set_autocast_enabled(d_, was_); }

 private:
  c10::DeviceType d_;
  bool was_;
};

struct ScaleHolder : torch::CustomClassHolder {
  explicit ScaleHolder(std::shared_ptr<AuxLossScale> s) : scale(std::move(s)) {}
  std::shared_ptr<AuxLossScale> scale;
};

class RecordLossGrad : public torch::autograd::Function<RecordLossGrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& mean, c10::intrusive_ptr<ScaleHolder> h) {
    ctx->saved_data["scale"] = c10::IValue::make_capsule(std::move(h));
    return mean.view_as(mean);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto h = c10::static_intrusive_pointer_cast<ScaleHolder>(ctx->saved_data["scale"].toCapsule());
    h->scale->grad = grads[0].detach().clone();
    return {grads[0], at::Tensor()};
  }
};

// y unchanged; in backward the balancing loss `aux` (a scalar with its graph)
// gets the gradient the micro-batch's LM loss got (1 with no model scale).
class AddAuxGrad : public torch::autograd::Function<AddAuxGrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& aux,
                            c10::intrusive_ptr<ScaleHolder> h) {
    ctx->saved_data["scale"] = c10::IValue::make_capsule(std::move(h));
    ctx->saved_data["aux_like"] = aux.detach();
    return y.view_as(y);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto h = c10::static_intrusive_pointer_cast<ScaleHolder>(ctx->saved_data["scale"].toCapsule());
    const auto aux = ctx->saved_data["aux_like"].toTensor();
    at::Tensor g = torch::ones_like(aux);
    if (h->scale) {
      TORCH_CHECK(h->scale->grad.defined(),
                  "MoE balancing loss: no LM-loss gradient recorded to scale it by (backward must start from the "
                  "model's loss)");
      g = g * h->scale->grad.to(aux.device(), aux.scalar_type());
    }
    return {grads[0], g, at::Tensor()};
  }
};

struct GlobalHolder : torch::CustomClassHolder {
  explicit GlobalHolder(std::shared_ptr<GlobalAux> g) : aux(std::move(g)) {}
  std::shared_ptr<GlobalAux> aux;
};

// GlobalBatch: y unchanged; in backward the layer's summed router probabilities
// `probs` [E] get d aux / d probs = coef E F / (L N)^2, F the micro-batch's
// assignments over every layer (complete by then), times the LM loss's gradient.
class AddGlobalAuxGrad : public torch::autograd::Function<AddGlobalAuxGrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& probs,
                            c10::intrusive_ptr<GlobalHolder> g, c10::intrusive_ptr<ScaleHolder> h, double factor) {
    ctx->saved_data["global"] = c10::IValue::make_capsule(std::move(g));
    ctx->saved_data["scale"] = c10::IValue::make_capsule(std::move(h));
    ctx->saved_data["factor"] = factor;
    return y.view_as(y);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = c10::static_intrusive_pointer_cast<GlobalHolder>(ctx->saved_data["global"].toCapsule());
    auto h = c10::static_intrusive_pointer_cast<ScaleHolder>(ctx->saved_data["scale"].toCapsule());
    auto gp = g->aux->chose * ctx->saved_data["factor"].toDouble();
    if (h->scale) {
      TORCH_CHECK(h->scale->grad.defined(),
                  "MoE balancing loss: no LM-loss gradient recorded to scale it by (backward must start from the "
                  "model's loss)");
      gp = gp * h->scale->grad.to(gp.device(), gp.scalar_type());
    }
    return {grads[0], gp, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct CpHolder : torch::CustomClassHolder {
  explicit CpHolder(c10::intrusive_ptr<CpComm> c) : comm(std::move(c)) {}
  c10::intrusive_ptr<CpComm> comm;
};

// Sum over the context-parallel group, forward and backward (every rank's loss
// uses the sum, so each rank's share gets the sum of their gradients).
class CpAllReduce : public torch::autograd::Function<CpAllReduce> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, c10::intrusive_ptr<CpHolder> h) {
    auto r = h->comm->all_gather(t.contiguous()).sum(0);
    ctx->saved_data["comm"] = c10::IValue::make_capsule(std::move(h));
    return r;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto h = c10::static_intrusive_pointer_cast<CpHolder>(ctx->saved_data["comm"].toCapsule());
    return {h->comm->all_gather(grads[0].contiguous()).sum(0), at::Tensor()};
  }
};

at::Tensor cp_sum(const at::Tensor& t, const c10::intrusive_ptr<CpComm>& comm) {
  if (!comm) return t;
  return CpAllReduce::apply(t, c10::make_intrusive<CpHolder>(comm));
}

}  // namespace

Routing route(const at::Tensor& logits, const MoeOptions& o, const at::Tensor& bias) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) == o.num_experts, "route: logits [N, num_experts]");
  const auto lf = logits.to(torch::kFloat);
  Routing r;
  if (o.router == RouterKind::Softmax) {
    r.probs = torch::softmax(lf, -1);
    auto [v, i] = r.probs.topk(o.top_k, -1);
    if (o.norm_topk_prob) v = v / v.sum(-1, true);
    r.experts = i;
    r.weights = v;
    return r;
  }
  // DeepSeek-V3: sigmoid scores; the bias only chooses, the scores weigh.
  const auto scores = torch::sigmoid(lf);
  auto choice = bias.defined() ? scores + bias.to(scores.device(), torch::kFloat) : scores;
  if (o.n_group > 1) {
    const int64_t N = lf.size(0), per = o.num_experts / o.n_group;
    // A group's score: the sum of its two best experts' (as DeepSeek-V3).
    const auto group_scores = std::get<0>(choice.view({N, o.n_group, per}).topk(std::min<int64_t>(2, per), -1)).sum(-1);
    const auto groups = std::get<1>(group_scores.topk(o.topk_group, -1));
    const auto keep = torch::zeros_like(group_scores).scatter_(1, groups, 1.0).gt(0);
    choice = choice.masked_fill(keep.unsqueeze(-1).expand({N, o.n_group, per}).reshape({N, o.num_experts}).logical_not(),
                                -std::numeric_limits<float>::infinity());
  }
  r.experts = std::get<1>(choice.topk(o.top_k, -1));
  auto w = scores.gather(1, r.experts);
  if (o.norm_topk_prob) w = w / (w.sum(-1, true) + 1e-20);
  r.weights = w * o.routed_scaling_factor;
  r.probs = scores / scores.sum(-1, true);
  return r;
}

int64_t drop_over_capacity(at::Tensor& experts, const at::Tensor& weights, int64_t num_experts,
                           double capacity_factor) {
  torch::NoGradGuard no_grad;
  const int64_t N = experts.size(0), k = experts.size(1);
  const auto capacity =
      std::min<int64_t>(N, static_cast<int64_t>(std::ceil(double(N * k) / num_experts * capacity_factor)));
  // score[n, e]: token n's weight for e where it chose e, else -inf.
  const auto valid = experts.ge(0);
  auto score = torch::full({N, num_experts}, -std::numeric_limits<float>::infinity(), weights.options().dtype(torch::kFloat));
  score.scatter_(1, experts.clamp_min(0), torch::where(valid, weights.to(torch::kFloat),
                                                       torch::full_like(weights, -std::numeric_limits<float>::infinity(),
                                                                        torch::kFloat)));
  // Per expert the `capacity` highest-weight tokens stay.
  auto kept = torch::zeros({N, num_experts}, experts.options().dtype(torch::kBool));
  if (capacity > 0) kept.scatter_(0, std::get<1>(score.topk(capacity, 0)), true);
  kept = kept.logical_and(score.isfinite());
  const auto keep = kept.gather(1, experts.clamp_min(0)).logical_and(valid);
  const int64_t dropped = valid.sum().item<int64_t>() - keep.sum().item<int64_t>();
  experts = torch::where(keep, experts, torch::full_like(experts, -1));
  return dropped;
}

void update_expert_bias(at::Tensor& bias, const at::Tensor& load, double speed) {
  torch::NoGradGuard no_grad;
  const auto l = load.to(bias.device(), torch::kFloat);
  bias.add_(torch::sign(l.mean() - l).to(bias.scalar_type()), speed);
}

at::Tensor record_loss_grad(const at::Tensor& mean, const std::shared_ptr<AuxLossScale>& scale) {
  if (!scale || !torch::GradMode::is_enabled() || !mean.requires_grad()) return mean;
  return RecordLossGrad::apply(mean, c10::make_intrusive<ScaleHolder>(scale));
}

ExpertsImpl::ExpertsImpl(const MoeOptions& o, const ShardingContext& ctx) : o_(o) {
  const int64_t E = o.num_experts, I = o.moe_intermediate_size, C = o.hidden_size;
  const auto init = InitRule::normal(o.initializer_range);
  auto bias = [&](const std::string& of, int64_t out) {
    if (o.expert_bias) layouts_.push_back(expert_layout(of + "_bias", ctx, {E, out}, InitRule::zeros()));
  };
  if (o.interleaved_gate_up) {
    layouts_ = {expert_layout("gate_up_proj", ctx, {E, C, 2 * I}, init), expert_layout(o.down_name, ctx, {E, I, C}, init)};
    bias("gate_up_proj", 2 * I);
  } else {
    layouts_ = {expert_layout(o.gate_name, ctx, {E, I, C}, init), expert_layout(o.up_name, ctx, {E, I, C}, init),
                expert_layout(o.down_name, ctx, {E, C, I}, init)};
    bias(o_.gate_name, I);
    bias(o_.up_name, I);
  }
  bias(o.down_name, C);
  for (auto& l : layouts_) add_param(l, ctx.options), l.owner = this;
  if (ctx.sp()) sp_comm_ = ctx.comm;
  rebind();
}

void ExpertsImpl::rebind() {
  auto get = [this](const std::string& name) {
    const auto* p = parameters_.find(name);
    return p ? *p : torch::Tensor();
  };
  gate = get(o_.gate_name), up = get(o_.up_name), down = get(o_.down_name), gate_up = get("gate_up_proj");
  gate_bias = get(o_.gate_name + "_bias"), up_bias = get(o_.up_name + "_bias");
  down_bias = get(o_.down_name + "_bias"), gate_up_bias = get("gate_up_proj_bias");
}

torch::Tensor ExpertsImpl::forward(const torch::Tensor& rows, const std::vector<int64_t>& counts) {
  // Under autocast the GEMMs run in its dtype (grouped_mm needs bf16 operands).
  const auto dev = rows.device().type();
  const auto dt = at::autocast::is_autocast_enabled(dev) ? at::autocast::get_autocast_dtype(dev) : rows.scalar_type();
  const auto r = rows.to(dt);
  // Each tp rank ran its own tokens through the same experts (sequence parallelism): gradients summed.
  auto used = [&](const torch::Tensor& w) {
    if (!w.defined()) return w;
    return (sp_comm_ ? sum_grads_over_tp(w, {}, sp_comm_).first : w).to(dt);
  };
  if (!gate_up.defined() && !down_bias.defined() && o_.activation == ExpertActivation::Swiglu)
    return kernels::grouped_swiglu_mlp(r, used(gate), used(up), used(down), counts);
  // GPT-OSS's experts: three grouped GEMMs, each row plus its expert's bias, the activation between.
  const auto expert_of_row =
      torch::repeat_interleave(torch::tensor(counts, torch::kLong)).to(rows.device());
  auto linear = [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, bool input_major) {
    auto y = kernels::grouped_linear(x, input_major ? w.transpose(1, 2) : w, counts);  // input-major: x w[e]
    return b.defined() ? y + b.index_select(0, expert_of_row) : y;
  };
  torch::Tensor g, u;
  if (gate_up.defined()) {
    const auto h = linear(r, used(gate_up), used(gate_up_bias), true);
    g = h.slice(1, 0, h.size(1), 2), u = h.slice(1, 1, h.size(1), 2);  // interleaved: gate even, up odd
  } else {
    g = linear(r, used(gate), used(gate_bias), false), u = linear(r, used(up), used(up_bias), false);
  }
  torch::Tensor a;
  if (o_.activation == ExpertActivation::ClampedSwiglu) {  // transformers' GptOssExperts, op for op
    g = g.clamp_max(o_.swiglu_limit);
    u = u.clamp(-o_.swiglu_limit, o_.swiglu_limit);
    a = (u + 1) * (g * torch::sigmoid(g * o_.swiglu_alpha));
  } else {
    a = torch::silu(g) * u;
  }
  return linear(a, used(down), used(down_bias), gate_up.defined());
}

SwigluMlpImpl::SwigluMlpImpl(int64_t hidden, int64_t intermediate, double init_std, const ShardingContext& ctx) {
  const auto init = InitRule::normal(init_std);
  gate_proj = register_module("gate_proj", ColumnParallelLinear(ctx, hidden, std::vector<int64_t>{intermediate}, 1,
                                                                false, init));
  up_proj = register_module("up_proj", ColumnParallelLinear(ctx, hidden, std::vector<int64_t>{intermediate}, 1, false, init));
  down_proj = register_module("down_proj", RowParallelLinear(ctx, intermediate, hidden, 1, false, init));
}

torch::Tensor SwigluMlpImpl::forward(const torch::Tensor& x) {
  return down_proj(kernels::swiglu(gate_proj(x), up_proj(x)));
}

MoeImpl::MoeImpl(const MoeOptions& o, const ShardingContext& ctx, std::string layer,
                 std::shared_ptr<AuxLossScale> scale)
    : o_(o), ctx_(ctx), layer_(std::move(layer)), scale_(std::move(scale)) {
  // The selection bias, fp32 like the routing: moved by the trainer when bias_update_speed > 0,
  // else fixed (zero, or what a folder's e_score_correction_bias holds: hf_buffers).
  if (o.router == RouterKind::DeepseekV3) bias_ = torch::zeros({o.num_experts}, torch::kFloat);
  if (o.aux_loss_form == AuxLossForm::GlobalBatch) global_ = scale_ ? scale_ : std::make_shared<AuxLossScale>();
  const auto init = InitRule::normal(o.initializer_range);
  gate = register_module(o.router_name, Linear(o.hidden_size, o.num_experts, o.router_bias, init, ctx.options));
  experts = register_module("experts", Experts(o, ctx));
  if (o.shared_expert_intermediate_size > 0) {  // Qwen2-MoE's names
    shared_experts = register_module(
        "shared_expert", SwigluMlp(o.hidden_size, o.shared_expert_intermediate_size, o.initializer_range, ctx));
    shared_expert_gate = register_module("shared_expert_gate", Linear(o.hidden_size, 1, false, init, ctx.options));
  } else if (o.n_shared_experts > 0) {
    shared_experts = register_module(
        "shared_experts",
        SwigluMlp(o.hidden_size, o.n_shared_experts * o.moe_intermediate_size, o.initializer_range, ctx));
  }
  tokens_.assign(o.num_experts, 0);
}

torch::Tensor MoeImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), N = B * T, E = o_.num_experts;
  const auto flat = x.reshape({N, C});
  const bool counting = is_training() && !recomputing();
  const bool balancing = is_training() && (o_.router_aux_loss_coef > 0 || o_.router_z_loss_coef > 0);

  Routing r;
  at::Tensor logits;
  {
    NoAutocast fp32(x.device().type());
    const auto w = on_shard(gate->weight).to(torch::kFloat).t();
    logits = gate->bias.defined() ? torch::addmm(on_shard(gate->bias).to(torch::kFloat), flat.to(torch::kFloat), w)
                                  : torch::mm(flat.to(torch::kFloat), w);
    // Made at construction (so a checkpoint can load it before any step), moved to the tokens' device once.
    if (bias_.defined() && bias_.device() != logits.device()) bias_ = bias_.to(logits.device());
    r = route(logits, o_, bias_);
  }
  auto chosen = r.experts;
  int64_t dropped = 0;
  if (o_.capacity_factor > 0) dropped = drop_over_capacity(chosen, r.weights, E, o_.capacity_factor);

  DispatchStats stats;
  auto ys = run_experts(
      flat, chosen, E, ctx_,
      [this](const at::Tensor& rows, const std::vector<int64_t>& counts) { return experts->forward(rows, counts); },
      &stats);  // [N, k, C]
  auto y = (ys * r.weights.to(ys.scalar_type()).unsqueeze(-1)).sum(1).view({B, T, C});
  if (shared_experts) {
    auto s = shared_experts(x);
    if (shared_expert_gate) s = torch::sigmoid(torch::nn::functional::linear(x, on_shard(shared_expert_gate->weight))) * s;
    y = y + s;
  }

  if (counting) {
    for (int64_t e = 0; e < E; ++e) tokens_[e] += stats.tokens_per_expert[e];
    dropped_ += dropped;
  }
  if (!balancing) return y;

  // Per-sequence balancing losses (header), the sums over a sequence's tokens
  // taken over its sequence-parallel shards and context-parallel ranks.
  at::Tensor aux;
  {
    NoAutocast fp32(x.device().type());
    const int cp = ctx_.cp_comm ? ctx_.cp_comm->size() : 1;
    const double tokens = double(T) * cp * (ctx_.sp() ? ctx_.tp : 1);
    aux = torch::zeros({}, logits.options());
    if (o_.router_aux_loss_coef > 0 && o_.aux_loss_form == AuxLossForm::GlobalBatch) {
      // This micro-batch's sums over its tokens (all shards of its sequences) and,
      // at backward, over every layer (GlobalAux): transformers' one loss.
      auto chose = torch::zeros({N, E}, logits.options());
      chose.scatter_add_(1, r.experts, torch::ones({N, o_.top_k}, logits.options()));
      const auto f = sequence_sums(chose, B, T).sum(0).detach();
      const auto P = sequence_sums(r.probs, B, T).sum(0);
      auto& cur = global_->current;
      if (counting) {
        if (!cur || std::find(cur->layers.begin(), cur->layers.end(), this) != cur->layers.end()) {
          cur = std::make_shared<GlobalAux>();  // the first layer of a new micro-batch
          cur->chose = torch::zeros({E}, logits.options());
          cur->probs = torch::zeros({E}, logits.options());
          cur->tokens = tokens * double(B);
          global_->taken.push_back(cur);
        }
        cur->layers.push_back(this);
        cur->chose.add_(f);
        cur->probs.add_(P.detach());
      }
      TORCH_CHECK(cur, "MoE balancing loss (global_batch): a recomputed forward before any forward");
      const double LN = double(o_.moe_layers) * cur->tokens;
      if (torch::GradMode::is_enabled() && P.requires_grad())
        y = AddGlobalAuxGrad::apply(y, P, c10::make_intrusive<GlobalHolder>(cur), c10::make_intrusive<ScaleHolder>(scale_),
                                    o_.router_aux_loss_coef * double(E) / (LN * LN));
    } else if (o_.router_aux_loss_coef > 0) {
      auto chose = torch::zeros({N, E}, logits.options());
      chose.scatter_add_(1, r.experts, torch::ones({N, o_.top_k}, logits.options()));
      const auto f = sequence_sums(chose, B, T) / tokens;
      const auto P = sequence_sums(r.probs, B, T) / tokens;
      aux = aux + o_.router_aux_loss_coef * (double(E) * (f.detach() * P).sum(-1)).mean();
    }
    if (o_.router_z_loss_coef > 0) {
      const auto z = sequence_sums(torch::logsumexp(logits, -1).square().unsqueeze(-1), B, T).squeeze(-1) / tokens;
      aux = aux + o_.router_z_loss_coef * z.mean();
    }
  }
  if (counting) aux_ = aux_.defined() ? aux_ + aux.detach() : aux.detach();
  if (!torch::GradMode::is_enabled() || !aux.requires_grad()) return y;
  return AddAuxGrad::apply(y, aux, c10::make_intrusive<ScaleHolder>(scale_));
}

at::Tensor MoeImpl::sequence_sums(const at::Tensor& v, int64_t B, int64_t T) const {
  at::Tensor sums;
  if (!ctx_.sp()) {
    sums = v.view({B, T, -1}).sum(1);
  } else {
    // This rank holds tokens [rank x B T, (rank + 1) x B T) of the B x T tp tokens in
    // [B, T] order (tp_ops.h): each one's sequence, its rows added there, the shards'
    // sums added over tp (all-reduce forward; backward the identity, as every tp
    // rank's balancing loss is the same one, like its LM loss).
    const int64_t N = B * T, whole = T * ctx_.tp;
    const auto seq = torch::arange(ctx_.rank * N, (ctx_.rank + 1) * N, v.options().dtype(torch::kLong)).div(whole, "floor");
    sums = reduce_from_tp(torch::zeros({B, v.size(-1)}, v.options()).index_add(0, seq, v), ctx_.comm);
  }
  return cp_sum(sums, ctx_.cp_comm);
}

at::Tensor MoeImpl::on_shard(const at::Tensor& w) const {
  return ctx_.sp() ? sum_grads_over_tp(w, {}, ctx_.comm).first : w;
}

MoeStats MoeImpl::take_stats() {
  MoeStats s;
  s.tokens_split_over_tp = ctx_.sp();
  s.layer = layer_;
  s.tokens_per_expert = tokens_;
  s.dropped = dropped_;
  s.aux_loss = aux_;
  if (global_ && !global_->taken.empty()) {
    // GlobalBatch: each micro-batch's one loss, in the statistics of the first layer taken.
    for (const auto& g : global_->taken) {
      const double LN = double(o_.moe_layers) * g->tokens;
      const auto v = o_.router_aux_loss_coef * double(o_.num_experts) * (g->chose * g->probs).sum() / (LN * LN);
      s.aux_loss = s.aux_loss.defined() ? s.aux_loss + v : v;
    }
    global_->taken.clear();
  }
  s.expert_bias = bias_;
  s.bias_update_speed = o_.bias_update_speed;
  tokens_.assign(o_.num_experts, 0);
  dropped_ = 0;
  aux_ = at::Tensor();
  return s;
}

}  // namespace nnstrain::models::common
