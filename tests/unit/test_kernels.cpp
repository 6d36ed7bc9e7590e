// models/common/kernels: each kernel's fused form (forced with Impl::Fused, so
// the CPU runs it where ATen has it) equals its composite in fp32 within 1e-6,
// forward and backward; the composites equal plain PyTorch formulas; auto picks
// the fused form by device.
#include <catch2/catch.hpp>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <vector>

#include "models/common/kernels/kernels.h"

namespace kernels = nnstrain::models::common::kernels;
using kernels::Impl;

namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ad = a.to(torch::kDouble), bd = b.to(torch::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

// Restores the process-wide choice when a test ends.
struct ImplGuard {
  explicit ImplGuard(Impl i) : was(kernels::impl()) { kernels::set_impl(i); }
  ~ImplGuard() { kernels::set_impl(was); }
  Impl was;
};

using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// Output and every input's gradient (under a fixed random upstream gradient) of fn
// with `impl`, for copies of the inputs.
std::vector<torch::Tensor> run(Impl impl, const Fn& fn, const std::vector<torch::Tensor>& inputs) {
  ImplGuard guard(impl);
  std::vector<torch::Tensor> xs;
  for (const auto& x : inputs) xs.push_back(x.clone().requires_grad_(true));
  auto y = fn(xs);
  torch::manual_seed(99);
  y.backward(torch::randn_like(y));
  std::vector<torch::Tensor> out{y.detach()};
  for (const auto& x : xs) out.push_back(x.grad());
  return out;
}

void check_parity(const Fn& fn, const std::vector<torch::Tensor>& inputs, double tol = 1e-6) {
  const auto want = run(Impl::Composite, fn, inputs), got = run(Impl::Fused, fn, inputs);
  for (size_t i = 0; i < want.size(); ++i) {
    INFO((i == 0 ? "output" : "gradient of input " + std::to_string(i - 1)));
    REQUIRE(got[i].defined());
    REQUIRE(got[i].sizes() == want[i].sizes());
    CHECK(rel_err(got[i], want[i]) < tol);
  }
}

}  // namespace

TEST_CASE("kernels: NNSTRAIN_KERNELS values parse, others are refused", "[kernels]") {
  CHECK(kernels::parse_impl("auto") == Impl::Auto);
  CHECK(kernels::parse_impl("") == Impl::Auto);
  CHECK(kernels::parse_impl("composite") == Impl::Composite);
  CHECK(kernels::parse_impl("fused") == Impl::Fused);
  CHECK_THROWS_WITH(kernels::parse_impl("fast"), Catch::Contains("NNSTRAIN_KERNELS") && Catch::Contains("fast"));
}

TEST_CASE("kernels: the composites are the plain PyTorch formulas", "[kernels]") {
  torch::manual_seed(0);
  const auto x = torch::randn({3, 5, 16}), w = torch::randn({16}), b = torch::randn({16});
  CHECK(rel_err(kernels::composite::layer_norm(x, w, b, 1e-5), torch::layer_norm(x, {16}, w, b, 1e-5)) < 1e-6);
  const auto rms = w * (x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-6));
  CHECK(rel_err(kernels::composite::rms_norm(x, w, 1e-6), rms) < 1e-6);
  CHECK(rel_err(kernels::composite::gelu(x, false), torch::gelu(x)) < 1e-6);
  CHECK(rel_err(kernels::composite::gelu(x, true), torch::gelu(x, "tanh")) < 1e-6);
  CHECK(rel_err(kernels::composite::swiglu(x, b.expand_as(x)), torch::silu(x) * b) < 1e-6);
  // Rotary: pairs (i, i + D/2) rotated by the angle cos/sin carry.
  const auto ang = torch::randn({5, 8});
  const auto cos = torch::cat({ang.cos(), ang.cos()}, -1), sin = torch::cat({ang.sin(), ang.sin()}, -1);
  const auto r = kernels::composite::rotary(x, cos, sin);
  const auto x1 = x.narrow(-1, 0, 8), x2 = x.narrow(-1, 8, 8);
  CHECK(rel_err(r.narrow(-1, 0, 8), x1 * ang.cos() - x2 * ang.sin()) < 1e-6);
  CHECK(rel_err(r.narrow(-1, 8, 8), x2 * ang.cos() + x1 * ang.sin()) < 1e-6);
}

