// DeepSeek-V3's multi-head latent attention (models/common/latent_attention.h)
// against transformers' DeepseekV3ForCausalLM, fp32, on an odd shape saved by
// save_pretrained and read through model.init_from's path: the logits within
// 1e-5 relative, with the q low-rank projection and interleaved YaRN rope (its
// mscale_all_dim moving the softmax scale), and with q_proj and plain rope; and
// generation over the compressed KV cache gives the full forward's logits;
// packed documents give each document's loss on its own.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include "models/common/kv_cache.h"
#include "models/moe/moe_lm.h"
#include "models/registry.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/interop/hf_import.h"

#include "tests/unit/test_support.h"

using namespace nnstrain;

namespace {

using nnstrain::testing::python;
using nnstrain::testing::rel_err;
using nnstrain::testing::TempDir;

constexpr const char* kMakeHf = R"PY(
import sys
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
out = sys.argv[1]
shape = dict(vocab_size=61, hidden_size=40, intermediate_size=56, moe_intermediate_size=12, num_hidden_layers=2,
             num_attention_heads=5, num_key_value_heads=5, kv_lora_rank=14, qk_nope_head_dim=6, qk_rope_head_dim=8,
             v_head_dim=10, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
             routed_scaling_factor=1.5, first_k_dense_replace=1, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
forms = {
    "lora_yarn": dict(q_lora_rank=22, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                      "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "q_proj_plain": dict(q_lora_rank=None, rope_interleave=False),
}
torch.manual_seed(5)
x = torch.randint(0, 61, (2, 20))
for name, extra in forms.items():
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**shape, **extra)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else 0.2 * torch.randn_like(p))
        logits = model(input_ids=x).logits
    model.save_pretrained(f"{out}/{name}")
    save_file({"x": x, "logits": logits.contiguous()}, f"{out}/{name}.safetensors")
)PY";

const TempDir& fixture() {
  static TempDir dir;
  static const int rc = python(kMakeHf, {dir.path});
  REQUIRE(rc == 0);
  return dir;
}

}  // namespace

TEST_CASE("deepseek_v3's latent attention equals transformers'", "[latent][hf]") {
  const auto& dir = fixture();
  const auto* entry = models::find_model("deepseek_v3");
  REQUIRE(entry != nullptr);
  for (const std::string form : {"lora_yarn", "q_proj_plain"}) {
    INFO(form);
    const auto folder = dir.path + "/" + form;
    const auto cfg = interop::hf_model_config(*entry, folder);
    const auto& c = dynamic_cast<const models::moe::MoeLmConfig&>(*cfg);
    REQUIRE(c.latent);
    CHECK((c.latent->q_lora_rank == 0) == (form == "q_proj_plain"));
    auto model = entry->build(*cfg);
    interop::load_hf_weights(*model, folder);
    model->eval();
    const auto expected = checkpoint::load_tensors(folder + ".safetensors");
    const auto& x = expected.at("x");
    torch::NoGradGuard no_grad;
    const auto logits = model->logits(x);
    const double err = rel_err(logits, expected.at("logits"));
    INFO("logits rel err " << err);
    CHECK(err < 1e-5);
    // The cache holds each layer's compression (kv_lora_rank + the rope key per token), expanded on
    // read: 13 tokens at once, then one at a time, give the whole forward's logits.
    models::common::KvCache cache(x.size(1));
    std::vector<torch::Tensor> steps{model->decode_logits(x.narrow(1, 0, 13), cache)};
    for (int64_t t = 13; t < x.size(1); ++t) steps.push_back(model->decode_logits(x.narrow(1, t, 1), cache));
    const double cached = rel_err(torch::cat(steps, 1), logits);
    INFO("cached decoding rel err " << cached);
    CHECK(cached < 1e-5);
    // Packed documents (the document attention, v padded to the key's width): two documents in one
    // row give each one's loss on its own, positions restarting at the second.
    const auto row = x.narrow(0, 0, 1), y = x.narrow(0, 1, 1);
    const auto seg = torch::cat({torch::zeros({1, 8}, torch::kLong), torch::ones({1, 12}, torch::kLong)}, 1);
    const auto pos = torch::cat({torch::arange(8, torch::kLong), torch::arange(12, torch::kLong)}).unsqueeze(0);
    const double packed = model->loss(row, y, models::Documents{pos, seg}).item<double>();
    const double apart = (8 * model->loss(row.narrow(1, 0, 8), y.narrow(1, 0, 8)).item<double>() +
                          12 * model->loss(row.narrow(1, 8, 12), y.narrow(1, 8, 12)).item<double>()) / 20;
    INFO("packed " << packed << " apart " << apart);
    CHECK(std::abs(packed - apart) <= 1e-5 * apart);
  }
}
