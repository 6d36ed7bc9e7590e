// Document masking (dataset document_mask): a packed sample's per-token losses
// equal those of each document run on its own, for GPT and Llama.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <vector>

#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "models/registry.h"

using nnstrain::models::CausalLM;
using nnstrain::models::Documents;

namespace {

std::shared_ptr<CausalLM> tiny(const std::string& type) {
  std::shared_ptr<CausalLM> m;
  if (type == "gpt") {
    nnstrain::models::gpt::GptConfig c;
    c.vocab_size = 97, c.block_size = 32, c.n_layer = 2, c.n_head = 4, c.n_embd = 32, c.dropout = 0.0;
    m = nnstrain::models::find_model("gpt")->build(c);
  } else {
    nnstrain::models::llama::LlamaConfig c;
    c.vocab_size = 97, c.hidden_size = 32, c.intermediate_size = 64, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 32, c.initializer_range = 0.15;
    m = nnstrain::models::find_model("llama")->build(c);
  }
  m->to(torch::kDouble);  // per-token losses compared to 1e-6 need no float noise
  m->eval();
  return m;
}

// The loss of the one target (b, t) alone: every other target -100.
double token_loss(CausalLM& m, const torch::Tensor& idx, const torch::Tensor& targets, int64_t b, int64_t t,
                  const Documents& docs = {}) {
  auto y = torch::full_like(targets, -100);
  y[b][t] = targets[b][t];
  return m.loss(idx, y, docs).item<double>();
}

}  // namespace

TEST_CASE("document masking equals running each document alone (GPT and Llama)", "[document_mask]") {
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  const int64_t T = 16;
  // Two packed samples: documents of 5, 7 and 4 tokens; of 9 and 7.
  const std::vector<std::vector<int64_t>> lengths = {{5, 7, 4}, {9, 7}};
  auto idx = torch::randint(0, 97, {2, T}, torch::kLong);
  auto seg = torch::empty({2, T}, torch::kLong), pos = torch::empty({2, T}, torch::kLong);
  auto targets = torch::full({2, T}, -100, torch::kLong);
  for (int64_t b = 0; b < 2; ++b) {
    int64_t start = 0, d = 0;
    for (int64_t len : lengths[size_t(b)]) {
      for (int64_t i = 0; i < len; ++i) {
        seg[b][start + i] = d;
        pos[b][start + i] = i;
        if (i + 1 < len) targets[b][start + i] = idx[b][start + i + 1];  // no target across documents
      }
      start += len, ++d;
    }
  }
  const Documents docs{pos, seg};
  for (const std::string type : {"gpt", "llama"}) {
    INFO(type);
    auto m = tiny(type);
    int64_t compared = 0;
    double differs = 0;  // how far plain causal attention over the packed sample is from the separate runs
    for (int64_t b = 0; b < 2; ++b) {
      int64_t start = 0;
      for (int64_t len : lengths[size_t(b)]) {
        const auto doc_idx = idx[b].narrow(0, start, len).unsqueeze(0);
        const auto doc_targets = targets[b].narrow(0, start, len).unsqueeze(0);
        for (int64_t i = 0; i + 1 < len; ++i) {
          const double alone = token_loss(*m, doc_idx, doc_targets, 0, i);
          const double packed = token_loss(*m, idx, targets, b, start + i, docs);
          CHECK(packed == Approx(alone).margin(1e-6).epsilon(0));
          differs = std::max(differs, std::abs(token_loss(*m, idx, targets, b, start + i) - alone));
          ++compared;
        }
        start += len;
      }
    }
    CHECK(compared == (4 + 6 + 3) + (8 + 6));
    CHECK(differs > 1e-3);  // the mask and the positions matter: without them the later documents differ
    // The whole batch: the mean over counted targets, masked, equals the mean of the separate runs' token losses.
    double sum = 0;
    for (int64_t b = 0; b < 2; ++b) {
      int64_t start = 0;
      for (int64_t len : lengths[size_t(b)]) {
        const auto doc_idx = idx[b].narrow(0, start, len).unsqueeze(0);
        const auto doc_targets = targets[b].narrow(0, start, len).unsqueeze(0);
        sum += m->loss(doc_idx, doc_targets).item<double>() * double(len - 1);
        start += len;
      }
    }
    CHECK(m->loss(idx, targets, docs).item<double>() == Approx(sum / double(compared)).margin(1e-9));
  }
}

TEST_CASE("Documents::attention_mask is block-diagonal causal", "[document_mask]") {
  const auto seg = torch::tensor({0, 0, 1, 1, 1, 2}, torch::kLong).unsqueeze(0);
  const auto mask = Documents{torch::zeros_like(seg), seg}.attention_mask();
  REQUIRE(mask.sizes() == std::vector<int64_t>({1, 1, 6, 6}));
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 6; ++j) {
      const bool want = j <= i && seg[0][i].item<int64_t>() == seg[0][j].item<int64_t>();
      CHECK(mask[0][0][i][j].item<bool>() == want);
    }
}
