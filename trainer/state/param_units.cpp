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

namespace param_units_frozen {
// A tensor's storage resized in place (its views keep the same storage): as TrainingState's units.
void resize_storage(const at::Tensor& t, size_t nbytes) {
  const auto& s = t.storage();
  if (s.nbytes() == nbytes) return;
  s.set_data_ptr_noswap(nbytes ? s.allocator()->allocate(nbytes) : at::DataPtr(nullptr, t.device()));
  s.set_nbytes(nbytes);
}
}  // namespace param_units_frozen

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
  gather_frozen(unit, wait);
}

void ParameterUnits::shard_frozen(const std::vector<std::pair<int, at::Tensor>>& tensors) {
  if (!rt_ || !rt_->zero.backend || rt_->zero.size() < 2 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  const int64_t z = rt_->zero.size(), zr = rt_->zero.rank;
  frozen_.resize(static_cast<size_t>(blocks_) + 2);
  std::vector<std::vector<at::Tensor>> by_unit(frozen_.size());
  for (const auto& [u, t] : tensors) by_unit.at(static_cast<size_t>(u)).push_back(t);
  for (size_t u = 0; u < by_unit.size(); ++u) {
    if (by_unit[u].empty()) continue;
    // Byte offsets 16-aligned (views in any dtype), the whole padded to z chunks of 16-byte multiples.
    std::vector<int64_t> off;
    int64_t n = 0;
    for (const auto& t : by_unit[u]) {
      off.push_back(n);
      n += (t.numel() * t.element_size() + 15) / 16 * 16;
    }
    n = (n + 16 * z - 1) / (16 * z) * (16 * z);
    auto& fu = frozen_[u];
    fu.full = torch::zeros({n}, by_unit[u].front().options().dtype(torch::kUInt8));
    for (size_t k = 0; k < by_unit[u].size(); ++k) {
      auto& t = by_unit[u][k];
      const int64_t nb = t.numel() * t.element_size();
      auto bytes = fu.full.narrow(0, off[k], nb);
      bytes.copy_(t.contiguous().view({-1}).view(torch::kUInt8));
      t.set_data(bytes.view(t.scalar_type()).view(t.sizes()));  // the module's buffer now views the unit
    }
    fu.chunk = fu.full.narrow(0, zr * (n / z), n / z).clone();
    param_units_frozen::resize_storage(fu.full, 0);
    frozen_held_ += fu.chunk.numel();
    frozen_whole_ += n;
  }
}

// NCCL's rules: every rank of the ZeRO group holds the same frozen units (same
// model, same tensor/pipeline position), so all issue the same gathers, in the
// order gather() reaches them, and none is issued for a unit with no frozen tensor.
void ParameterUnits::gather_frozen(int unit, bool wait) {
  if (unit < 0 || static_cast<size_t>(unit) >= frozen_.size() || !frozen_[unit].full.defined()) return;
  auto& fu = frozen_[unit];
  auto& slot = fu.slot;
  torch::NoGradGuard no_grad;
  if (!slot.ready && !slot.work) {
    param_units_frozen::resize_storage(fu.full, fu.full.numel());
    gathered_bytes_ += fu.full.numel();
    slot.work = rt_->all_gather_async(rt_->zero, fu.full, fu.chunk, "frozen base all-gather (ZeRO-3, LoRA)");
  }
  if (wait && slot.work) {
    rt_->wait(slot.work, rt_->zero, "frozen base all-gather (ZeRO-3, LoRA)");
    slot.work.reset();
    slot.ready = true;
  }
}

void ParameterUnits::free_frozen(int unit) {
  if (unit < 0 || static_cast<size_t>(unit) >= frozen_.size() || !frozen_[unit].full.defined()) return;
  auto& fu = frozen_[unit];
  if (fu.slot.work) rt_->wait(fu.slot.work, rt_->zero, "frozen base all-gather (ZeRO-3, LoRA)");
  fu.slot = Slot{};
  param_units_frozen::resize_storage(fu.full, 0);
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
  if (!backward_) {
    for (auto b : state_.unit_buckets(i + 1)) free(b);
    free_frozen(i + 1);
  }
  if (!torch::GradMode::is_enabled() || !y.requires_grad()) return y;
  return BeforeBlockBackward::apply(y, static_cast<int64_t>(block), c10::make_intrusive<UnitsRef>(this));
}

void ParameterUnits::pre_backward(size_t block) {
  backward_ = true;
  const int i = static_cast<int>(block);
  gather(i + 1, true);
  for (int d = 1; d <= prefetch_ && i - d >= 0; ++d) gather(i + 1 - d, false);
  // Block i + 1's backward is over (its input's gradient is what reached here):
  // its frozen weights are not needed again (no gradient to wait for).
  if (i + 1 < blocks_) free_frozen(i + 2);
}

void ParameterUnits::reduced(size_t b) { free(b); }

void ParameterUnits::release_all() {
  for (size_t b = 0; b < slots_.size(); ++b)
    if (slots_[b].ready || slots_[b].work || state_.unit_allocated(b)) free(b);
  for (size_t u = 0; u < frozen_.size(); ++u) free_frozen(static_cast<int>(u));
  backward_ = false;
}

}  // namespace nnstrain::parallel
