// The chunked and fused LM-head cross-entropies: same loss and gradients as the
// plain one, and a peak memory that does not grow with tokens x vocab.
#include <catch2/catch.hpp>
#include <torch/torch.h>
#include <ATen/autocast_mode.h>

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "models/common/layers.h"
#include "models/common/lm_loss.h"
#include "models/common/recompute.h"

namespace F = torch::nn::functional;
using nnstrain::models::common::chunked_linear_cross_entropy;
using nnstrain::models::common::fused_linear_cross_entropy;

namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ad = a.to(torch::kDouble), bd = b.to(torch::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

struct Result {
  torch::Tensor loss, grad_h, grad_w;
};

Result run(bool chunked, const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& t, int64_t chunk) {
  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto loss = chunked ? chunked_linear_cross_entropy(h, w, t, chunk) : F::cross_entropy(F::linear(h, w), t);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

// kB from a "Key:   123 kB" line of /proc/self/status.
long status_kb(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key + ":", 0) == 0) return std::stol(line.substr(key.size() + 1));
  return -1;
}

}  // namespace

TEST_CASE("chunked cross-entropy equals the plain loss and gradients (fp32, fp64, ignore_index)", "[loss]") {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    torch::manual_seed(0);
    const int64_t N = 37, C = 24, V = 101;
    const auto opts = torch::TensorOptions().dtype(dtype);
    const auto h = torch::randn({N, C}, opts), w = torch::randn({V, C}, opts) * 0.3;
    auto t = torch::randint(V, {N});
    t[3] = -100;  // ignored, as F::cross_entropy's default ignore_index
    t[20] = -100;
    const auto want = run(false, h, w, t, 0);
    for (int64_t chunk : {1, 8, 36, 37, 1000}) {
      INFO("dtype " << dtype << ", chunk " << chunk);
      const auto got = run(true, h, w, t, chunk);
      CHECK(got.loss.scalar_type() == dtype);
      CHECK(rel_err(got.loss, want.loss) < 1e-6);
      CHECK(rel_err(got.grad_h, want.grad_h) < 1e-6);
      CHECK(rel_err(got.grad_w, want.grad_w) < 1e-6);
      // Ignored tokens get no gradient.
      CHECK(got.grad_h[3].abs().max().item<double>() == 0.0);
    }
  }
}

TEST_CASE("chunked cross-entropy: scaled upstream gradient, frozen weight, all ignored", "[loss]") {
  torch::manual_seed(1);
  const auto h0 = torch::randn({10, 8}), w = torch::randn({30, 8});
  const auto t = torch::randint(30, {10});
  auto h1 = h0.clone().requires_grad_(true), h2 = h0.clone().requires_grad_(true);
  (3.5 * chunked_linear_cross_entropy(h1, w, t, 3)).backward();
  (3.5 * F::cross_entropy(F::linear(h2, w), t)).backward();
  CHECK(rel_err(h1.grad(), h2.grad()) < 1e-6);

  const auto none = torch::full({10}, -100, torch::kLong);
  CHECK(std::isnan(chunked_linear_cross_entropy(h0, w, none, 4).item<double>()));
  CHECK(std::isnan(F::cross_entropy(F::linear(h0, w), none).item<double>()));

  CHECK_THROWS_WITH(chunked_linear_cross_entropy(h0, w, t, 0), Catch::Contains("chunk_size"));
  CHECK_THROWS_WITH(chunked_linear_cross_entropy(h0, w.t(), t, 4), Catch::Contains("weight [V, C]"));
}

TEST_CASE("an all-ignored batch: NaN loss but zero gradients, plain, chunked and fused (token-weighted steps)", "[loss]") {
  // The trainer weights each micro-batch's mean by its target count
  // (where(count > 0, loss, 0) x count): an all-masked one must add nothing, not NaN.
  torch::manual_seed(2);
  const auto h0 = torch::randn({10, 8}), w0 = torch::randn({30, 8});
  const auto none = torch::full({10}, -100, torch::kLong);
  for (int kind = 0; kind < 3; ++kind) {
    INFO("kind " << kind << " (0 plain, 1 chunked, 2 fused)");
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto loss = kind == 0   ? F::cross_entropy(F::linear(h, w), none)
                : kind == 1 ? chunked_linear_cross_entropy(h, w, none, 4)
                            : fused_linear_cross_entropy(h, w, none, 4);
    CHECK(std::isnan(loss.item<double>()));
    const auto count = none.ne(-100).sum().to(torch::kFloat);
    auto weighted = torch::where(count.gt(0), loss, torch::zeros_like(loss)) * count;
    CHECK(weighted.item<double>() == 0.0);
    weighted.backward();
    CHECK(torch::isfinite(h.grad()).all().item<bool>());
    CHECK(h.grad().abs().max().item<double>() == 0.0);
    CHECK(w.grad().abs().max().item<double>() == 0.0);
  }
}

