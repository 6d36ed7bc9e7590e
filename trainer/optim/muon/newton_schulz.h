// Newton-Schulz orthogonalisation as torch.optim.Muon computes it (PyTorch's
// _zeropower_via_newtonschulz): the short side first, scaled to spectral norm
// at most one by the Frobenius norm, then ns_steps quintic iterations
// X <- a X + (b G + c G^2) X with G = X X^T. The input's dtype is the one it
// runs in (the caller casts: bf16 on CUDA as PyTorch, fp32 on the CPU).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

namespace nnstrain::optim::muon {

at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& abc, int steps, double eps);

// Its FLOPs on a rows x cols matrix: steps x (4 m^2 n + 2 m^3), m and n the short
// and long side (X X^T, the gram's square, their product with X).
inline double newton_schulz_flops(int64_t rows, int64_t cols, int steps) {
  const double m = double(rows < cols ? rows : cols), n = double(rows < cols ? cols : rows);
  return steps * (4 * m * m * n + 2 * m * m * m);
}

}  // namespace nnstrain::optim::muon
