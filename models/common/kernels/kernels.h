// The models' elementwise and normalisation kernels in one place, each with a
// composite of plain ATen ops (the reference, and what runs where no fused
// kernel exists) and the device's fused form, chosen at run time: model code
// calls these and holds no device conditionals.
//
// Which form runs (kernel_impl()):
//   auto       the fused form where the tensor's device has one that pays
//              (table below), else the composite; the default
//   composite  every kernel's composite (NNSTRAIN_KERNELS=composite)
//   fused      every kernel's fused form on any device, where ATen has it for
//              that device (NNSTRAIN_KERNELS=fused): lets the CPU check the
//              fused forms against the composites
//
//   kernel      fused form                        auto picks it on
//   rms_norm    at::_fused_rms_norm (CUDA);       every device
//               rms_norm_cpu.h on the CPU (ATen's
//               is a composite there)
//   layer_norm  at::layer_norm (native)           every device (the model's choice before)
//   gelu        at::gelu (native, none or tanh)   every device
//   swiglu      at::silu, the product written     every device
//               into its output (mul_)
//   rotary      by halves, written over t in      every device
//               place (rotary_), no rotate_half
//               copy; backward needs only cos/sin
//
// The residual add stays the model's own `x + f(x)`: no ATen kernel fuses it
// with a norm; add_rms_norm / add_layer_norm give the interface a CUDA kernel
// can fill later (today: the add, then the norm above).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace nnstrain::models::common::kernels {

enum class Impl { Auto, Composite, Fused };
// The process-wide choice: NNSTRAIN_KERNELS (auto | composite | fused) read once,
// unless set_impl() was called. An unknown value throws, naming the variable.
Impl impl();
void set_impl(Impl i);
Impl parse_impl(const std::string& s);  // throws std::invalid_argument on anything else

// How often each kernel ran in each form since the process started, counted
// in the entry points below as they choose (the run's record of which forms
// actually ran, trainer/train/active_record.h; NNSTRAIN_KERNELS=fused and
// composite differ only in rounding on CPU, so only this tells them apart).
enum class Kernel { RmsNorm, LayerNorm, Gelu, Swiglu, Rotary };
constexpr int kNumKernels = 5;
const char* kernel_name(Kernel k);  // "rms_norm", ...
struct KernelCalls {
  std::array<int64_t, kNumKernels> fused{}, composite{};
};
KernelCalls kernel_calls();
const char* impl_name(Impl i);  // "auto", "composite", "fused"

// RMSNorm as Hugging Face's LlamaRMSNorm: normalised in fp32, cast back to x's
// dtype, times weight. The fused form multiplies by the weight before the cast
// (the same in fp32 and mixed precision, where x and weight are fp32).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// {norm(x + residual), x + residual}
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps);
// LayerNorm over the last dimension; bias may be undefined.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias, double eps);
// GELU, exact (erf) or the tanh approximation.
at::Tensor gelu(const at::Tensor& x, bool tanh_approximation);
// silu(gate) * up
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// Rotary embedding with Hugging Face's pairing (the two halves of the last
// dimension), in at least cos's dtype, returned in t's dtype:
// t * cos + rotate_half(t) * sin. t [..., T, D], cos/sin [T, D].
at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin);
// The same written over t (its fused form; the composite returns a new
// tensor): for a t nothing else keeps, e.g. a view of a projection's output.
at::Tensor rotary_(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin);

// The composites themselves (the parity tests' references).
namespace composite {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);
at::Tensor gelu(const at::Tensor& x, bool tanh_approximation);
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin);
}  // namespace composite

}  // namespace nnstrain::models::common::kernels