TEST_CASE("LmHead::loss with a chunk size matches the plain LmHead::loss", "[loss]") {
  torch::manual_seed(2);
  const auto hidden = torch::randn({2, 9, 16}), w = torch::randn({50, 16});
  const auto t = torch::randint(50, {2, 9});
  nnstrain::models::common::LmHead head;
  CHECK(head.loss(hidden, w, t, 4).item<double>() == Approx(head.loss(hidden, w, t, 0).item<double>()).epsilon(1e-6));
}

// Child side of the peak-memory test: one loss, forward + backward, then the
// growth of the peak resident set over the resident set before it.
TEST_CASE("chunked loss peak memory (child)", "[.][loss_peak_child]") {
  const char* mode = std::getenv("NNSTRAIN_LOSS_PEAK_MODE");
  if (!mode) return;
  const int64_t N = 4096, C = 64, V = 32000;  // logits: 4096 x 32000 fp32 = 524 MB
  torch::manual_seed(0);
  auto h = torch::randn({N, C}).requires_grad_(true);
  auto w = (torch::randn({V, C}) * 0.02).requires_grad_(true);
  const auto t = torch::randint(V, {N});
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // reset the peak where the kernel allows
  const long before = status_kb("VmRSS");
  const std::string m = mode;
  auto loss = m == "chunked" ? chunked_linear_cross_entropy(h, w, t, 256)
              : m == "fused" ? fused_linear_cross_entropy(h, w, t, 256)
                             : F::cross_entropy(F::linear(h, w), t);
  loss.backward();
  const long peak = status_kb("VmHWM");
  std::cout << "PEAK_GROWTH_KB " << (peak - before) << " LOSS " << loss.item<double>() << std::endl;
}

TEST_CASE("chunked loss never holds the whole logits: peak memory far below the plain loss", "[loss]") {
  std::array<char, 4096> exe{};
  const auto n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  REQUIRE(n > 0);
  auto measure = [&](const std::string& mode, double& loss) {
    const std::string cmd = "NNSTRAIN_LOSS_PEAK_MODE=" + mode + " OMP_NUM_THREADS=1 '" +
                            std::string(exe.data(), n) + "' '[loss_peak_child]' 2>&1";
    FILE* pipe = popen(cmd.c_str(), "r");
    REQUIRE(pipe != nullptr);
    std::string out;
    std::array<char, 4096> buf{};
    while (fgets(buf.data(), buf.size(), pipe)) out += buf.data();
    REQUIRE(pclose(pipe) == 0);
    const auto at = out.find("PEAK_GROWTH_KB ");
    INFO(out);
    REQUIRE(at != std::string::npos);
    long kb = 0;
    REQUIRE(std::sscanf(out.c_str() + at, "PEAK_GROWTH_KB %ld LOSS %lf", &kb, &loss) == 2);
    return kb;
  };
  double plain_loss = 0, chunked_loss = 0, fused_loss = 0;
  const long plain = measure("plain", plain_loss);
  const long chunked = measure("chunked", chunked_loss);
  const long fused = measure("fused", fused_loss);
  std::cout << "loss peak growth: plain " << plain / 1024 << " MB, chunked " << chunked / 1024 << " MB, fused "
            << fused / 1024 << " MB\n";
  CHECK(chunked_loss == Approx(plain_loss).epsilon(1e-5));
  CHECK(fused_loss == Approx(plain_loss).epsilon(1e-5));
  CHECK(plain > 512 * 1024);        // at least the logits: the measurement sees them
  CHECK(chunked * 4 < plain);       // chunks of 256 x 32000 instead of 4096 x 32000
  CHECK(fused * 4 < plain);
}

