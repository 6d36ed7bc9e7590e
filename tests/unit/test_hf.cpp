// Hugging Face in and out, against transformers itself:
// - load_hf_weights + hf_model_config (model.init_from) read what GPT2LMHeadModel's
//   save_pretrained writes, one file or sharded with an index, and nnstrain's loss
//   and logits on a fixed batch equal transformers'; faults name file and tensor;
// - merge --hf of a checkpoint the nnstrain binary trained loads with
//   GPT2LMHeadModel.from_pretrained and gives nnstrain's logits on the same tokens.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <set>

#include <ftw.h>
#include <sys/stat.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "models/gpt/gpt.h"
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

// A tiny GPT2LMHeadModel with seeded random weights (gains and biases too), saved
// as one file, as several files with an index, and once without one tensor; and
// a batch with transformers' loss and logits on it.
constexpr const char* kMakeHf = R"PY(
import json, os, shutil, sys
import torch, torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
out = sys.argv[1]
torch.manual_seed(7)
cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4, activation_function="gelu",
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                 bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(cfg).float().eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
                else 0.05 * torch.randn_like(p))
model.save_pretrained(f"{out}/single")
model.save_pretrained(f"{out}/sharded", max_shard_size="60KB")
assert os.path.exists(f"{out}/sharded/model.safetensors.index.json")
os.makedirs(f"{out}/missing")
shutil.copy(f"{out}/single/config.json", f"{out}/missing/config.json")
sd = load_file(f"{out}/single/model.safetensors")
del sd["transformer.h.1.mlp.c_fc.weight"]
save_file(sd, f"{out}/missing/model.safetensors", metadata={"format": "pt"})
x = torch.randint(0, 97, (3, 32))
y = torch.randint(0, 97, (3, 32))
with torch.no_grad():
    logits = model(input_ids=x).logits
loss = F.cross_entropy(logits.reshape(-1, 97), y.reshape(-1))
save_file({"x": x, "y": y, "logits": logits.contiguous(), "loss": loss}, f"{out}/expected.safetensors")
)PY";

// from_pretrained(DIR) logits on x vs nnstrain's; exit 0 when they agree within 1e-5.
constexpr const char* kCompareLogits = R"PY(
import sys
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
model = GPT2LMHeadModel.from_pretrained(sys.argv[1], attn_implementation="eager").eval()
ours = load_file(sys.argv[2])
with torch.no_grad():
    theirs = model(input_ids=ours["x"]).logits
diff = (theirs - ours["logits"]).abs().max().item()
print(f"max |HF - nnstrain| logits: {diff:.3g} (scale {ours['logits'].abs().max().item():.3g})")
sys.exit(0 if diff < 1e-5 else 1)
)PY";

// kMakeHf's output, made once per process (Catch2 re-enters a test case per SECTION).
const TempDir& hf_fixture() {
  static TempDir dir;
  static const int rc = python(kMakeHf, {dir.path});
  REQUIRE(rc == 0);
  return dir;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
  REQUIRE(out.good());
}

std::shared_ptr<models::CausalLM> build_from_hf(const std::string& dir) {
  const auto* entry = models::find_model("gpt");
  REQUIRE(entry != nullptr);
  auto model = entry->build(*interop::hf_model_config(*entry, dir));
  interop::load_hf_weights(*model, dir);
  model->eval();
  return model;
}

}  // namespace

