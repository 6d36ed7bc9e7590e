// Muon's pieces that need no ranks: Newton-Schulz against PyTorch's own
// (torch.optim._muon, run here in Python), in bf16 (as PyTorch runs it) and in
// fp32 (nnstrain's CPU choice: PyTorch's iteration with its bf16 cast lifted);
// the parameter-name globs. The whole optimizer, against torch.optim.Muon and
// under every plan, is tests/integration/test_muon.py.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "tests/unit/test_support.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/optim/muon/muon_config.h"
#include "trainer/optim/muon/newton_schulz.h"

using namespace nnstrain;

namespace {

// Wide, tall and square matrices; PyTorch's default coefficients and steps.
constexpr const char* kNewtonSchulzReference = R"PY(
import sys, torch
from safetensors.torch import save_file
from torch.optim import _muon
torch.manual_seed(3)
abc = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
out = {}
for i, shape in enumerate([(7, 11), (11, 7), (16, 16)]):
    x = torch.randn(shape) * 3
    out[f"x/{i}"] = x
    out[f"bf16/{i}"] = _muon._zeropower_via_newtonschulz(x, abc, _muon.DEFAULT_NS_STEPS, _muon.EPS).contiguous()
    cast = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda t: t.clone()
    try:
        out[f"fp32/{i}"] = _muon._zeropower_via_newtonschulz(x, abc, _muon.DEFAULT_NS_STEPS, _muon.EPS).contiguous()
    finally:
        torch.Tensor.bfloat16 = cast
out["abc"] = torch.tensor(abc, dtype=torch.float64)
save_file(out, sys.argv[1] + "/ns.safetensors")
)PY";

}  // namespace

TEST_CASE("Newton-Schulz equals torch.optim.Muon's: bitwise in bf16, to rounding in fp32", "[optim][muon]") {
  testing::TempDir dir;
  REQUIRE(testing::python(kNewtonSchulzReference, {dir.path}) == 0);
  const auto ref = checkpoint::load_tensors(dir.path + "/ns.safetensors");
  const auto abc_t = ref.at("abc");
  const std::array<double, 3> abc{abc_t[0].item<double>(), abc_t[1].item<double>(), abc_t[2].item<double>()};
  for (int i = 0; i < 3; ++i) {
    const auto x = ref.at("x/" + std::to_string(i));
    const auto bf16 = optim::muon::newton_schulz(x.to(torch::kBFloat16), abc, 5, 1e-7);
    REQUIRE(bf16.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(bf16, ref.at("bf16/" + std::to_string(i))));
    const auto fp32 = optim::muon::newton_schulz(x, abc, 5, 1e-7);
    const auto want = ref.at("fp32/" + std::to_string(i));
    CHECK(testing::rel_err(fp32, want) < 1e-6);
    // The iteration did something: the result is far from the input and near-orthogonal rows/columns.
    CHECK(testing::rel_err(fp32, x) > 0.5);
  }
}

TEST_CASE("Muon's parameter globs: a star matches any run of characters, nothing else is special", "[optim][muon]") {
  using optim::muon::glob_match;
  CHECK(glob_match("h.*.attn.*.weight", "h.0.attn.c_attn.weight"));
  CHECK(glob_match("*", "wte.weight"));
  CHECK(glob_match("*mlp*", "layers.3.mlp.down_proj.weight"));
  CHECK_FALSE(glob_match("h.*.attn.*.weight", "h.0.attn.c_attn.bias"));
  CHECK_FALSE(glob_match("h.?.ln_1.weight", "h.0.ln_1.weight"));
  CHECK_FALSE(glob_match("wte", "wte.weight"));
  CHECK(glob_match("a*b*c", "aXXbYYc"));
  CHECK_FALSE(glob_match("a*b*c", "aXXbYY"));
}