TEST_CASE("chunked cross-entropy under autocast recomputes the logits in the forward's dtype", "[loss]") {
  torch::manual_seed(4);
  const auto h0 = torch::randn({40, 32}), w0 = torch::randn({300, 32}) * 0.2;
  const auto t = torch::randint(300, {40});
  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  auto loss = chunked_linear_cross_entropy(h, w, t, 16);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  CHECK(loss.scalar_type() == torch::kFloat);  // reduced in fp32
  loss.backward();
  CHECK(h.grad().scalar_type() == torch::kFloat);
  CHECK(w.grad().scalar_type() == torch::kFloat);
  // The reference: bf16 logits as autocast makes them, cross-entropy and grads in fp64.
  auto hr = h0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
  auto logits = F::linear(hr.to(torch::kBFloat16), wr.to(torch::kBFloat16)).to(torch::kDouble);
  auto ref = F::cross_entropy(logits, t);
  ref.backward();
  CHECK(rel_err(loss, ref) < 1e-6);
  CHECK(rel_err(h.grad(), hr.grad()) < 1e-2);  // bf16 matmuls in backward
  CHECK(rel_err(w.grad(), wr.grad()) < 1e-2);
}

// ---- the fused loss ---------------------------------------------------------------

namespace {

// Loss and gradients of the plain composite and of the fused loss, for the
// same inputs (copies), with an upstream factor on the loss.
Result run_fused(bool fused, const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& t, int64_t chunk,
                 int64_t ignore = -100, double upstream = 1.0) {
  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto loss = fused ? fused_linear_cross_entropy(h, w, t, chunk, ignore)
                    : F::cross_entropy(F::linear(h, w), t, F::CrossEntropyFuncOptions().ignore_index(ignore));
  (upstream * loss).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

}  // namespace

TEST_CASE("fused cross-entropy equals the plain loss and gradients (fp32, fp64, ignore_index, an all-ignored chunk)",
          "[loss][fused_loss]") {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (int64_t ignore : {int64_t{-100}, int64_t{3}}) {
      torch::manual_seed(0);
      const int64_t N = 37, C = 24, V = 101;
      const auto opts = torch::TensorOptions().dtype(dtype);
      const auto h = torch::randn({N, C}, opts), w = torch::randn({V, C}, opts) * 0.3;
      auto t = torch::randint(V, {N});
      t.narrow(0, 8, 8).fill_(ignore);  // with chunk 8: the second chunk all ignored
      t[30] = ignore;
      t[31] = 3;  // the ignored id itself when ignore == 3
      const auto want = run_fused(false, h, w, t, 0, ignore, 2.5);
      REQUIRE(want.grad_h.narrow(0, 8, 8).abs().max().item<double>() == 0.0);
      for (int64_t chunk : {1, 8, 36, 37, 1000}) {
        INFO("dtype " << dtype << ", ignore_index " << ignore << ", chunk " << chunk);
        const auto got = run_fused(true, h, w, t, chunk, ignore, 2.5);
        CHECK(got.loss.scalar_type() == dtype);
        CHECK(got.grad_h.scalar_type() == dtype);
        CHECK(got.grad_w.scalar_type() == dtype);
        CHECK(rel_err(got.loss, want.loss) < 1e-6);
        CHECK(rel_err(got.grad_h, want.grad_h) < 1e-6);
        CHECK(rel_err(got.grad_w, want.grad_w) < 1e-6);
        CHECK(got.grad_h.narrow(0, 8, 8).abs().max().item<double>() == 0.0);  // ignored tokens: no gradient
        CHECK(got.grad_h[30].abs().max().item<double>() == 0.0);
      }
    }
  }
}

