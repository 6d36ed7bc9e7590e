#include "models/common/kernels/rms_norm_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

namespace nnstrain::models::common::kernels {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Row r's 1/rms is stored for the backward: rstd [rows], in the accumulation type.
template <typename T>
void forward_rows(const T* x, const T* w, T* y, acc_t<T>* rstd, int64_t rows, int64_t C, double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / C), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * C;
      A ss = 0;
      for (int64_t j = 0; j < C; ++j) ss += A(xr[j]) * A(xr[j]);
      const A inv = A(1) / std::sqrt(ss / A(C) + A(eps));
      rstd[r] = inv;
      T* yr = y + r * C;
      for (int64_t j = 0; j < C; ++j) yr[j] = T(A(xr[j]) * inv * A(w[j]));
    }
  });
}

// gx_j = rstd (gy_j w_j - x_j rstd^2 sum_k(gy_k w_k x_k) / C); gw_j = sum_rows gy_j x_j rstd.
// The rows are cut into one block per thread, each block's gw summed in block order.
template <typename T>
void backward_rows(const T* x, const T* w, const T* gy, const acc_t<T>* rstd, T* gx, T* gw, int64_t rows, int64_t C) {
  using A = acc_t<T>;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 64));
  std::vector<A> partial(blocks * C, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      A* acc = partial.data() + b * C;
      for (int64_t r = rows * b / blocks; r < rows * (b + 1) / blocks; ++r) {
        const T *xr = x + r * C, *gr = gy + r * C;
        const A inv = rstd[r];
        A dot = 0;
        for (int64_t j = 0; j < C; ++j) dot += A(gr[j]) * A(w[j]) * A(xr[j]);
        const A k = inv * inv * dot / A(C);
        T* gxr = gx + r * C;
        for (int64_t j = 0; j < C; ++j) {
          gxr[j] = T(inv * (A(gr[j]) * A(w[j]) - A(xr[j]) * k));
          acc[j] += A(gr[j]) * A(xr[j]) * inv;
        }
      }
    }
  });
  for (int64_t j = 0; j < C; ++j) {
    A s = 0;
    for (int64_t b = 0; b < blocks; ++b) s += partial[b * C + j];
    gw[j] = T(s);
  }
}

class RmsNormCpu : public torch::autograd::Function<RmsNormCpu> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w_in,
                            double eps) {
    const auto x = x_in.contiguous(), w = w_in.contiguous();
    const int64_t C = x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
    auto y = at::empty_like(x);
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    auto rstd = at::empty({rows}, x.options().dtype(acc));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
      forward_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                             rstd.data_ptr<acc_t<scalar_t>>(), rows, C, eps);
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1], &rstd = s[2];
    const auto gy = grads[0].contiguous();
    const int64_t C = x.size(-1), rows = C == 0 ? 0 : x.numel() / C;
    auto gx = at::empty_like(x), gw = at::empty_like(w);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu_backward", [&] {
      backward_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), gy.data_ptr<scalar_t>(),
                              rstd.data_ptr<acc_t<scalar_t>>(), gx.data_ptr<scalar_t>(), gw.data_ptr<scalar_t>(),
                              rows, C);
    });
    return {gx, gw, at::Tensor()};
  }
};

}  // namespace

bool rms_norm_cpu_fits(const at::Tensor& x, const at::Tensor& weight) {
  const auto t = x.scalar_type();
  const bool floating = t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
  return x.is_cpu() && weight.is_cpu() && floating && weight.scalar_type() == t && weight.dim() == 1 &&
         x.dim() >= 1 && weight.size(0) == x.size(-1);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_cpu_fits(x, weight), "rms_norm_cpu: CPU x [..., C] and weight [C] of one floating dtype");
  return RmsNormCpu::apply(x, weight, eps);
}

}  // namespace nnstrain::models::common::kernels
