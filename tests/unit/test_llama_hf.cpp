// Llama's Hugging Face interchange, against transformers' LlamaForCausalLM
// (grouped-query attention, llama3 rope scaling, an untied LM head), as
// test_hf.cpp does for GPT:
// - load_hf_weights + hf_model_config (model.init_from) read save_pretrained's
//   output, one file or sharded with an index, and nnstrain's loss and logits on
//   a fixed batch equal transformers';
// - merge --hf of a checkpoint the nnstrain binary trained loads with
//   LlamaForCausalLM.from_pretrained and gives nnstrain's logits on the same tokens.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <set>

#include <ftw.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "models/llama/llama.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/interop/hf_import.h"
#include "trainer/interop/model_checkpoint.h"
#include "trainer/checkpoint/tensor_io.h"

#include "tests/unit/test_support.h"

using namespace nnstrain;

namespace {

using nnstrain::testing::exists;
using nnstrain::testing::TempDir;
using nnstrain::testing::python;
using nnstrain::testing::run;

// A tiny LlamaForCausalLM (4 query / 2 key-value heads, llama3 rope scaling whose
// 32-token original context puts head_dim 16's frequencies in all three of its
// bands: kept, smoothed, divided by `factor`; its own lm_head) with seeded random
// weights, norm gains included, saved as one file and as several files with an
// index; and a batch with transformers' loss and logits on it. rope_parameters is
// transformers 5's spelling; transformers 4 takes rope_theta + rope_scaling.
constexpr const char* kMakeHf = R"PY(
import os, sys
import torch, torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
torch.manual_seed(11)
rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}
if int(transformers.__version__.split(".")[0]) >= 5:
    rope_kw = {"rope_parameters": dict(rope, rope_theta=10000.0)}
else:
    rope_kw = {"rope_scaling": rope, "rope_theta": 10000.0}
cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                  bos_token_id=0, eos_token_id=0, **rope_kw)
model = LlamaForCausalLM(cfg).float().eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.08 * torch.randn_like(p))
model.save_pretrained(f"{out}/single")
model.save_pretrained(f"{out}/sharded", max_shard_size="40KB")
assert os.path.exists(f"{out}/sharded/model.safetensors.index.json")
x = torch.randint(0, 64, (2, 48))
y = torch.randint(0, 64, (2, 48))
with torch.no_grad():
    logits = model(input_ids=x).logits
loss = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
save_file({"x": x, "y": y, "logits": logits.contiguous(), "loss": loss}, f"{out}/expected.safetensors")
)PY";

// from_pretrained(DIR) logits on x vs nnstrain's; exit 0 when they agree within 1e-5.
constexpr const char* kCompareLogits = R"PY(
import sys
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").float().eval()
cfg = model.config
print(f"from_pretrained: kv heads {cfg.num_key_value_heads}, tied {cfg.tie_word_embeddings}, "
      f"rope {getattr(cfg, 'rope_parameters', None) or getattr(cfg, 'rope_scaling', None)}")
ours = load_file(sys.argv[2])
with torch.no_grad():
    theirs = model(input_ids=ours["x"]).logits
diff = (theirs - ours["logits"]).abs().max().item()
print(f"max |HF - nnstrain| logits: {diff:.3g} (scale {ours['logits'].abs().max().item():.3g})")
sys.exit(0 if diff < 1e-5 else 1)
)PY";

// kMakeHf's output, made once per process.
const TempDir& hf_fixture() {
  static TempDir dir;
  static const int rc = python(kMakeHf, {dir.path});
  REQUIRE(rc == 0);
  return dir;
}

// model.args matching kMakeHf's LlamaConfig.
models::llama::LlamaConfig fixture_config() {
  models::llama::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rope_theta = 10000.0;
  c.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 32};
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = false;
  return c;
}

std::shared_ptr<models::CausalLM> build_from_hf(const std::string& dir) {
  const auto* entry = models::find_model("llama");
  REQUIRE(entry != nullptr);
  auto model = entry->build(*interop::hf_model_config(*entry, dir));
  interop::load_hf_weights(*model, dir);
  model->eval();
  return model;
}

