#include "models/common/layers.h"

#include <algorithm>
#include <stdexcept>

#include "models/common/kernels/kernels.h"
#include "models/common/lm_loss.h"
#include "models/common/parallel_rng.h"
#include "models/common/tp_ops.h"
#include "models/common/weight_grad.h"

namespace nnstrain::models::common {

ShardingContext::Span ShardingContext::span(int64_t n, const std::string& what, int64_t unit) const {
  if (tp < 1 || rank < 0 || rank >= tp)
    throw std::invalid_argument("sharding context: rank " + std::to_string(rank) + " of tp " + std::to_string(tp));
  unit = std::max<int64_t>(1, unit);
  if (n % unit != 0 || n / unit < tp)
    throw std::invalid_argument("cannot split " + what + " of " + std::to_string(n) + " over " + std::to_string(tp) +
                                " tensor-parallel ranks in whole units of " + std::to_string(unit) +
                                (n % unit ? "" : ": fewer units than ranks"));
  const int64_t units = n / unit, base = units / tp, extra = units % tp;
  return {(rank * base + std::min<int64_t>(rank, extra)) * unit, (base + (rank < extra ? 1 : 0)) * unit};
}

int64_t ShardingContext::padded_vocab(int64_t vocab) const {
  if (tp <= 1) return vocab;
  const int64_t m = tp * std::max<int64_t>(1, vocab_multiple);
  return (vocab + m - 1) / m * m;
}

// ---- layouts -----------------------------------------------------------------

ParamLayout replicated_layout(const std::string& name, std::vector<int64_t> shape, InitRule init) {
  ParamLayout l;
  l.name = name;
  l.split.param = name;
  l.global_shape = shape;
  l.blocks = {{std::vector<int64_t>(shape.size(), 0), shape}};
  l.local_shape = shape;
  l.init = init;
  return l;
}

ParamLayout column_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape,
                          std::vector<int64_t> parts, int64_t unit, InitRule init) {
  ParamLayout l = replicated_layout(name, shape, init);
  l.split = {name, SplitStyle::Column, unit, parts.size() > 1 ? parts : std::vector<int64_t>{}};
  if (!ctx.parallel()) return l;  // the whole tensor as one block, fused parts or not
  l.blocks.clear();
  int64_t start = 0, rows = 0;
  for (auto part : parts) {
    const auto s = ctx.span(part, "'" + name + "' (column-parallel, size " + std::to_string(part) + ")", unit);
    Block b{std::vector<int64_t>(shape.size(), 0), shape};
    b.offsets[0] = start + s.offset;
    b.shape[0] = s.size;
    l.blocks.push_back(b);
    start += part;
    rows += s.size;
  }
  l.local_shape[0] = rows;
  return l;
}

ParamLayout row_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape, int64_t unit,
                       InitRule init) {
  ParamLayout l = replicated_layout(name, shape, init);
  l.split = {name, SplitStyle::Row, unit, {}};
  const auto s = ctx.span(shape.at(1), "'" + name + "' (row-parallel)", unit);
  l.blocks[0].offsets[1] = s.offset;
  l.blocks[0].shape[1] = s.size;
  l.local_shape[1] = s.size;
  return l;
}

ParamLayout expert_layout(const std::string& name, const ShardingContext& ctx, std::vector<int64_t> shape,
                          InitRule init) {
  ParamLayout l = replicated_layout(name, shape, init);
  l.split = {name, SplitStyle::Expert, 1, {}};
  const int64_t experts = shape.at(0);
  if (ctx.ep < 1 || experts % ctx.ep != 0)
    throw std::invalid_argument("'" + name + "': " + std::to_string(experts) +
                                " experts do not split over expert_parallel_size " + std::to_string(ctx.ep));
  const int64_t local = experts / ctx.ep;
  l.blocks[0].offsets[0] = ctx.ep_rank * local;
  l.blocks[0].shape[0] = local;
  l.local_shape[0] = local;
  return l;
}