TEST_CASE("fused cross-entropy: tied head (the weight also embeds) and untied head equal the plain composite",
          "[loss][fused_loss]") {
  torch::manual_seed(5);
  const int64_t B = 3, T = 11, C = 16, V = 57;
  const auto w0 = torch::randn({V, C}) * 0.2, head0 = torch::randn({V, C}) * 0.2, mix0 = torch::randn({C, C}) * 0.3;
  const auto idx = torch::randint(V, {B, T}), t = torch::randint(V, {B, T}).reshape({-1});
  for (bool tied : {true, false}) {
    auto go = [&](bool fused) {
      auto w = w0.clone().requires_grad_(true), head = head0.clone().requires_grad_(true);
      auto mix = mix0.clone().requires_grad_(true);
      // A tiny model: embed with w, mix, head with w (tied) or its own weight.
      auto h = torch::tanh(torch::matmul(torch::embedding(w, idx), mix)).reshape({-1, C});
      const auto& hw = tied ? w : head;
      auto loss = fused ? fused_linear_cross_entropy(h, hw, t, 7) : F::cross_entropy(F::linear(h, hw), t);
      loss.backward();
      return std::vector<torch::Tensor>{loss.detach(), w.grad(), mix.grad(), tied ? torch::zeros({1}) : head.grad()};
    };
    const auto want = go(false), got = go(true);
    INFO((tied ? "tied" : "untied"));
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("tensor " << i);
      REQUIRE(got[i].defined());
      CHECK(rel_err(got[i], want[i]) < 1e-6);
    }
  }
}

TEST_CASE("fused cross-entropy: frozen weight, no_grad forward, all ignored, backward once, bad arguments",
          "[loss][fused_loss]") {
  torch::manual_seed(1);
  const auto h0 = torch::randn({10, 8}), w = torch::randn({30, 8});
  const auto t = torch::randint(30, {10});
  auto h1 = h0.clone().requires_grad_(true), h2 = h0.clone().requires_grad_(true);
  fused_linear_cross_entropy(h1, w, t, 3).backward();  // w needs no gradient: none made
  F::cross_entropy(F::linear(h2, w), t).backward();
  CHECK(rel_err(h1.grad(), h2.grad()) < 1e-6);
  CHECK(!w.grad().defined());
  {
    torch::NoGradGuard no_grad;
    auto l = fused_linear_cross_entropy(h1, w, t, 4);
    CHECK(!l.requires_grad());
    CHECK(rel_err(l, F::cross_entropy(F::linear(h0, w), t)) < 1e-6);
  }
  const auto none = torch::full({10}, -100, torch::kLong);
  CHECK(std::isnan(fused_linear_cross_entropy(h0, w, none, 4).item<double>()));
  auto h3 = h0.clone().requires_grad_(true);
  auto l = fused_linear_cross_entropy(h3, w, t, 4);
  l.backward(/*gradient=*/{}, /*retain_graph=*/true);
  CHECK_THROWS_WITH(l.backward(), Catch::Contains("backward ran twice"));
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h0, w, t, 0), Catch::Contains("chunk_size"));
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h0, w.t(), t, 4), Catch::Contains("weight [V, C]"));
}

TEST_CASE("fused cross-entropy under recompute: gradients made once, equal to the plain loss", "[loss][fused_loss]") {
  torch::manual_seed(6);
  const int64_t N = 24, C = 12, V = 40;
  const auto x0 = torch::randn({N, C}), a0 = torch::randn({C, C}) * 0.4, w0 = torch::randn({V, C}) * 0.3;
  auto t = torch::randint(V, {N});
  t[2] = -100;
  auto go = [&](bool fused, bool recomputed) {
    auto x = x0.clone().requires_grad_(true), a = a0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    // The head and loss inside the recomputed region: its first pass runs
    // under no_grad, the second (in backward) with grad on.
    auto fn = [&](const torch::Tensor& in) {
      auto h = torch::tanh(torch::mm(in, a));
      return fused ? fused_linear_cross_entropy(h, w, t, 5) : F::cross_entropy(F::linear(h, w), t);
    };
    auto loss = recomputed ? nnstrain::models::common::recompute(fn, x) : fn(x);
    (3.0 * loss).backward();
    return std::vector<torch::Tensor>{loss.detach(), x.grad(), a.grad(), w.grad()};
  };
  const auto want = go(false, false);
  for (bool recomputed : {false, true}) {
    const auto got = go(true, recomputed);
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("recompute " << recomputed << ", tensor " << i);
      REQUIRE(got[i].defined());
      CHECK(rel_err(got[i], want[i]) < 1e-6);
    }
  }
}

