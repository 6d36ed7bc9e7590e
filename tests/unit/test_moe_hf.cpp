// The MoE models against Hugging Face transformers, fp32, on odd shapes
// (experts not a power of two, top-3, a dense first layer, untied heads):
// - qwen3_moe and mixtral load save_pretrained's output (per-expert tensor
//   names) through model.init_from's path (hf_model_config + load_hf_weights),
//   and their logits and loss on a fixed batch equal Qwen3MoeForCausalLM's and
//   MixtralForCausalLM's within 1e-5 relative;
// - the MoE block with DeepSeek-V3's router (sigmoid scores, a selection bias,
//   group-limited top-k, routed_scaling_factor, shared experts) equals
//   transformers' DeepseekV3MoE module on the same weights and input.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "models/common/moe.h"
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
import torch, torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (Qwen3MoeConfig, Qwen3MoeForCausalLM, MixtralConfig, MixtralForCausalLM,
                          DeepseekV3Config)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
out = sys.argv[1]
torch.manual_seed(17)

def randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))

x = torch.randint(0, 64, (2, 24))
y = torch.randint(0, 64, (2, 24))
common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
models = {
    "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_experts=5, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)),
    "mixtral": MixtralForCausalLM(MixtralConfig(
        **common, intermediate_size=16, num_hidden_layers=2, num_local_experts=5, num_experts_per_tok=3)),
}
for name, model in models.items():
    model = model.float().eval()
    model.config._attn_implementation = "eager"
    model.config.output_router_logits = True  # transformers' balancing loss on (config.json says so)
    randomise(model)
    model.save_pretrained(f"{out}/{name}")
    with torch.no_grad():
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    # load_balancing_loss_func's value (without the coefficient) and its gradient in each router.
    model.train()
    aux = model(input_ids=x, output_router_logits=True).aux_loss
    aux.backward()
    grads = {f"aux_grad_{n.split('.')[2]}": p.grad.detach().clone() for n, p in model.named_parameters()
             if n.endswith("gate.weight") and p.shape == (5, 32)}
    save_file({"x": x, "y": y, "logits": logits.contiguous(), "loss": loss.reshape(1), "aux": aux.detach().reshape(1),
               **grads}, f"{out}/{name}.safetensors")

cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=8, n_routed_experts=6, num_experts_per_tok=3,
                       n_group=3, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
moe = DeepseekV3MoE(cfg).float().eval()
with torch.no_grad():
    for p in moe.parameters():
        p.copy_(0.3 * torch.randn_like(p))
    moe.gate.e_score_correction_bias.copy_(0.2 * torch.randn(6))
    h = torch.randn(2, 10, 32)
    out_h = moe(h)
gu = moe.experts.gate_up_proj.detach()
save_file({"h": h, "out": out_h.contiguous(), "gate": moe.gate.weight.detach().contiguous(),
           "bias": moe.gate.e_score_correction_bias.detach().contiguous(),
           "experts_gate": gu[:, :8].contiguous(), "experts_up": gu[:, 8:].contiguous(),
           "experts_down": moe.experts.down_proj.detach().contiguous(),
           "shared_gate": moe.shared_experts.gate_proj.weight.detach().contiguous(),
           "shared_up": moe.shared_experts.up_proj.weight.detach().contiguous(),
           "shared_down": moe.shared_experts.down_proj.weight.detach().contiguous()},
          f"{out}/deepseek_v3_moe.safetensors")
)PY";

const TempDir& fixture() {
  static TempDir dir;
  static const int rc = python(kMakeHf, {dir.path});
  REQUIRE(rc == 0);
  return dir;
}

}  // namespace