TEST_CASE("load_hf_weights reads transformers' save_pretrained, one file or sharded", "[hf]") {
  const auto& tmp = hf_fixture();
  auto expected = checkpoint::load_tensors(tmp / "expected.safetensors");
  torch::NoGradGuard no_grad;
  for (const char* dir : {"single", "sharded"}) {
    INFO(dir);
    auto model = build_from_hf(tmp / dir);
    CHECK(model->vocab_size() == 97);
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
  CHECK_FALSE(exists(tmp / "sharded/model.safetensors"));  // really the index path
}

TEST_CASE("load_hf_weights faults name the file and the tensor", "[hf]") {
  const auto& tmp = hf_fixture();
  const auto* entry = models::find_model("gpt");
  TempDir own;  // a copy of "single" for the sections that damage it
  REQUIRE(::mkdir((own / "single").c_str(), 0755) == 0);
  for (const char* f : {"config.json", "model.safetensors"}) copy_file(tmp / "single/" + f, own / "single/" + f);
  SECTION("a missing tensor") {
    auto model = entry->build(*interop::hf_model_config(*entry, tmp / "missing"));
    CHECK_THROWS_WITH(interop::load_hf_weights(*model, tmp / "missing"),
                      Catch::Contains("missing/model.safetensors") &&
                          Catch::Contains("'transformer.h.1.mlp.c_fc.weight'") && Catch::Contains("missing"));
  }
  SECTION("a shape mismatch") {
    models::gpt::GptConfig c;
    c.vocab_size = 97;
    c.block_size = 32;
    c.n_layer = 2;
    c.n_head = 4;
    c.n_embd = 32;  // the checkpoint has 64
    auto model = entry->build(c);
    CHECK_THROWS_WITH(interop::load_hf_weights(*model, tmp / "single"),
                      Catch::Contains("single/model.safetensors") && Catch::Contains("has shape [97,64]") &&
                          Catch::Contains("needs [97,32]"));
  }
  SECTION("another model type") {
    std::ofstream(own / "single/config.json") << R"({"model_type": "llama", "vocab_size": 97})";
    models::gpt::GptConfig c;
    auto model = entry->build(c);
    CHECK_THROWS_WITH(interop::load_hf_weights(*model, own / "single"),
                      Catch::Contains("config.json") && Catch::Contains("model_type 'llama'"));
    CHECK_THROWS_WITH(interop::hf_model_config(*entry, own / "single"), Catch::Contains("config.json"));
  }
  SECTION("no weights at all") {
    auto model = entry->build(*interop::hf_model_config(*entry, own / "single"));
    ::unlink((own / "single/model.safetensors").c_str());
    CHECK_THROWS_WITH(interop::load_hf_weights(*model, own / "single"),
                      Catch::Contains("neither model.safetensors nor model.safetensors.index.json"));
  }
  SECTION("no config.json") {
    CHECK_THROWS_WITH(interop::hf_model_config(*entry, tmp / "nowhere"),
                      Catch::Contains("nowhere/config.json") && Catch::Contains("cannot open"));
  }
}

TEST_CASE("merge --hf: from_pretrained gives nnstrain's logits", "[hf][merge]") {
  TempDir tmp;
  // A token file and a 3-step run of the tiny GPT with the nnstrain binary.
  {
    std::ofstream out(tmp / "tokens.bin", std::ios::binary);
    uint32_t s = 12345;
    for (int i = 0; i < 4000; ++i) {
      s = s * 1103515245u + 12345u;
      const uint16_t t = static_cast<uint16_t>((s >> 16) % 64);
      out.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  REQUIRE(run({NNSTRAIN_BINARY, "--config", std::string(NNSTRAIN_SOURCE_DIR) + "/tests/integration/configs/tiny_gpt.yaml",
               "--vars.data", tmp / "tokens.bin", "--run_dir", tmp / "run", "--checkpoint.save_dir", tmp / "ckpt",
               "--max_train_steps", "3", "--val_every_n_train_steps", "0"}) == 0);
  const auto src = checkpoint::latest(tmp / "ckpt");
  REQUIRE(!src.empty());
  const auto report = interop::merge(src, tmp / "hf", /*hf=*/true);
  CHECK(report.tensors > 0);
  CHECK(exists(tmp / "hf/config.json"));

  // nnstrain's logits from the original checkpoint, through the trainer's names only.
  const checkpoint::Checkpoint ck(src);
  auto ours = interop::build_model(ck);
  interop::load_model_weights(ck, *ours);
  ours->eval();
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  const auto x = torch::randint(0, 64, {2, 16}, torch::kInt64);
  checkpoint::save_tensors(tmp / "ours.safetensors", {{"x", x}, {"logits", ours->logits(x).contiguous()}});
  CHECK(python(kCompareLogits, {tmp / "hf", tmp / "ours.safetensors"}) == 0);

  // The --hf folder back into nnstrain, both ways, is bitwise the original.
  auto via_hf = build_from_hf(tmp / "hf");
  const checkpoint::Checkpoint merged(tmp / "hf");
  auto via_manifest = interop::build_model(merged);
  interop::load_model_weights(merged, *via_manifest);
  auto a = ours->named_parameters(), b = via_hf->named_parameters(), c = via_manifest->named_parameters();
  REQUIRE(a.size() == b.size());
  for (const auto& p : a) {
    INFO(p.key());
    CHECK(torch::equal(p.value(), b[p.key()]));
    CHECK(torch::equal(p.value(), c[p.key()]));
  }
}