// Rows [rank x rows, +rows) of the padded vocabulary, rows = padded / tp: only
// the true ones are allocated, so the last rank(s) may hold fewer rows and no
// padding row ever exists (nothing to mask, save or keep at zero).
ParamLayout vocab_layout(const std::string& name, const ShardingContext& ctx, int64_t vocab, int64_t dim,
                         InitRule init, int64_t* start) {
  ParamLayout l = replicated_layout(name, {vocab, dim}, init);
  l.split = {name, SplitStyle::Vocab, 1, {}};
  if (!ctx.parallel()) return l;
  const int64_t rows = ctx.padded_vocab(vocab) / ctx.tp;
  *start = ctx.rank * rows;
  const int64_t held = std::min(rows, vocab - *start);
  if (held < 1)
    throw std::invalid_argument("a vocabulary of " + std::to_string(vocab) + " padded to " +
                                std::to_string(ctx.padded_vocab(vocab)) + " leaves tensor-parallel rank " +
                                std::to_string(ctx.rank) + " of " + std::to_string(ctx.tp) + " no rows");
  l.blocks = {{{*start, 0}, {held, dim}}};
  l.local_shape = {held, dim};
  return l;
}

// ---- ShardedModule -------------------------------------------------------------

at::Tensor ShardedModule::add_param(const ParamLayout& layout, const c10::TensorOptions& opts) {
  at::Tensor t;
  if (opts.device().is_meta()) {
    t = torch::empty(layout.local_shape, opts);
  } else {
    torch::NoGradGuard no_grad;
    switch (layout.init.kind) {
      case InitRule::Kind::Normal: t = torch::empty(layout.local_shape, opts).normal_(0.0, layout.init.std); break;
      case InitRule::Kind::Ones: t = torch::ones(layout.local_shape, opts); break;
      default: t = torch::zeros(layout.local_shape, opts);
    }
  }
  return register_parameter(layout.name, t);
}

void ShardedModule::replace_parameter(const std::string& name, at::Tensor t) {
  auto* slot = parameters_.find(name);
  TORCH_CHECK(slot, "replace_parameter: no parameter '", name, "'");
  TORCH_CHECK(slot->sizes() == t.sizes(), "replace_parameter: '", name, "' is ", slot->sizes(), ", given ", t.sizes());
  t = t.detach();
  t.set_requires_grad(true);
  *slot = t;
  rebind();
}

void ShardedModule::freeze_parameter(const std::string& name) {
  auto* slot = parameters_.find(name);
  TORCH_CHECK(slot, "freeze_parameter: no parameter '", name, "'");
  at::Tensor t = *slot;
  t.set_requires_grad(false);
  parameters_.erase(name);
  register_buffer(name, t);
}

namespace {
// The adapter's weight and output term, if one is attached.
at::Tensor weight_of(const std::shared_ptr<LinearAdapter>& a, const at::Tensor& w) { return a ? a->weight(w) : w; }
// The base's linear: the adapter's where it computes one, else the layer's (deferrable) with its weight.
at::Tensor base_linear(const std::shared_ptr<LinearAdapter>& a, const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& bias = {}) {
  if (a)
    if (auto y = a->linear(x, bias); y.defined()) return y;
  return deferrable_linear(x, weight_of(a, w), bias);
}
at::Tensor plus_delta(const std::shared_ptr<LinearAdapter>& a, at::Tensor y, const at::Tensor& x) {
  if (!a) return y;
  auto d = a->delta(x);
  return d.defined() ? y + d : y;
}
}  // namespace

torch::Tensor to_sequence_shard(const ShardingContext& ctx, const torch::Tensor& x, int64_t batch) {
  return ctx.sp() ? scatter_to_seq(x, ctx.tp, ctx.rank, ctx.comm, batch) : x;
}

torch::Tensor region_dropout(const ShardingContext& ctx, const torch::Tensor& x, double p, bool training) {
  namespace F = torch::nn::functional;
  if (!training || p <= 0) return x;
  auto fork = ctx.sp() && ctx.rng ? ctx.rng->fork(x.device()) : ParallelRng::Fork();
  return F::dropout(x, F::DropoutFuncOptions().p(p).training(true));
}

namespace {
at::Tensor param_or_undefined(const torch::OrderedDict<std::string, at::Tensor>& params, const std::string& name) {
  const auto* p = params.find(name);
  return p ? *p : at::Tensor();
}
}  // namespace

// ---- plain layers ------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias, InitRule init, const c10::TensorOptions& opts) {
  layouts_.push_back(replicated_layout("weight", {out, in}, init));
  if (with_bias) layouts_.push_back(replicated_layout("bias", {out}, InitRule::zeros()));
  for (auto& l : layouts_) add_param(l, opts), l.owner = this;
  rebind();
}