// One test case (two sections): transformers' fixture is made once per process.
TEST_CASE("MoE models and the DeepSeek-V3 block equal transformers'", "[moe][hf]") {
  const auto& dir = fixture();
  SECTION("qwen3_moe and mixtral on init_from weights") {
    for (const std::string type : {"qwen3_moe", "mixtral"}) {
      INFO(type);
      const auto* entry = models::find_model(type);
      REQUIRE(entry != nullptr);
      const auto cfg = interop::hf_model_config(*entry, dir.path + "/" + type);
      auto model = entry->build(*cfg);
      interop::load_hf_weights(*model, dir.path + "/" + type);
      model->eval();
      // What was built: the experts stacked as declared, the dense first layer of qwen3_moe.
      auto& moe_model = dynamic_cast<models::moe::MoeLm&>(*model);
      const auto& mc = moe_model.moe_config();
      CHECK(mc.moe->num_experts == 5);
      CHECK(mc.moe->top_k == 3);
      CHECK(mc.sparse(0) == (type == "mixtral"));
      const auto expected = checkpoint::load_tensors(dir.path + "/" + type + ".safetensors");
      torch::NoGradGuard no_grad;
      const auto logits = model->logits(expected.at("x"));
      const auto loss = model->loss(expected.at("x"), expected.at("y"));
      const double logit_err = rel_err(logits, expected.at("logits"));
      const double loss_err = std::abs(loss.item<double>() - expected.at("loss").item<double>()) /
                              expected.at("loss").item<double>();
      INFO("logits rel err " << logit_err << ", loss rel err " << loss_err);
      CHECK(logit_err < 1e-5);
      CHECK(loss_err < 1e-5);
    }
  }
  SECTION("imported from a folder, the balancing loss is transformers' load_balancing_loss_func") {
    // Issue 58, item 5: one loss over every MoE layer and the whole batch (global_batch), applied
    // as config.json's output_router_logits says; its value and each router's gradient.
    for (const std::string type : {"qwen3_moe", "mixtral"}) {
      INFO(type);
      const auto* entry = models::find_model(type);
      const auto cfg = interop::hf_model_config(*entry, dir.path + "/" + type);
      const auto& mc = dynamic_cast<const models::moe::MoeLmConfig&>(*cfg);
      REQUIRE(mc.moe->aux_loss_form == models::common::AuxLossForm::GlobalBatch);
      const double coef = mc.moe->router_aux_loss_coef;
      REQUIRE(coef == Approx(0.001));  // transformers' default, on: output_router_logits is true
      // The same folder without output_router_logits: no balancing loss, as transformers.
      auto j = nlohmann::json::parse(std::ifstream(dir.path + "/" + type + "/config.json"));
      j["output_router_logits"] = false;
      const auto off = entry->from_hf_config(j);
      REQUIRE(dynamic_cast<const models::moe::MoeLmConfig&>(*off).moe->router_aux_loss_coef == 0.0);
      const auto expected = checkpoint::load_tensors(dir.path + "/" + type + ".safetensors");
      auto with = entry->build(*cfg), without = entry->build(*off);
      interop::load_hf_weights(*with, dir.path + "/" + type);
      interop::load_hf_weights(*without, dir.path + "/" + type);
      with->train();
      without->train();
      with->loss(expected.at("x"), expected.at("y")).backward();
      without->loss(expected.at("x"), expected.at("y")).backward();
      double value = 0;
      for (const auto& st : with->take_moe_stats())
        if (st.aux_loss.defined()) value += st.aux_loss.item<double>();
      const double want = expected.at("aux").item<double>();
      INFO("aux " << value / coef << " vs transformers' " << want);
      CHECK(std::abs(value / coef - want) <= 1e-5 * want);
      const auto gw = with->named_parameters(), go = without->named_parameters();
      int routers = 0;
      for (const auto& p : gw) {
        const auto& n = p.key();
        if (n.size() < 12 || n.compare(n.size() - 12, 12, ".gate.weight") != 0 || p.value().size(0) != 5) continue;
        const auto layer = n.substr(7, n.find('.', 7) - 7);  // "layers.N...."
        INFO(n);
        const auto diff = (p.value().grad() - go[n].grad()) / coef;
        const auto theirs = expected.at("aux_grad_" + layer);
        CHECK(rel_err(diff, theirs) < 1e-3);  // a difference of two gradients, in fp32
        ++routers;
      }
      CHECK(routers == (type == "qwen3_moe" ? 2 : 2));
    }
  }
  SECTION("the DeepSeek-V3 router and MoE block against DeepseekV3MoE") {
    const auto t = checkpoint::load_tensors(dir.path + "/deepseek_v3_moe.safetensors");
    models::common::MoeOptions o;
    o.hidden_size = 32;
    o.num_experts = 6;
    o.top_k = 3;
    o.moe_intermediate_size = 8;
    o.router = models::common::RouterKind::DeepseekV3;
    o.n_group = 3;
    o.topk_group = 2;
    o.routed_scaling_factor = 2.5;
    o.norm_topk_prob = true;
    o.n_shared_experts = 2;
    o.bias_update_speed = 0.001;
    models::common::Moe moe(o, models::common::ShardingContext{}, "mlp");
    moe->eval();
    torch::NoGradGuard no_grad;
    moe->gate->weight.copy_(t.at("gate"));
    moe->experts->gate.copy_(t.at("experts_gate"));
    moe->experts->up.copy_(t.at("experts_up"));
    moe->experts->down.copy_(t.at("experts_down"));
    moe->shared_experts->gate_proj->weight.copy_(t.at("shared_gate"));
    moe->shared_experts->up_proj->weight.copy_(t.at("shared_up"));
    moe->shared_experts->down_proj->weight.copy_(t.at("shared_down"));
    moe->expert_bias() = t.at("bias").clone();
    const auto out = moe->forward(t.at("h"));
    const double err = rel_err(out, t.at("out"));
    INFO("rel err " << err);
    CHECK(err < 1e-5);
    // The bias matters here: without it the block no longer matches.
    moe->expert_bias() = torch::zeros({6});
    CHECK(rel_err(moe->forward(t.at("h")), t.at("out")) > 1e-3);
  }
}
