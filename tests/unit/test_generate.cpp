// Generation (models/generate.h) and the KV cache (CausalLM::decode_logits):
// - decoding in pieces through the cache (a prefill, single tokens, and a
//   several-token step after a past) gives the logits of logits() on the whole
//   sequence at every position, for GPT and for Llama (GQA, Llama 3.1 rope);
// - greedy generation with the cache equals recomputing the whole context each
//   step, token for token, with logits within 1e-5 at every step, also past the
//   model's context (the window slides as nanoGPT's generate crops it);
// - sampling: one seed gives the same ids twice and another seed others; top-k 1
//   and a tiny top-p are greedy; draws follow softmax(logits / T); top-k and
//   top-p keep exactly the tokens they should.
// The agreement with Hugging Face's generate() is tests/integration/test_generate.py's.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <set>

#include "models/generate.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"

using namespace nnstrain::models;

namespace {

std::shared_ptr<CausalLM> tiny_gpt(int64_t block = 24) {
  gpt::GptConfig c;
  c.vocab_size = 50;
  c.block_size = block;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  torch::manual_seed(7);
  auto m = std::make_shared<gpt::Gpt>(c);
  // Matrices 4x the 0.02 init (norms left at 1): logits of order 1 with clear
  // gaps, so greedy never hangs on a near tie.
  torch::NoGradGuard ng;
  for (auto& p : m->parameters())
    if (p.dim() == 2) p.mul_(4.0);
  m->eval();
  return m;
}

std::shared_ptr<CausalLM> tiny_llama(int64_t max_pos = 24) {
  llama::LlamaConfig c;
  c.vocab_size = 60;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = max_pos;
  c.initializer_range = 0.3;
  c.rope_scaling.rope_type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_position_embeddings = 8;
  torch::manual_seed(11);
  auto m = std::make_shared<llama::Llama>(c);
  m->eval();
  return m;
}

std::vector<int64_t> prompt_ids() { return {3, 17, 4, 42, 9}; }

struct Run {
  std::vector<int64_t> ids;
  std::vector<torch::Tensor> logits;
};

Run run(CausalLM& m, bool cache, const SamplingOptions& s, uint64_t seed, int64_t n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.kv_cache = cache;
  o.sampling = s;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Run r;
  r.ids = generate(m, prompt_ids(), o, gen, [&](int64_t, const at::Tensor& l) { r.logits.push_back(l.clone()); });
  return r;
}

// Largest difference relative to the reference's largest logit: the two paths
// sum in different orders (and split work over threads differently), so fp32
// rounding grows with the logits; a cache bug differs by O(1) of them.
double rel_diff(const torch::Tensor& a, const torch::Tensor& ref) {
  return (a - ref).abs().max().item<double>() / ref.abs().max().item<double>();
}

void check_pieces_equal_whole(CausalLM& m) {
  torch::InferenceMode im;
  torch::manual_seed(3);
  const auto idx = torch::randint(0, m.vocab_size(), {2, 20}, torch::kLong);
  const auto whole = m.logits(idx);
  common::KvCache cache(20);
  std::vector<torch::Tensor> parts;
  parts.push_back(m.decode_logits(idx.narrow(1, 0, 7), cache));   // prefill
  parts.push_back(m.decode_logits(idx.narrow(1, 7, 1), cache));   // one token
  parts.push_back(m.decode_logits(idx.narrow(1, 8, 5), cache));   // several after a past
  for (int64_t t = 13; t < 20; ++t) parts.push_back(m.decode_logits(idx.narrow(1, t, 1), cache));
  CHECK(cache.length() == 20);
  const auto pieced = torch::cat(parts, 1);
  REQUIRE(pieced.sizes() == whole.sizes());
  CHECK(rel_diff(pieced, whole) < 1e-5);
  // A cache holds no more than its capacity.
  CHECK_THROWS(m.decode_logits(idx.narrow(1, 0, 1), cache));
}

void check_cache_equals_recompute(CausalLM& m, int64_t n) {
  SamplingOptions greedy;
  greedy.temperature = 0;
  const auto with = run(m, true, greedy, 0, n), without = run(m, false, greedy, 0, n);
  REQUIRE(with.ids.size() == size_t(n));
  CHECK(with.ids == without.ids);
  double worst = 0;
  for (size_t i = 0; i < with.logits.size(); ++i)
    worst = std::max(worst, rel_diff(with.logits[i], without.logits[i]));
  CHECK(worst < 1e-5);
  CHECK(std::set<int64_t>(with.ids.begin(), with.ids.end()).size() > 1);  // not a constant sequence
  // Greedy may settle into a short cycle; sampled with one seed, the two paths
  // draw the same varied sequence too (the same logits, the same draws).
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  const auto a = run(m, true, sampled, 42, n), b = run(m, false, sampled, 42, n);
  CHECK(a.ids == b.ids);
  CHECK(std::set<int64_t>(a.ids.begin(), a.ids.end()).size() > 5);
  for (size_t i = 0; i < a.logits.size(); ++i) CHECK(rel_diff(a.logits[i], b.logits[i]) < 1e-5);
}

}  // namespace

