// GPT against Hugging Face transformers' GPT2LMHeadModel on the same weights and
// tokens: loss, logits and every gradient. tests/reference/gpt2_reference.py writes
// the reference; the weights reach our model through hf_tensors(), the mapping
// `nnstrain merge --hf` and model.init_from rely on.
#include <catch2/catch.hpp>
#include <dirent.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <set>

#include "models/gpt/gpt.h"
#include "models/registry.h"
#include "trainer/checkpoint/tensor_io.h"

#include "tests/unit/test_support.h"

using namespace nnstrain;

namespace {

using nnstrain::testing::TempDir;
using nnstrain::testing::rel_err;




constexpr double kTol = 1e-5;

// The reference's configuration (tests/reference/gpt2_reference.py).
models::gpt::GptConfig reference_config() {
  models::gpt::GptConfig c;
  c.vocab_size = 97;
  c.block_size = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.dropout = 0.0;
  c.bias = true;
  return c;
}

struct Reference {
  TempDir dir;
  std::map<std::string, torch::Tensor> weights, batch, expected;
  Reference() {
    const std::string script = std::string(NNSTRAIN_SOURCE_DIR) + "/tests/reference/gpt2_reference.py";
    INFO("running " << NNSTRAIN_PYTHON << " " << script);
    REQUIRE(nnstrain::testing::python_file(script, {dir.path}) == 0);
    weights = checkpoint::load_tensors(dir.file("weights.safetensors"));
    batch = checkpoint::load_tensors(dir.file("batch.safetensors"));
    expected = checkpoint::load_tensors(dir.file("expected.safetensors"));
  }
};

// Builds GPT through the registry, as the trainer does, and loads the HF weights
// through hf_tensors(); checks the mapping covers both sides exactly once.
std::shared_ptr<models::CausalLM> build_with(const std::map<std::string, torch::Tensor>& hf) {
  const auto* entry = models::find_model("gpt");
  REQUIRE(entry != nullptr);
  auto model = entry->build(reference_config());
  model->train();
  auto ours = model->named_parameters();
  std::set<std::string> loaded, used;
  torch::NoGradGuard no_grad;
  for (const auto& t : model->hf_tensors()) {
    INFO(t.ours << " <- " << t.theirs);
    auto* p = ours.find(t.ours);
    REQUIRE(p != nullptr);
    auto it = hf.find(t.theirs);
    REQUIRE(it != hf.end());
    auto src = t.transpose ? it->second.t() : it->second;
    REQUIRE(p->sizes() == src.sizes());
    p->copy_(src);
    REQUIRE(loaded.insert(t.ours).second);
    REQUIRE(used.insert(t.theirs).second);
  }
  CHECK(loaded.size() == ours.size());  // every parameter of ours set
  CHECK(used.size() == hf.size());      // every HF tensor used (lm_head is tied, so not separate)
  return model;
}

}  // namespace

TEST_CASE("GPT matches GPT2LMHeadModel: loss, logits and every gradient", "[gpt][parity]") {
  torch::manual_seed(0);
  Reference ref;
  auto model = build_with(ref.weights);
  const auto& x = ref.batch.at("x");
  const auto& y = ref.batch.at("y");

  auto loss = model->loss(x, y);
  const double want_loss = ref.expected.at("loss").item<double>();
  const double loss_err = std::abs(loss.item<double>() - want_loss) / std::abs(want_loss);
  loss.backward();

  double worst = loss_err;
  std::string worst_name = "loss";
  {
    torch::NoGradGuard no_grad;
    const double e = rel_err(model->logits(x), ref.expected.at("logits"));
    if (e > worst) worst = e, worst_name = "logits";
    INFO("logits: relative error " << e);
    CHECK(e < kTol);
  }
  INFO("loss ours " << loss.item<double>() << " reference " << want_loss);
  CHECK(loss_err < kTol);

  auto ours = model->named_parameters();
  size_t compared = 0;
  for (const auto& t : model->hf_tensors()) {
    const auto g = ours[t.ours].grad();
    REQUIRE(g.defined());
    const double e = rel_err(t.transpose ? g.t() : g, ref.expected.at("grad/" + t.theirs));
    INFO("grad of " << t.ours << " (" << t.theirs << "): relative error " << e);
    CHECK(e < kTol);
    if (e > worst) worst = e, worst_name = "grad " + t.ours;
    ++compared;
  }
  CHECK(compared == ours.size());
  WARN("GPT vs GPT2LMHeadModel: worst relative error " << worst << " (" << worst_name << ") over loss, logits and "
                                                        << compared << " gradients");
  CHECK(worst < kTol);
}

TEST_CASE("GPT's tied LM head: wte's gradient holds the embedding's and the head's share", "[gpt][parity]") {
  torch::manual_seed(0);
  Reference ref;
  auto model = build_with(ref.weights);

  // No separate head parameter: the head reads wte.
  for (const auto& p : model->named_parameters()) CHECK(p.key().find("lm_head") == std::string::npos);

  model->loss(ref.batch.at("x"), ref.batch.at("y")).backward();
  const auto g = model->named_parameters()["wte.weight"].grad();
  REQUIRE(g.defined());

  const auto& emb_share = ref.expected.at("tied/wte_embedding_grad");
  const auto& head_share = ref.expected.at("tied/lm_head_grad");
  // The untied reference computes the same loss, so the shares are of the same problem.
  CHECK(std::abs(ref.expected.at("tied/loss").item<double>() - ref.expected.at("loss").item<double>()) <
        1e-6 * std::abs(ref.expected.at("loss").item<double>()));

  const double e_sum = rel_err(g, emb_share + head_share);
  const double e_tied = rel_err(g, ref.expected.at("grad/transformer.wte.weight"));
  // Either share alone is far off: the check above cannot pass by an untied head.
  const double e_emb_only = rel_err(g, emb_share);
  const double e_head_only = rel_err(g, head_share);
  WARN("tied head: wte grad vs embedding + head shares: relative error " << e_sum << "; vs HF tied grad " << e_tied
                                                                          << "; vs embedding share alone " << e_emb_only
                                                                          << ", head share alone " << e_head_only);
  CHECK(e_sum < kTol);
  CHECK(e_tied < kTol);
  CHECK(e_emb_only > 0.1);
  CHECK(e_head_only > 0.1);
}
