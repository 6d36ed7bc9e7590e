#include "models/lora/lora_linear.h"

#include <atomic>
#include <cmath>
#include <optional>

#include "models/common/tp_ops.h"

namespace nnstrain::models::lora {

using common::ParamLayout;

LoraWeightImpl::LoraWeightImpl(ParamLayout layout, const c10::TensorOptions& opts) : layout_(std::move(layout)) {
  add_param(layout_, opts);
  layout_.owner = this;
  rebind();
}

void LoraWeightImpl::rebind() { weight = parameters_["weight"]; }

namespace {
std::atomic<int> adapters_off{0};

// The layouts of A [r, in] and B [out, r] beside a base weight laid out as `w`.
std::pair<ParamLayout, ParamLayout> adapter_layouts(BaseKind kind, const ParamLayout& w, int64_t r) {
  const int64_t out = w.global_shape.at(0), in = w.global_shape.at(1);
  auto a = common::replicated_layout("weight", {r, in}, common::InitRule::zeros());
  auto b = common::replicated_layout("weight", {out, r}, common::InitRule::zeros());
  if (kind == BaseKind::Column && w.split_here()) {  // B: the base's output rows, block for block
    b.split = w.split;
    b.split.param = "weight";
    b.blocks = w.blocks;
    for (auto& blk : b.blocks) blk.offsets[1] = 0, blk.shape[1] = r;
    b.local_shape = {w.local_shape.at(0), r};
  } else if (kind == BaseKind::Row && w.split_here()) {  // A: the base's input columns
    a.split = w.split;
    a.split.param = "weight";
    a.blocks = {{{0, w.blocks.at(0).offsets.at(1)}, {r, w.blocks.at(0).shape.at(1)}}};
    a.local_shape = {r, w.local_shape.at(1)};
  }
  return {a, b};
}

}  // namespace

at::Tensor local_piece(const at::Tensor& global, const ParamLayout& l) {
  std::vector<at::Tensor> parts;
  for (const auto& blk : l.blocks) {
    auto t = global;
    for (size_t d = 0; d < blk.shape.size(); ++d) t = t.narrow(d, blk.offsets[d], blk.shape[d]);
    parts.push_back(t);
  }
  return parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
}

AdaptersOff::AdaptersOff() { ++adapters_off; }
AdaptersOff::~AdaptersOff() { --adapters_off; }
bool AdaptersOff::active() { return adapters_off.load() > 0; }

LoraAdapter::LoraAdapter(const AdapterShape& shape, const common::ShardingContext& ctx, const ParamLayout& base_weight,
                         const c10::TensorOptions& opts)
    : shape_(shape), ctx_(ctx) {
  auto [a, b] = adapter_layouts(shape.kind, base_weight, shape.r);
  A = LoraWeight(a, opts);
  B = LoraWeight(b, opts);
}

void LoraAdapter::init(const std::string& kind, uint64_t seed) {
  torch::NoGradGuard no_grad;
  const auto& la = A->layout();
  auto gen = at::detail::createCPUGenerator(seed);
  auto global = torch::empty(la.global_shape, torch::kFloat32);
  if (kind == "gaussian") {
    global.normal_(0.0, 1.0 / static_cast<double>(shape_.r), gen);
  } else {  // kaiming_uniform_(a = sqrt(5)): bound = gain x sqrt(3 / fan_in), gain = sqrt(2 / (1 + 5))
    const double bound = std::sqrt(2.0 / 6.0) * std::sqrt(3.0 / static_cast<double>(la.global_shape.at(1)));
    global.uniform_(-bound, bound, gen);
  }
  A->weight.copy_(local_piece(global, la));
  B->weight.zero_();
}

at::Tensor LoraAdapter::weight(const at::Tensor& stored) const {
  return quantized() ? dequantize_nf4(quantized_, compute_) : stored;
}

namespace {
// The NF4 base's matmul. The graph holds the adapter by address: a model
// outlives the backward of its own forward.
struct Nf4LinearFunction : torch::autograd::Function<Nf4LinearFunction> {
  // The frozen bias travels as an optional, not as an input: autograd asks every
  // tensor input for its device, and a layer without one has an undefined bias.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias, int64_t adapter) {
    ctx->saved_data["adapter"] = adapter;
    const auto w = reinterpret_cast<const LoraAdapter*>(adapter)->weight({});
    return at::linear(x, w, bias);  // w freed here, not saved
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto* a = reinterpret_cast<const LoraAdapter*>(ctx->saved_data["adapter"].toInt());
    return {grad[0].matmul(a->weight({})), at::Tensor(), at::Tensor()};  // the frozen bias has no gradient
  }
};
}  // namespace

at::Tensor LoraAdapter::linear(const at::Tensor& x, const at::Tensor& bias) const {
  if (!quantized()) return {};
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  return Nf4LinearFunction::apply(x, b, reinterpret_cast<int64_t>(this));
}

// The input's dropout mask as one process draws it (torch's dropout: bernoulli_
// over the input's shape, divided by 1 - p) from the generator every tp rank
// holds alike: drawn over the whole input, this rank's part taken, so the
// draws (and how many) are one process's. A row-parallel adapter's input holds
// this rank's columns; a column-parallel one's under sequence parallelism this
// rank's run of the B x T tokens (tp_ops.cpp).
at::Tensor LoraAdapter::dropout_mask(const at::Tensor& x) const {
  const double keep = 1.0 - shape_.dropout;
  const auto& la = A->layout();
  auto sizes = x.sizes().vec();
  const int64_t width = sizes.back(), tokens = x.numel() / width;
  const bool seq = ctx_.sp() && shape_.kind == BaseKind::Column;
  sizes.back() = la.global_shape.at(1);
  if (seq) sizes.at(1) *= ctx_.tp;
  auto mask = torch::empty(sizes, x.options()).bernoulli_(keep).div_(keep);
  if (sizes.back() != width) mask = mask.narrow(-1, la.blocks.at(0).offsets.at(1), width);
  if (seq) mask = mask.reshape({-1, width}).narrow(0, ctx_.rank * tokens, tokens).view(x.sizes());
  return mask;
}

at::Tensor LoraAdapter::delta(const at::Tensor& x) {
  if (AdaptersOff::active()) return {};
  namespace F = torch::nn::functional;
  auto in = x;
  if (shape_.dropout > 0 && A->is_training()) in = in * dropout_mask(in);
  at::Tensor a = A->weight, b = B->weight;
  const bool tp = ctx_.parallel();
  // The replicated matrix's gradient is partial on each rank: summed over the group.
  if (tp && shape_.kind == BaseKind::Column) a = common::sum_grads_over_tp(a, {}, ctx_.comm).first;
  if (tp && shape_.kind == BaseKind::Row) b = common::sum_grads_over_tp(b, {}, ctx_.comm).first;
  auto h = F::linear(in, a);
  if (tp && shape_.kind == BaseKind::Column && ctx_.sp()) h = common::gather_from_seq(h, ctx_.tp, ctx_.comm);
  return F::linear(h, b) * shape_.scale;
}

}  // namespace nnstrain::models::lora
