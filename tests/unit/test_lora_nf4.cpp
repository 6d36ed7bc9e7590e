// QLoRA's NF4 (models/lora/nf4.h) against bitsandbytes' quantize_4bit(quant_type
// "nf4") on the CPU, run here: codes and absmax scales bit for bit (with and
// without double quantization, a tensor whose length is no multiple of the
// block), dequantization within fp32 rounding of bitsandbytes' dequantize_4bit.
#include "models/lora/nf4.h"

#include "test_support.h"
#include "trainer/checkpoint/tensor_io.h"

using nnstrain::testing::TempDir;

namespace {

const char* kReference = R"(
import sys, torch
from safetensors.torch import load_file, save_file
import bitsandbytes.functional as F
d = sys.argv[1]
out = {}
for name, w in load_file(d + "/in.safetensors").items():
    for dq in (False, True):
        q, s = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4")
        tag = name + ("_dq" if dq else "")
        out[tag + ".codes"] = q.reshape(-1).contiguous()
        out[tag + ".absmax"] = s.absmax.contiguous()
        if dq:
            out[tag + ".absmax_scales"] = s.state2.absmax.contiguous()
            out[tag + ".offset"] = s.offset.reshape(1).float()
        out[tag + ".dequant"] = F.dequantize_4bit(q, s, quant_type="nf4").contiguous()
save_file(out, d + "/ref.safetensors")
)";

}  // namespace

TEST_CASE("NF4 codes and scales equal bitsandbytes' quantize_4bit bitwise", "[lora]") {
  namespace L = nnstrain::models::lora;
  TempDir dir("nf4");
  torch::manual_seed(7);
  std::map<std::string, at::Tensor> in = {
      {"square", torch::randn({96, 64}) * 0.05},
      {"odd", torch::randn({37, 53}) * 0.2},              // 1961 elements: a short last block, an odd count
      {"wide", torch::randn({8, 1024}).pow(3) * 0.01},     // heavy tails: many levels used, 128 blocks
  };
  in["odd"][3][5] = 0;  // a zero block element and a block maximum that is negative
  in["square"][0][0] = -1.5;
  std::vector<std::pair<std::string, at::Tensor>> list(in.begin(), in.end());
  nnstrain::checkpoint::save_tensors(dir.file("in.safetensors"), list);
  REQUIRE(nnstrain::testing::python(kReference, {dir.path}) == 0);
  auto ref = nnstrain::checkpoint::load_tensors(dir.file("ref.safetensors"));
  for (const auto& [name, w] : in) {
    for (bool dq : {false, true}) {
      const std::string tag = name + (dq ? "_dq" : "");
      INFO(tag);
      const auto q = L::quantize_nf4(w, 64, dq);
      CHECK(torch::equal(q.codes, ref.at(tag + ".codes")));
      if (dq) {
        CHECK(torch::equal(q.absmax_codes, ref.at(tag + ".absmax")));
        CHECK(torch::equal(q.absmax_scales, ref.at(tag + ".absmax_scales")));
        CHECK(q.offset == ref.at(tag + ".offset").item<float>());
      } else {
        CHECK(torch::equal(q.absmax, ref.at(tag + ".absmax")));
      }
      const auto ours = L::dequantize_nf4(q, torch::kFloat32);
      const auto theirs = ref.at(tag + ".dequant");
      REQUIRE(ours.sizes() == theirs.sizes());
      // fp32 rounding: one product level x absmax each (double quantization's scales add one more).
      const double tol = (dq ? 2 : 1) * 1.2e-7 * theirs.abs().max().item<double>();
      CHECK((ours - theirs).abs().max().item<double>() <= tol);
      // The codes mean something: within half NF4's widest gap (0.72 to 1) of each block's absmax.
      CHECK((ours - w).abs().max().item<double>() < 0.14 * w.abs().max().item<double>() + 1e-6);
    }
  }
}