void LinearImpl::rebind() {
  weight = param_or_undefined(parameters_, "weight");
  bias = param_or_undefined(parameters_, "bias");
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  return plus_delta(adapter, base_linear(adapter, x, weight, bias), x);
}

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim, InitRule init, const c10::TensorOptions& opts) {
  layouts_.push_back(replicated_layout("weight", {num, dim}, init));
  add_param(layouts_[0], opts);
  layouts_[0].owner = this;
  rebind();
}

void EmbeddingImpl::rebind() { weight = param_or_undefined(parameters_, "weight"); }

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& idx) { return torch::embedding(weight, idx); }

LayerNormImpl::LayerNormImpl(int64_t dim, bool with_bias, double eps_, const c10::TensorOptions& opts) : eps(eps_) {
  layouts_.push_back(replicated_layout("weight", {dim}, InitRule::ones()));
  if (with_bias) layouts_.push_back(replicated_layout("bias", {dim}, InitRule::zeros()));
  for (auto& l : layouts_) add_param(l, opts), l.owner = this;
  rebind();
}

LayerNormImpl::LayerNormImpl(int64_t dim, bool with_bias, double eps_, const ShardingContext& ctx)
    : LayerNormImpl(dim, with_bias, eps_, ctx.options) {
  if (ctx.sp()) sp_comm_ = ctx.comm;
}

void LayerNormImpl::rebind() {
  weight = param_or_undefined(parameters_, "weight");
  bias = param_or_undefined(parameters_, "bias");
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (!sp_comm_) return kernels::layer_norm(x, weight, bias, eps);
  // On a sequence shard: weight and bias gradients summed over the group, together.
  const auto [w, b] = sum_grads_over_tp(weight, bias, sp_comm_);
  return kernels::layer_norm(x, w, b, eps);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const c10::TensorOptions& opts) : eps(eps_) {
  layouts_.push_back(replicated_layout("weight", {dim}, InitRule::ones()));
  add_param(layouts_[0], opts);
  layouts_[0].owner = this;
  rebind();
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const ShardingContext& ctx) : RMSNormImpl(dim, eps_, ctx.options) {
  if (ctx.sp()) sp_comm_ = ctx.comm;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const ShardingContext& ctx, bool offset) : eps(eps_), unit_offset(offset) {
  layouts_.push_back(replicated_layout("weight", {dim}, offset ? InitRule::zeros() : InitRule::ones()));
  add_param(layouts_[0], ctx.options);
  layouts_[0].owner = this;
  rebind();
  if (ctx.sp()) sp_comm_ = ctx.comm;
}

void RMSNormImpl::rebind() { weight = param_or_undefined(parameters_, "weight"); }

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // Hugging Face's LlamaRMSNorm (normalised in fp32, cast back, times the weight).
  const auto w = sp_comm_ ? sum_grads_over_tp(weight, {}, sp_comm_).first : weight;  // as LayerNorm's
  if (unit_offset) {  // Gemma3RMSNorm's op sequence: all in fp32, then the input's dtype
    const auto xf = x.to(torch::kFloat);
    const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return (normed * (w.to(torch::kFloat) + 1.0)).to(x.scalar_type());
  }
  return kernels::rms_norm(x, w, eps);
}

// ---- tensor-parallel layers ----------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ShardingContext& ctx, int64_t in,
                                                   std::vector<int64_t> out_parts, int64_t unit, bool with_bias,
                                                   InitRule init)
    : ctx_(ctx) {
  int64_t out = 0;
  for (auto p : out_parts) out += p;
  layouts_.push_back(column_layout("weight", ctx, {out, in}, out_parts, unit, init));
  if (with_bias) layouts_.push_back(column_layout("bias", ctx, {out}, out_parts, unit, InitRule::zeros()));
  for (auto& l : layouts_) add_param(l, ctx.options), l.owner = this;
  rebind();
}

void ColumnParallelLinearImpl::rebind() {
  weight = param_or_undefined(parameters_, "weight");
  bias = param_or_undefined(parameters_, "bias");
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  if (!ctx_.parallel()) return plus_delta(adapter, base_linear(adapter, x, weight, bias), x);
  // (Under sequence parallelism a QLoRA weight is dequantized once and kept for backward.)
  if (ctx_.sp()) return plus_delta(adapter, sequence_parallel_linear(x, weight_of(adapter, weight), bias, ctx_.tp, ctx_.comm), x);
  const auto xt = copy_to_tp(x, ctx_.comm);
  return plus_delta(adapter, base_linear(adapter, xt, weight, bias), xt);
}