// A tiny llama training config for the nnstrain binary: the shape of kMakeHf's
// model (GQA, llama3 scaling, untied head) at hidden 32.
void write_train_config(const std::string& path, const std::string& tokens, const std::string& run_dir) {
  std::ofstream out(path);
  out << "run_dir: " << run_dir << "\n"
      << "pas_policy: dp\n"
      << "compute_config: {device: cpu}\n"
      << "model:\n"
      << "  type: llama\n"
      << "  args:\n"
      << "    vocab_size: 64\n"
      << "    hidden_size: 32\n"
      << "    intermediate_size: 64\n"
      << "    num_hidden_layers: 2\n"
      << "    num_attention_heads: 4\n"
      << "    num_key_value_heads: 2\n"
      << "    max_position_embeddings: 32\n"
      << "    rope_theta: 10000.0\n"
      << "    rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,"
         " original_max_position_embeddings: 16}\n"
      << "    rms_norm_eps: 1.0e-5\n"
      << "    tie_word_embeddings: false\n"
      << "optimizer:\n"
      << "  type: adamw\n"
      << "  args: {lr: 3.0e-3, betas: [0.9, 0.99], eps: 1.0e-8, weight_decay: 0.1}\n"
      << "dataset:\n"
      << "  type: token_bin\n"
      << "  train_args: {path: " << tokens << ", dtype: uint16, seq_len: 16}\n"
      << "micro_batch_size: 4\n"
      << "max_train_steps: 3\n"
      << "val_every_n_train_steps: 0\n"
      << "log_progress_every_n_train_steps: 1\n"
      << "seed: 1337\n"
      << "checkpoint: {save_dir: " << run_dir << "/ckpt, every_n_train_steps: 0, keep_last_n_checkpoints: 0}\n";
  REQUIRE(out.good());
}

}  // namespace

TEST_CASE("llama load_hf_weights reads transformers' save_pretrained, one file or sharded", "[hf][llama]") {
  const auto& tmp = hf_fixture();
  auto expected = checkpoint::load_tensors(tmp / "expected.safetensors");
  torch::NoGradGuard no_grad;
  for (const char* dir : {"single", "sharded"}) {
    INFO(dir);
    auto model = build_from_hf(tmp / dir);
    // config.json -> the llama config, GQA and rope scaling included.
    const auto& cfg = dynamic_cast<const models::llama::Llama&>(*model).config();
    CHECK(cfg.num_attention_heads == 4);
    CHECK(cfg.num_key_value_heads == 2);
    CHECK(cfg.rope_scaling.rope_type == "llama3");
    CHECK(cfg.rope_scaling.original_max_position_embeddings == 32);
    CHECK_FALSE(cfg.tie_word_embeddings);
    CHECK(model->vocab_size() == 64);
    CHECK(model->num_layers() == 2);
    const auto loss = model->loss(expected["x"], expected["y"]).item<double>();
    CHECK(loss == Approx(expected["loss"].item<double>()).epsilon(1e-5));
    CHECK((model->logits(expected["x"]) - expected["logits"]).abs().max().item<double>() < 1e-5);
  }
  // The sharded save really is an index over several files.
  std::ifstream index(tmp / "sharded/model.safetensors.index.json");
  std::set<std::string> files;
  const auto map = nlohmann::json::parse(index).at("weight_map");
  for (const auto& [k, v] : map.items()) files.insert(v.get<std::string>());
  CHECK(files.size() >= 2);
  CHECK(map.contains("lm_head.weight"));  // untied: the head is its own tensor
  CHECK_FALSE(exists(tmp / "sharded/model.safetensors"));
}

TEST_CASE("llama: the registry's model from matching model.args loads the HF weights", "[hf][llama]") {
  // What model.init_from does: build from the YAML's model.args, then load.
  const auto& tmp = hf_fixture();
  auto expected = checkpoint::load_tensors(tmp / "expected.safetensors");
  const auto* entry = models::find_model("llama");
  REQUIRE(entry != nullptr);
  auto c = fixture_config();
  auto model = entry->build(c);
  interop::load_hf_weights(*model, tmp / "sharded");
  model->eval();
  torch::NoGradGuard no_grad;
  CHECK(model->loss(expected["x"], expected["y"]).item<double>() ==
        Approx(expected["loss"].item<double>()).epsilon(1e-5));
  // Without the llama3 scaling the same weights give other logits: the test sees rope.
  // (load_hf_weights refuses that model: its weights are copied over instead.)
  c.rope_scaling = {};
  auto unscaled = entry->build(c);
  auto theirs = model->named_parameters();
  for (auto& p : unscaled->named_parameters()) p.value().copy_(theirs[p.key()]);
  unscaled->eval();
  CHECK((unscaled->logits(expected["x"]) - expected["logits"]).abs().max().item<double>() > 1e-3);
}

