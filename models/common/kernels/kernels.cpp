#include "models/common/kernels/kernels.h"

#include "models/common/kernels/rms_norm_cpu.h"

#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace nnstrain::models::common::kernels {
namespace {

std::atomic<int> g_impl{-1};  // -1: not read from the environment yet
std::array<std::atomic<int64_t>, kNumKernels> g_fused{}, g_composite{};

// Which form kernel k runs on t, counted.
bool use_fused(Kernel k, const at::Tensor& t, bool auto_on_every_device) {
  bool fused = false;
  switch (impl()) {
    case Impl::Composite: fused = false; break;
    case Impl::Fused: fused = true; break;
    default: fused = auto_on_every_device || t.is_cuda();
  }
  (fused ? g_fused : g_composite)[static_cast<int>(k)].fetch_add(1, std::memory_order_relaxed);
  return fused;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// t * cos + rotate_half(t) * sin written over t: by halves, t1' = t1 c1 - t2 s1,
// t2' = t2 c2 + t1 s2 (the composite's sums, in cos's dtype, rounded once into
// t). Backward needs only cos and sin: the transposed rotation of the gradient.
class RotaryInPlace : public torch::autograd::Function<RotaryInPlace> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    const int64_t half = t.size(-1) / 2;
    const auto t1 = t.narrow(-1, 0, half), t2 = t.narrow(-1, half, half);
    const auto c1 = cos.narrow(-1, 0, half), c2 = cos.narrow(-1, half, half);
    const auto s1 = sin.narrow(-1, 0, half), s2 = sin.narrow(-1, half, half);
    auto n1 = t1 * c1 - t2 * s1;  // promoted to cos's dtype when t is 16-bit
    auto n2 = t2 * c2 + t1 * s2;
    t1.copy_(n1);
    t2.copy_(n2);
    ctx->mark_dirty({t});
    ctx->save_for_backward({cos, sin});
    return t;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const int64_t half = g[0].size(-1) / 2;
    const auto g1 = g[0].narrow(-1, 0, half), g2 = g[0].narrow(-1, half, half);
    const auto c1 = cos.narrow(-1, 0, half), c2 = cos.narrow(-1, half, half);
    const auto s1 = sin.narrow(-1, 0, half), s2 = sin.narrow(-1, half, half);
    auto gt = torch::cat({g1 * c1 + g2 * s2, g2 * c2 - g1 * s1}, -1).to(g[0].scalar_type());
    return {gt, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

Impl parse_impl(const std::string& s) {
  if (s == "auto" || s.empty()) return Impl::Auto;
  if (s == "composite") return Impl::Composite;
  if (s == "fused") return Impl::Fused;
  throw std::invalid_argument("NNSTRAIN_KERNELS: expected auto, composite or fused, got '" + s + "'");
}

Impl impl() {
  int v = g_impl.load();
  if (v < 0) {
    const char* env = std::getenv("NNSTRAIN_KERNELS");
    v = static_cast<int>(parse_impl(env ? env : ""));
    int expected = -1;
    g_impl.compare_exchange_strong(expected, v);
    v = g_impl.load();
  }
  return static_cast<Impl>(v);
}

void set_impl(Impl i) { g_impl.store(static_cast<int>(i)); }

const char* impl_name(Impl i) {
  switch (i) {
    case Impl::Composite: return "composite";
    case Impl::Fused: return "fused";
    default: return "auto";
  }
}

const char* kernel_name(Kernel k) {
  static const char* const names[kNumKernels] = {"rms_norm", "layer_norm", "gelu", "swiglu", "rotary"};
  return names[static_cast<int>(k)];
}

KernelCalls kernel_calls() {
  KernelCalls c;
  for (int k = 0; k < kNumKernels; ++k) {
    c.fused[k] = g_fused[k].load(std::memory_order_relaxed);
    c.composite[k] = g_composite[k].load(std::memory_order_relaxed);
  }
  return c;
}

namespace composite {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // Normalise in fp32 as Hugging Face's LlamaRMSNorm does, then cast back.
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  // In fp32 (fp64 for fp64), as the native kernel accumulates.
  const auto acc = x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto xf = x.to(acc);
  auto mean = xf.mean(-1, true);
  auto centred = xf - mean;
  auto y = (centred * torch::rsqrt(centred.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}

at::Tensor gelu(const at::Tensor& x, bool tanh_approximation) {
  if (tanh_approximation)
    return 0.5 * x * (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
  return 0.5 * x * (1.0 + torch::erf(x * M_SQRT1_2));
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return torch::silu(gate) * up; }

at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  // Hugging Face's rotate_half: the two halves of head_dim are the pairs.
  const auto tf = t.to(at::promote_types(t.scalar_type(), cos.scalar_type()));
  const int64_t half = tf.size(-1) / 2;
  const auto rotated = torch::cat({-tf.narrow(-1, half, half), tf.narrow(-1, 0, half)}, -1);
  return (tf * cos + rotated * sin).to(t.scalar_type());
}

}  // namespace composite

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // The CPU's fused form is ours (rms_norm_cpu.h), where it takes the operands.
  const bool cpu = rms_norm_cpu_fits(x, weight);
  if (!use_fused(Kernel::RmsNorm, x, cpu)) return composite::rms_norm(x, weight, eps);
  if (cpu) return rms_norm_cpu(x, weight, eps);
  return std::get<0>(at::_fused_rms_norm(x, {x.size(-1)}, weight, eps));
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps) {
  auto sum = x + residual;
  return {rms_norm(sum, weight, eps), sum};
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  if (!use_fused(Kernel::LayerNorm, x, true)) return composite::layer_norm(x, weight, bias, eps);
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias, double eps) {
  auto sum = x + residual;
  return {layer_norm(sum, weight, bias, eps), sum};
}

at::Tensor gelu(const at::Tensor& x, bool tanh_approximation) {
  if (!use_fused(Kernel::Gelu, x, true)) return composite::gelu(x, tanh_approximation);
  return torch::gelu(x, tanh_approximation ? "tanh" : "none");
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!use_fused(Kernel::Swiglu, gate, true)) return composite::swiglu(gate, up);
  return torch::silu(gate).mul_(up);
}

at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  if (!use_fused(Kernel::Rotary, t, true)) return composite::rotary(t, cos, sin);
  return RotaryInPlace::apply(t.clone(), cos, sin);  // t itself is the caller's
}

at::Tensor rotary_(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  if (!use_fused(Kernel::Rotary, t, true)) return composite::rotary(t, cos, sin);
  return RotaryInPlace::apply(t, cos, sin);
}

}  // namespace nnstrain::models::common::kernels
