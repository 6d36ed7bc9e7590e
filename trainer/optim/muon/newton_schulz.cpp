#include "trainer/optim/muon/newton_schulz.h"

#include <torch/torch.h>

namespace nnstrain::optim::muon {

at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& abc, int steps, double eps) {
  const auto [a, b, c] = abc;
  const bool tall = g.size(0) > g.size(1);
  auto x = tall ? g.t() : g;
  x = x / x.norm().clamp_min(eps);
  for (int i = 0; i < steps; ++i) {
    const auto gram = torch::mm(x, x.t());
    const auto update = torch::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = torch::addmm(x, update, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

}  // namespace nnstrain::optim::muon