TEST_CASE("GPT decode_logits in pieces through the KV cache equals logits() on the whole sequence", "[generate]") {
  auto m = tiny_gpt();
  check_pieces_equal_whole(*m);
}

TEST_CASE("Llama decode_logits in pieces through the KV cache equals logits() on the whole sequence", "[generate]") {
  auto m = tiny_llama();
  check_pieces_equal_whole(*m);
}

TEST_CASE("GPT greedy generation with the KV cache equals recomputing the context, past block_size too",
          "[generate]") {
  auto m = tiny_gpt(24);
  check_cache_equals_recompute(*m, 40);  // 5 + 40 > 24: the window slides for the last 21 tokens
}

TEST_CASE("Llama greedy generation with the KV cache equals recomputing the context, past its window too",
          "[generate]") {
  auto m = tiny_llama(24);
  check_cache_equals_recompute(*m, 40);
}

TEST_CASE("sampling: a seed reproduces, top-k 1 and a tiny top-p are greedy", "[generate]") {
  auto m = tiny_gpt();
  SamplingOptions s;
  s.temperature = 1.0;
  const auto a = run(*m, true, s, 1234, 30), b = run(*m, true, s, 1234, 30), c = run(*m, true, s, 99, 30);
  CHECK(a.ids == b.ids);
  CHECK(a.ids != c.ids);
  SamplingOptions greedy;
  greedy.temperature = 0;
  const auto g = run(*m, true, greedy, 0, 30);
  CHECK(a.ids != g.ids);  // sampling at T = 1 is not greedy on this model
  SamplingOptions k1;
  k1.top_k = 1;
  CHECK(run(*m, true, k1, 1234, 30).ids == g.ids);
  SamplingOptions p0;
  p0.top_p = 1e-6;
  CHECK(run(*m, true, p0, 1234, 30).ids == g.ids);
}

TEST_CASE("sample_next: draws follow softmax(logits / T), top-k and top-p keep the right tokens", "[generate]") {
  const auto logits = torch::tensor({0.5f, 2.0f, -1.0f, 1.5f, 0.0f});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const int n = 20000;
  SamplingOptions s;
  s.temperature = 2.0;
  std::vector<double> counts(5, 0.0);
  for (int i = 0; i < n; ++i) counts[sample_next(logits, s, gen)] += 1;
  // Expected probabilities written out: exp(l / 2) / sum.
  const std::vector<double> l = {0.5, 2.0, -1.0, 1.5, 0.0};
  double z = 0;
  for (double x : l) z += std::exp(x / 2);
  for (int i = 0; i < 5; ++i) CHECK(std::abs(counts[i] / n - std::exp(l[i] / 2) / z) < 0.015);

  // top-k 2: only ids 1 and 3, in the ratio exp(2.0) : exp(1.5).
  SamplingOptions k2;
  k2.top_k = 2;
  std::vector<double> kc(5, 0.0);
  for (int i = 0; i < n; ++i) kc[sample_next(logits, k2, gen)] += 1;
  CHECK(kc[0] + kc[2] + kc[4] == 0);
  CHECK(std::abs(kc[1] / n - std::exp(2.0) / (std::exp(2.0) + std::exp(1.5))) < 0.015);

  // top-p: softmax of the logits is about [.111, .496, .025, .301, .067]; by rank ids 1, 3, 0, 4, 2
  // with 0, .496, .797, .908, .975 likelier than each. 0.6: ids 1 and 3; 0.85 adds id 0.
  for (const auto& [p, allowed] : std::vector<std::pair<double, std::set<int64_t>>>{{0.6, {1, 3}}, {0.85, {0, 1, 3}}}) {
    SamplingOptions sp;
    sp.top_p = p;
    std::set<int64_t> seen;
    for (int i = 0; i < 4000; ++i) seen.insert(sample_next(logits, sp, gen));
    CHECK(seen == allowed);
  }
}