RowParallelLinearImpl::RowParallelLinearImpl(const ShardingContext& ctx, int64_t in, int64_t out, int64_t unit,
                                             bool with_bias, InitRule init)
    : ctx_(ctx) {
  layouts_.push_back(row_layout("weight", ctx, {out, in}, unit, init));
  if (with_bias) layouts_.push_back(replicated_layout("bias", {out}, InitRule::zeros()));
  for (auto& l : layouts_) add_param(l, ctx.options), l.owner = this;
  rebind();
}

void RowParallelLinearImpl::rebind() {
  weight = param_or_undefined(parameters_, "weight");
  bias = param_or_undefined(parameters_, "bias");
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  if (!ctx_.parallel()) return plus_delta(adapter, base_linear(adapter, x, weight, bias), x);
  const auto partial = plus_delta(adapter, base_linear(adapter, x, weight), x);  // the adapter's part summed with the layer's
  // Under sequence parallelism the bias is added to the shard, its gradient whole from the gathered one.
  if (ctx_.sp()) return reduce_scatter_to_seq(partial, ctx_.tp, ctx_.comm, bias);
  auto y = reduce_from_tp(partial, ctx_.comm);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const ShardingContext& ctx, int64_t vocab, int64_t dim,
                                                       InitRule init)
    : ctx_(ctx) {
  layouts_.push_back(vocab_layout("weight", ctx, vocab, dim, init, &start_));
  add_param(layouts_[0], ctx.options);
  layouts_[0].owner = this;
  rebind();
}

void VocabParallelEmbeddingImpl::rebind() { weight = param_or_undefined(parameters_, "weight"); }

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& idx) {
  if (!ctx_.parallel()) return torch::embedding(weight, idx);
  const int64_t rows = weight.size(0);
  auto outside = (idx < start_) | (idx >= start_ + rows);
  auto local = (idx - start_).masked_fill(outside, 0);
  auto e = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return ctx_.sp() ? reduce_scatter_to_seq(e, ctx_.tp, ctx_.comm) : reduce_from_tp(e, ctx_.comm);
}

// ---- LM head ---------------------------------------------------------------------

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), targets);
}

torch::Tensor LmHead::logits(const torch::Tensor& hidden, const torch::Tensor& weight) const {
  return torch::nn::functional::linear(hidden, weight);
}

torch::Tensor LmHead::loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                           int64_t chunk_size) const {
  auto h = hidden.reshape({-1, hidden.size(-1)});
  auto t = targets.reshape({-1});
  if (chunk_size > 0) return chunked_linear_cross_entropy(h, weight, t, chunk_size);
  count_plain_loss_forward();
  return cross_entropy(deferrable_linear(h, weight), t);
}

ParallelLmHeadImpl::ParallelLmHeadImpl(const ShardingContext& ctx, int64_t vocab, int64_t dim, bool own_weight,
                                       InitRule init)
    : ctx_(ctx), vocab_(vocab) {
  auto l = vocab_layout("weight", ctx, vocab, dim, init, &start_);
  if (own_weight) {
    layouts_.push_back(l);
    add_param(layouts_[0], ctx.options);
    layouts_[0].owner = this;
  }
  rebind();
}

void ParallelLmHeadImpl::rebind() { weight = param_or_undefined(parameters_, "weight"); }

torch::Tensor ParallelLmHeadImpl::loss(const torch::Tensor& hidden, const torch::Tensor& w,
                                       const torch::Tensor& targets, int64_t chunk_size, int64_t ignore_index) const {
  return loss(hidden, w, targets, chunk_size > 0 ? LossKind::Chunked : LossKind::Plain, chunk_size, ignore_index);
}

