#include "models/common/init.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "base/hash.h"
#include "models/model.h"

namespace nnstrain::models::common {

namespace {

using base::fnv1a;
using base::splitmix64;

constexpr int64_t kBlockElements = int64_t{1} << 20;

}  // namespace

int64_t init_rows_per_block(const std::vector<int64_t>& global_shape) {
  int64_t row = 1;
  for (size_t d = 1; d < global_shape.size(); ++d) row *= global_shape[d];
  return std::max<int64_t>(1, kBlockElements / std::max<int64_t>(1, row));
}

void fill_fresh(const ParamLayout& layout, at::Tensor& local, uint64_t seed) {
  int64_t held_rows = 0;
  for (const auto& b : layout.blocks) held_rows += b.shape.empty() ? 1 : b.shape[0];
  if (layout.global_shape.empty()) {  // a scalar: one block of one value
    if (layout.init.kind == InitRule::Kind::Ones) local.fill_(1.0);
    if (layout.init.kind != InitRule::Kind::Normal) return;
  }
  switch (layout.init.kind) {
    case InitRule::Kind::Zeros: return;  // materialise allocated zeros
    case InitRule::Kind::Ones: local.narrow(0, 0, held_rows).fill_(1.0); return;
    case InitRule::Kind::Normal: break;
  }
  auto shape = layout.global_shape.empty() ? std::vector<int64_t>{1} : layout.global_shape;
  const int64_t per = init_rows_per_block(shape);
  const uint64_t name_seed = splitmix64(seed ^ splitmix64(fnv1a(layout.name)));
  auto flat_local = layout.global_shape.empty() ? local.view({1}) : local;
  int64_t local_row = 0;
  for (const auto& b : layout.blocks) {
    const auto bshape = b.shape.empty() ? std::vector<int64_t>{1} : b.shape;
    const auto boff = b.offsets.empty() ? std::vector<int64_t>{0} : b.offsets;
    const int64_t r0 = boff[0], r1 = r0 + bshape[0];
    for (int64_t k = r0 / per; k * per < r1; ++k) {
      const int64_t g0 = k * per, g1 = std::min(g0 + per, shape[0]);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(splitmix64(name_seed + static_cast<uint64_t>(k)));
      auto bshape_full = shape;
      bshape_full[0] = g1 - g0;
      auto block = torch::empty(bshape_full, torch::kFloat32).normal_(0.0, layout.init.std, gen);
      const int64_t o0 = std::max(g0, r0), o1 = std::min(g1, r1);
      auto src = block.narrow(0, o0 - g0, o1 - o0);
      for (size_t d = 1; d < shape.size(); ++d)
        src = src.narrow(static_cast<int64_t>(d), boff[d], bshape[d]);
      flat_local.narrow(0, local_row + (o0 - r0), o1 - o0).copy_(src);
    }
    local_row += bshape[0];
  }
}

void materialise(CausalLM& model, const c10::Device& device, const Filler& fill, const Filler& after) {
  torch::NoGradGuard no_grad;
  for (const auto& l : model.param_layouts()) {
    auto t = torch::zeros(l.local_shape, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    fill(l, t);
    if (after) after(l, t);
    l.owner->replace_parameter(l.name.substr(l.name.rfind('.') + 1), t);
  }
}

void materialise_fresh(CausalLM& model, const c10::Device& device, uint64_t seed, const Filler& after) {
  materialise(model, device, [seed](const ParamLayout& l, at::Tensor& t) { fill_fresh(l, t, seed); }, after);
}

}  // namespace nnstrain::models::common