TEST_CASE("fused cross-entropy in bf16 (autocast and bf16 weights) and fp16 with a loss scale: within the "
          "half-precision tolerance of an fp64 reference",
          "[loss][fused_loss]") {
  torch::manual_seed(4);
  const int64_t N = 64, C = 32, V = 300;
  const auto h0 = torch::randn({N, C}), w0 = torch::randn({V, C}) * 0.2;
  auto t = torch::randint(V, {N});
  t[5] = -100;
  // The reference: logits rounded as the compute dtype makes them, then cross-entropy and grads in fp64.
  auto reference = [&](at::ScalarType dt) {
    auto hr = h0.to(dt).to(torch::kDouble).requires_grad_(true), wr = w0.to(dt).to(torch::kDouble).requires_grad_(true);
    auto ref = F::cross_entropy(F::linear(hr.to(dt), wr.to(dt)).to(torch::kDouble), t);
    ref.backward();
    return Result{ref.detach(), hr.grad(), wr.grad()};
  };
  // bf16 has 8 mantissa bits (2^-8 ~ 4e-3 per rounding): the gradient matmuls
  // take softmax - onehot rounded to bf16, and sum C or N such products.
  constexpr double kHalfTol = 1e-2;
  SECTION("bf16-mixed: fp32 inputs under autocast") {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    auto loss = fused_linear_cross_entropy(h, w, t, 16);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    CHECK(loss.scalar_type() == torch::kFloat);
    loss.backward();
    CHECK(h.grad().scalar_type() == torch::kFloat);
    CHECK(w.grad().scalar_type() == torch::kFloat);
    const auto ref = reference(torch::kBFloat16);
    CHECK(rel_err(loss, ref.loss) < 1e-6);  // the same bf16 logits, reduced in fp32
    CHECK(rel_err(h.grad(), ref.grad_h) < kHalfTol);
    CHECK(rel_err(w.grad(), ref.grad_w) < kHalfTol);
  }
  SECTION("bf16-true and 16-true (loss scale 65536): 16-bit inputs and gradients") {
    for (auto dt : {torch::kBFloat16, torch::kHalf}) {
      INFO("dtype " << dt);
      auto h = h0.to(dt).requires_grad_(true), w = w0.to(dt).requires_grad_(true);
      auto loss = fused_linear_cross_entropy(h, w, t, 16);
      CHECK(loss.scalar_type() == torch::kFloat);
      const double scale = dt == torch::kHalf ? 65536.0 : 1.0;
      (scale * loss).backward();
      CHECK(h.grad().scalar_type() == dt);
      CHECK(w.grad().scalar_type() == dt);
      const auto ref = reference(dt);
      CHECK(rel_err(loss, ref.loss) < 1e-6);
      CHECK(rel_err(h.grad().to(torch::kDouble) / scale, ref.grad_h) < kHalfTol);
      CHECK(rel_err(w.grad().to(torch::kDouble) / scale, ref.grad_w) < kHalfTol);
    }
  }
}

TEST_CASE("soft-capped logits: chunked and fused equal the capped composite's loss and gradients (fp64)", "[loss]") {
  torch::manual_seed(11);
  const double cap = 1.5;  // logits of scale ~4: the cap bends most of them
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto h0 = torch::randn({13, 8}, opts), w0 = torch::randn({29, 8}, opts) * 0.5;
  auto t = torch::randint(29, {13}, torch::kLong);
  t[3] = -100;
  auto composite = [&](bool capped) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto l = F::linear(h, w);
    if (capped) l = torch::tanh(l / cap) * cap;
    auto loss = F::cross_entropy(l, t);
    loss.backward();
    return Result{loss.detach(), h.grad(), w.grad()};
  };
  const auto want = composite(true), uncapped = composite(false);
  CHECK(rel_err(uncapped.grad_w, want.grad_w) > 1e-2);  // the cap matters here
  for (int kind = 1; kind <= 2; ++kind) {
    INFO("kind " << kind << " (1 chunked, 2 fused)");
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    auto loss = kind == 1 ? chunked_linear_cross_entropy(h, w, t, 4, -100, cap)
                          : fused_linear_cross_entropy(h, w, t, 4, -100, cap);
    loss.backward();
    CHECK(rel_err(loss, want.loss) < 1e-12);
    CHECK(rel_err(h.grad(), want.grad_h) < 1e-12);
    CHECK(rel_err(w.grad(), want.grad_w) < 1e-12);
  }
}
