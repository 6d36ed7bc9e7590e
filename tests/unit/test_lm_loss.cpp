// The chunked LM-head cross-entropy: same loss and gradients as the plain one,
// and a peak memory that does not grow with tokens x vocab.
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

namespace F = torch::nn::functional;
using nnstrain::models::common::chunked_linear_cross_entropy;

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
  auto loss = std::string(mode) == "chunked" ? chunked_linear_cross_entropy(h, w, t, 256)
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
  double plain_loss = 0, chunked_loss = 0;
  const long plain = measure("plain", plain_loss);
  const long chunked = measure("chunked", chunked_loss);
  std::cout << "loss peak growth: plain " << plain / 1024 << " MB, chunked " << chunked / 1024 << " MB\n";
  CHECK(chunked_loss == Approx(plain_loss).epsilon(1e-5));
  CHECK(plain > 512 * 1024);        // at least the logits: the measurement sees them
  CHECK(chunked * 4 < plain);       // chunks of 256 x 32000 instead of 4096 x 32000
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
