#include "trainer/state/param_units.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct UnitsRef : torch::CustomClassHolder {
  explicit UnitsRef(ParameterUnits* u) : units(u) {}
  ParameterUnits* units;  // the trainer's, alive for the whole run
};

// Identity on block i's output whose backward runs before the block's: there
// the block's parameters are gathered again.
struct BeforeBlockBackward : torch::autograd::Function<BeforeBlockBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, int64_t block,
                            const c10::intrusive_ptr<UnitsRef>& units) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["units"] = c10::IValue::make_capsule(units);
    return y.view_as(y);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto* ref = dynamic_cast<UnitsRef*>(ctx->saved_data["units"].toCapsule().get());
    ref->units->pre_backward(static_cast<size_t>(ctx->saved_data["block"].toInt()));
    return {g[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::vector<int> parameter_units(const models::CausalLM& model) {
  const int blocks = static_cast<int>(model.num_layers());
  std::vector<int> units;
  bool after_blocks = false;
  for (const auto& l : model.param_layouts()) {
    const int b = model.block_of(l.name);
    after_blocks = after_blocks || b >= 0;
    units.push_back(b >= 0 ? 1 + b : after_blocks ? blocks + 1 : 0);
  }
  return units;
}

dist::Group& zero_group_of(const FlatLayout::Bucket& bucket, dist::Runtime& rt) {
  return bucket.expert && rt.ep.size() > 1 ? rt.ezero : rt.zero;
}

ParameterUnits::ParameterUnits(TrainingState& state, dist::Runtime* rt, int blocks, int prefetch)
    : state_(state), rt_(rt), blocks_(blocks), prefetch_(prefetch) {
  slots_.resize(state_.layout().buckets.size());
}

dist::Group& ParameterUnits::group(size_t b) const { return zero_group_of(state_.layout().buckets[b], *rt_); }

bool ParameterUnits::communicates(size_t b) const { return rt_ && group(b).backend; }

void ParameterUnits::gather(int unit, bool wait) {
  for (auto b : state_.unit_buckets(unit)) gather_bucket(b, wait);
}

void ParameterUnits::gather_bucket(size_t b, bool wait) {
  auto& slot = slots_[b];
  torch::NoGradGuard no_grad;
  if (!slot.ready && !slot.work) {
    state_.allocate_unit(b);
    auto& full = state_.unit_param(b);
    gathered_bytes_ += full.numel() * full.element_size();
    // The chunk on the device (copied from the host under parameter offload), alive until the gather is done.
    slot.input = state_.gather_input(b);
    if (communicates(b)) {
      slot.work = rt_->all_gather_async(group(b), full, slot.input, "parameter all-gather (ZeRO-3)");
    } else {
      full.copy_(slot.input);  // one rank's chunk is the whole unit
      slot.input = at::Tensor();
      slot.ready = true;
    }
  }
  if (wait && slot.work) {
    rt_->wait(slot.work, group(b), "parameter all-gather (ZeRO-3)");
    slot.work.reset();
    slot.input = at::Tensor();
    slot.ready = true;
  }
}

void ParameterUnits::free(size_t b) {
  auto& slot = slots_[b];
  if (slot.work) rt_->wait(slot.work, group(b), "parameter all-gather (ZeRO-3)");  // never free under a gather
  slot = Slot{};
  state_.free_unit(b);
}

void ParameterUnits::begin_forward() {
  backward_ = false;
  gather(0, false);
  gather(blocks_ + 1, false);
  gather(0, true);
  gather(blocks_ + 1, true);
}

torch::Tensor ParameterUnits::before(size_t block, const torch::Tensor& x) {
  const int i = static_cast<int>(block);
  gather(i + 1, true);
  if (!backward_)  // a recomputation in backward runs after pre_backward gathered it
    for (int d = 1; d <= prefetch_ && i + d < blocks_; ++d) gather(i + 1 + d, false);
  return x;
}

torch::Tensor ParameterUnits::after(size_t block, const torch::Tensor& y) {
  const int i = static_cast<int>(block);
  if (!backward_)
    for (auto b : state_.unit_buckets(i + 1)) free(b);
  if (!torch::GradMode::is_enabled() || !y.requires_grad()) return y;
  return BeforeBlockBackward::apply(y, static_cast<int64_t>(block), c10::make_intrusive<UnitsRef>(this));
}

void ParameterUnits::pre_backward(size_t block) {
  backward_ = true;
  const int i = static_cast<int>(block);
  gather(i + 1, true);
  for (int d = 1; d <= prefetch_ && i - d >= 0; ++d) gather(i + 1 - d, false);
}

void ParameterUnits::reduced(size_t b) { free(b); }

void ParameterUnits::release_all() {
  for (size_t b = 0; b < slots_.size(); ++b)
    if (slots_[b].ready || slots_[b].work || state_.unit_allocated(b)) free(b);
  backward_ = false;
}

}  // namespace nnstrain::parallel