TEST_CASE("llama merge --hf: from_pretrained gives nnstrain's logits", "[hf][merge][llama]") {
  TempDir tmp;
  {
    std::ofstream out(tmp / "tokens.bin", std::ios::binary);
    uint32_t s = 12345;
    for (int i = 0; i < 4000; ++i) {
      s = s * 1103515245u + 12345u;
      const uint16_t t = static_cast<uint16_t>((s >> 16) % 64);
      out.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  write_train_config(tmp / "llama.yaml", tmp / "tokens.bin", tmp / "run");
  REQUIRE(run({NNSTRAIN_BINARY, "--config", tmp / "llama.yaml"}) == 0);
  const auto src = checkpoint::latest(tmp / "run/ckpt");
  REQUIRE(!src.empty());
  // Through the CLI, as a user would.
  REQUIRE(run({NNSTRAIN_BINARY, "merge", src, "--out", tmp / "hf", "--hf"}) == 0);
  CHECK(exists(tmp / "hf/config.json"));

  const checkpoint::Checkpoint ck(src);
  auto ours = interop::build_model(ck);
  interop::load_model_weights(ck, *ours);
  ours->eval();
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  const auto x = torch::randint(0, 64, {2, 32}, torch::kInt64);  // the full context: all rope positions
  checkpoint::save_tensors(tmp / "ours.safetensors", {{"x", x}, {"logits", ours->logits(x).contiguous()}});
  CHECK(python(kCompareLogits, {tmp / "hf", tmp / "ours.safetensors"}) == 0);

  // The --hf folder back into nnstrain is bitwise the original.
  auto via_hf = build_from_hf(tmp / "hf");
  auto a = ours->named_parameters(), b = via_hf->named_parameters();
  REQUIRE(a.size() == b.size());
  for (const auto& p : a) {
    INFO(p.key());
    CHECK(torch::equal(p.value(), b[p.key()]));
  }
}

TEST_CASE("llama init_from: settings that contradict config.json are refused in both transformers layouts",
          "[hf][llama]") {
  const auto& fixture = hf_fixture();
  TempDir tmp;
  // The fixture's folder twice: config.json with rope under rope_parameters
  // (transformers 5) and as rope_theta + rope_scaling (transformers 4).
  std::ifstream in(fixture / "single/config.json");
  const auto cfg = nlohmann::json::parse(in);
  nlohmann::json v5 = cfg, v4 = cfg;
  nlohmann::json rope = cfg.contains("rope_parameters") ? cfg.at("rope_parameters") : cfg.at("rope_scaling");
  if (!rope.contains("rope_theta")) rope["rope_theta"] = cfg.at("rope_theta");
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = rope;
  v4.erase("rope_parameters");
  v4["rope_theta"] = rope.at("rope_theta");
  rope.erase("rope_theta");
  v4["rope_scaling"] = rope;
  for (const auto& [name, j] : {std::pair<std::string, nlohmann::json>{"v4", v4}, {"v5", v5}}) {
    REQUIRE(::mkdir((tmp / name).c_str(), 0755) == 0);
    std::ofstream(tmp / name + "/config.json") << j.dump(1);
    REQUIRE(::link((fixture / "single/model.safetensors").c_str(), (tmp / name + "/model.safetensors").c_str()) == 0);
  }

  auto c = fixture_config();
  const auto* entry = models::find_model("llama");
  REQUIRE(entry != nullptr);
  auto load = [&](const models::llama::LlamaConfig& cc, const std::string& layout) {
    auto model = entry->build(cc);
    interop::load_hf_weights(*model, tmp / layout);
  };
  using Catch::Matchers::Contains;
  for (const std::string layout : {"v4", "v5"}) {
    INFO(layout);
    CHECK_NOTHROW(load(c, layout));  // matching settings: the check is not a blanket refusal
    auto theta = c;
    theta.rope_theta = 500000.0;
    CHECK_THROWS_WITH(load(theta, layout), Contains("rope_theta is 10000") && Contains("model.args give 500000"));
    auto factor = c;
    factor.rope_scaling.factor = 4.0;
    CHECK_THROWS_WITH(load(factor, layout), Contains("rope_scaling is") && Contains("\"factor\":4.0"));
    auto plain = c;
    plain.rope_scaling = {};
    CHECK_THROWS_WITH(load(plain, layout), Contains("rope_scaling is") && Contains("model.args give null"));
    auto eps = c;
    eps.rms_norm_eps = 1e-6;
    CHECK_THROWS_WITH(load(eps, layout), Contains("rms_norm_eps is 1e-05") && Contains("model.args give 1e-06"));
    auto tied = c;
    tied.tie_word_embeddings = true;
    CHECK_THROWS_WITH(load(tied, layout), Contains("tie_word_embeddings is false"));
  }
}