TEST_CASE("kernels: fused forms equal the composites, forward and backward (fp32, 1e-6)", "[kernels]") {
  torch::manual_seed(1);
  const auto x = torch::randn({2, 7, 32}), r = torch::randn({2, 7, 32}), w = torch::randn({32}), b = torch::randn({32});
  SECTION("rms_norm and add_rms_norm") {
    check_parity([](const auto& t) { return kernels::rms_norm(t[0], t[1], 1e-5); }, {x, w});
    check_parity(
        [](const auto& t) {
          auto [n, s] = kernels::add_rms_norm(t[0], t[1], t[2], 1e-5);
          return n * 2.0 + s;  // both outputs reach the loss
        },
        {x, r, w});
  }
  SECTION("rms_norm on the CPU: fp64, many rows over two threads, a row of zeros") {
    // rms_norm_cpu cuts the rows into a block per thread and sums the weight's
    // gradient block by block: 300 rows at 2 threads take that path.
    const int threads = at::get_num_threads();
    at::set_num_threads(2);
    auto big = torch::randn({3, 100, 48}, torch::kDouble);
    big[1][7].zero_();  // eps keeps it finite
    check_parity([](const auto& t) { return kernels::rms_norm(t[0], t[1], 1e-6); },
                 {big, torch::randn({48}, torch::kDouble)});  // the composite normalises in fp32
    at::set_num_threads(threads);
  }
  SECTION("layer_norm and add_layer_norm, with and without bias") {
    check_parity([](const auto& t) { return kernels::layer_norm(t[0], t[1], t[2], 1e-5); }, {x, w, b});
    check_parity([](const auto& t) { return kernels::layer_norm(t[0], t[1], {}, 1e-5); }, {x, w});
    check_parity(
        [](const auto& t) {
          auto [n, s] = kernels::add_layer_norm(t[0], t[1], t[2], t[3], 1e-5);
          return n * 2.0 + s;
        },
        {x, r, w, b});
  }
  SECTION("gelu (exact and tanh) and swiglu") {
    check_parity([](const auto& t) { return kernels::gelu(t[0], false); }, {x});
    check_parity([](const auto& t) { return kernels::gelu(t[0], true); }, {x});
    check_parity([](const auto& t) { return kernels::swiglu(t[0], t[1]); }, {x, r});
  }
  SECTION("rotary, out of place and in place on a projection's view") {
    const auto ang = torch::randn({7, 4});
    const auto cos = torch::cat({ang.cos(), ang.cos()}, -1), sin = torch::cat({ang.sin(), ang.sin()}, -1);
    check_parity([&](const auto& t) { return kernels::rotary(t[0].view({2, 7, 4, 8}).transpose(1, 2), cos, sin); },
                 {x});
    // As Llama uses it: a [B, H, T, D] view of a linear's output rotated in place.
    check_parity(
        [&](const auto& t) {
          auto proj = torch::matmul(t[0], t[1]);  // [2, 7, 32]
          return kernels::rotary_(proj.view({2, 7, 4, 8}).transpose(1, 2), cos, sin) * 1.5;
        },
        {x, torch::randn({32, 32}) * 0.2});
  }
}

TEST_CASE("kernels: rotary_ writes over t under the fused form, and bf16 t rounds once as the composite does", "[kernels]") {
  torch::manual_seed(2);
  const auto ang = torch::randn({6, 4});
  const auto cos = torch::cat({ang.cos(), ang.cos()}, -1), sin = torch::cat({ang.sin(), ang.sin()}, -1);
  auto t = torch::randn({1, 2, 6, 8});
  const auto want = kernels::composite::rotary(t, cos, sin);
  ImplGuard fused(Impl::Fused);
  const auto out = kernels::rotary_(t, cos, sin);
  CHECK(out.data_ptr() == t.data_ptr());
  CHECK(rel_err(t, want) < 1e-6);
  const auto tb = torch::randn({1, 2, 6, 8}).to(torch::kBFloat16);
  const auto wb = kernels::composite::rotary(tb, cos, sin);
  CHECK(torch::equal(kernels::rotary(tb, cos, sin), wb));  // fp32 sums rounded once into bf16
}

TEST_CASE("kernels: auto picks the fused form by device (CPU: our RMSNorm, native LayerNorm/GELU)",
          "[kernels]") {
  torch::manual_seed(3);
  const auto x = torch::randn({4, 16}), w = torch::randn({16});
  ImplGuard auto_impl(Impl::Auto);
  // On the CPU auto runs rms_norm_cpu (counted as fused), not the composite's five ops.
  const auto before = kernels::kernel_calls();
  const auto y = kernels::rms_norm(x, w, 1e-5);
  const auto after = kernels::kernel_calls();
  const int k = static_cast<int>(kernels::Kernel::RmsNorm);
  CHECK(after.fused[k] == before.fused[k] + 1);
  CHECK(after.composite[k] == before.composite[k]);
  CHECK(rel_err(y, kernels::composite::rms_norm(x, w, 1e-5)) < 1e-6);
  // LayerNorm and GELU run ATen's native kernels on every device: bitwise those.
  CHECK(torch::equal(kernels::layer_norm(x, w, {}, 1e-5), torch::layer_norm(x, {16}, w, {}, 1e-5)));
  CHECK(torch::equal(kernels::gelu(x, false), torch::gelu(x)));
}