torch::Tensor ParallelLmHeadImpl::loss(const torch::Tensor& hidden, const torch::Tensor& w,
                                       const torch::Tensor& targets, LossKind kind, int64_t chunk_size,
                                       int64_t ignore_index) const {
  // Under sequence parallelism the hidden states arrive as this rank's tokens:
  // gathered whole (their gradient reduce-scattered back), as copy_to_tp would.
  auto h = (ctx_.sp() ? gather_from_seq(hidden, ctx_.tp, ctx_.comm) : hidden).reshape({-1, hidden.size(-1)});
  auto t = targets.reshape({-1});
  const auto capped = [&](const torch::Tensor& l) { return softcap > 0 ? torch::tanh(l / softcap) * softcap : l; };
  if (objective) {
    if (ctx_.parallel() && !ctx_.sp()) h = copy_to_tp(h, ctx_.comm);
    auto logits = capped(deferrable_linear(h, w));
    const auto acc = logits.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    TokenScores s;
    s.counted = t.ne(ignore_index).reshape(targets.sizes());
    // The plain form, whole or over the split vocabulary; the reference's no-grad
    // forwards are the alignment's to count (its run record), not the policy's loss.
    if (torch::GradMode::is_enabled()) count_plain_loss_forward();
    if (!ctx_.parallel()) {
      s.nll = torch::nn::functional::cross_entropy(
          logits.to(acc), t,
          torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index).reduction(torch::kNone));
      s.mean_logits = logits.detach().to(acc).mean(-1);
    } else {
      const int64_t held = w.size(0);
      s.nll = vocab_parallel_token_nll(logits, t, start_, held, ignore_index, ctx_.comm);
      torch::NoGradGuard no_grad;
      auto sum = logits.detach().narrow(1, 0, held).to(acc).sum(-1).contiguous();
      ctx_.comm->all_reduce(sum);  // every rank's vocabulary piece
      s.mean_logits = sum / double(vocab_);
    }
    s.nll = s.nll.reshape(targets.sizes());
    s.mean_logits = s.mean_logits.reshape(targets.sizes());
    return objective->loss(s);
  }
  if (!ctx_.parallel()) {
    if (kind == LossKind::Fused) return fused_linear_cross_entropy(h, w, t, chunk_size, ignore_index, softcap);
    if (kind == LossKind::Chunked) return chunked_linear_cross_entropy(h, w, t, chunk_size, ignore_index, softcap);
    count_plain_loss_forward();
    return torch::nn::functional::cross_entropy(
        capped(deferrable_linear(h, w)).to(torch::kFloat32), t,
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ignore_index));
  }
  const int64_t held = w.size(0);
  if (!ctx_.sp()) h = copy_to_tp(h, ctx_.comm);
  if (kind == LossKind::Fused)
    return fused_vocab_parallel_cross_entropy(h, w, t, start_, held, chunk_size, ignore_index, ctx_.comm, softcap);
  if (kind == LossKind::Chunked)
    return chunked_vocab_parallel_cross_entropy(h, w, t, start_, held, chunk_size, ignore_index, ctx_.comm, softcap);
  return vocab_parallel_cross_entropy(capped(deferrable_linear(h, w)), t, start_, held, ignore_index, ctx_.comm);
}

torch::Tensor ParallelLmHeadImpl::logits(const torch::Tensor& hidden, const torch::Tensor& w) const {
  if (softcap > 0) {
    const auto l = ParallelLmHeadImpl::uncapped_logits(hidden, w);
    return torch::tanh(l / softcap) * softcap;
  }
  return uncapped_logits(hidden, w);
}

torch::Tensor ParallelLmHeadImpl::uncapped_logits(const torch::Tensor& hidden, const torch::Tensor& w) const {
  if (!ctx_.parallel()) return torch::nn::functional::linear(hidden, w);
  // Evaluation only: no gradient through the gather. Every rank's piece is
  // padded to padded_vocab / tp columns for the gather; the padding sits at the
  // end of the padded vocabulary, so the true vocabulary is a prefix.
  auto local = torch::nn::functional::linear(ctx_.sp() ? gather_from_seq(hidden, ctx_.tp, ctx_.comm) : hidden, w);
  const int64_t rows = ctx_.padded_vocab(vocab_) / ctx_.tp;
  if (local.size(-1) < rows) local = torch::constant_pad_nd(local, {0, rows - local.size(-1)});
  auto all = ctx_.comm->all_gather(local.contiguous());  // [tp, ..., rows]
  auto moved = all.movedim(0, -2);          // [..., tp, V/tp]
  auto sizes = local.sizes().vec();
  sizes.back() = -1;
  return moved.reshape(sizes).narrow(-1, 0, vocab_);
}

}  // namespace nnstrain::models::common
