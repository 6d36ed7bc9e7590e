// Llama: structure and declarations, config parsing, and parity with Hugging
// Face transformers' LlamaForCausalLM on the same weights and tokens.
#include <catch2/catch.hpp>
#include <ftw.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include "models/common/lm_loss.h"
#include "models/llama/llama.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/train/metrics.h"
#include "base/config/load.h"

using nnstrain::models::SplitStyle;
using nnstrain::models::llama::Llama;
using nnstrain::models::llama::LlamaConfig;

namespace {

LlamaConfig tiny_config() {
  LlamaConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.15;
  return c;
}

// max |a - b| / max |b|, in double.
double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto ad = a.to(torch::kDouble), bd = b.to(torch::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

// POSIX, not std::filesystem: libtorch.so exports its own remove_all, which wins
// symbol resolution and crashes (pytorch#133437).
int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

struct TempDir {
  std::string path;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/nnstrain_llama_XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() { ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

void write_file(const std::string& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
  REQUIRE(f.good());
}

// Runs `cmd`, returns its exit status, appends its output to `out`.
int run(const std::string& cmd, std::string& out) {
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe)) out += buf.data();
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Loads the parsed config of `model.args` from a minimal TrainerArgs file.
std::shared_ptr<const LlamaConfig> parse_yaml_args(const std::string& args_yaml) {
  TempDir dir;
  const auto file = dir.file("cfg.yaml");
  write_file(file, "model:\n  type: llama\n  args:\n" + args_yaml +
                       "dataset:\n  train_args: {path: train.bin, seq_len: 8}\nmax_train_steps: 1\n");
  nnstrain::config::LoadOptions opts;
  opts.models.names = {"llama"};
  opts.models.parse = [](const std::string&, nnstrain::config::ArgMap& a) {
    return nnstrain::models::llama::registry_entry().parse_args(a);
  };
  opts.check_files = false;
  opts.reject_unimplemented = false;
  const auto args = nnstrain::config::load_trainer_args(file, opts);
  return std::dynamic_pointer_cast<const LlamaConfig>(args.model.args);
}

}  // namespace

TEST_CASE("llama parameters are named and shaped as Hugging Face's", "[llama]") {
  torch::manual_seed(0);
  auto cfg = tiny_config();
  for (bool tied : {false, true}) {
    cfg.tie_word_embeddings = tied;
    Llama m(cfg);
    const auto params = m.named_parameters();
    const int64_t hd = 8, C = 32;
    CHECK(params["embed_tokens.weight"].sizes() == torch::IntArrayRef({96, C}));
    CHECK(params["layers.1.self_attn.q_proj.weight"].sizes() == torch::IntArrayRef({4 * hd, C}));
    CHECK(params["layers.1.self_attn.k_proj.weight"].sizes() == torch::IntArrayRef({2 * hd, C}));
    CHECK(params["layers.1.self_attn.v_proj.weight"].sizes() == torch::IntArrayRef({2 * hd, C}));
    CHECK(params["layers.1.self_attn.o_proj.weight"].sizes() == torch::IntArrayRef({C, 4 * hd}));
    CHECK(params["layers.0.mlp.gate_proj.weight"].sizes() == torch::IntArrayRef({64, C}));
    CHECK(params["layers.0.mlp.down_proj.weight"].sizes() == torch::IntArrayRef({C, 64}));
    CHECK(params["layers.0.input_layernorm.weight"].sizes() == torch::IntArrayRef({C}));
    CHECK(params["norm.weight"].sizes() == torch::IntArrayRef({C}));
    CHECK(params.contains("lm_head.weight") == !tied);
    // No biases by default; 9 tensors per layer.
    CHECK(params.size() == static_cast<size_t>(2 * 9 + 2 + (tied ? 0 : 1)));
    // Init: norms are ones, matrices N(0, initializer_range).
    CHECK(torch::equal(params["norm.weight"], torch::ones({C})));
    const double sd = params["layers.0.mlp.up_proj.weight"].std().item<double>();
    CHECK(sd == Approx(0.15).epsilon(0.1));

    const auto hf = m.hf_tensors();
    CHECK(hf.size() == params.size());
    std::map<std::string, std::string> names;
    for (const auto& t : hf) {
      CHECK_FALSE(t.transpose);
      names[t.ours] = t.theirs;
    }
    CHECK(names["layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight");
    CHECK(names["norm.weight"] == "model.norm.weight");
    if (!tied) CHECK(names["lm_head.weight"] == "lm_head.weight");
  }
}

TEST_CASE("llama split declaration covers every matrix with Hugging Face's TP plan", "[llama]") {
  auto cfg = tiny_config();
  cfg.attention_bias = cfg.mlp_bias = true;
  Llama m(cfg);
  const auto params = m.named_parameters();
  std::map<std::string, nnstrain::models::ParamSplit> decl;
  for (const auto& s : m.split_declaration()) {
    REQUIRE(params.contains(s.param));
    CHECK(decl.count(s.param) == 0);
    decl[s.param] = s;
    // A split must cut whole units.
    const auto& t = params[s.param];
    const int64_t dim = s.style == SplitStyle::Row ? 1 : 0;
    CHECK(t.size(dim) % s.unit == 0);
  }
  for (const auto& p : params)
    if (p.value().dim() == 2) CHECK(decl.count(p.key()) == 1);
  CHECK(decl["layers.0.self_attn.k_proj.weight"].style == SplitStyle::Column);
  CHECK(decl["layers.0.self_attn.k_proj.weight"].unit == 8);
  CHECK(decl["layers.0.self_attn.k_proj.bias"].style == SplitStyle::Column);
  CHECK(decl["layers.0.self_attn.o_proj.weight"].style == SplitStyle::Row);
  // Query heads split with their key/value head: in groups of 4 / 2 heads of 8.
  CHECK(decl["layers.0.self_attn.q_proj.weight"].unit == 16);
  CHECK(decl["layers.0.self_attn.o_proj.weight"].unit == 16);
  CHECK(decl.count("layers.0.self_attn.o_proj.bias") == 0);  // row bias: replicated
  CHECK(decl["layers.0.mlp.up_proj.weight"].style == SplitStyle::Column);
  CHECK(decl["layers.0.mlp.down_proj.weight"].style == SplitStyle::Row);
  CHECK(decl["embed_tokens.weight"].style == SplitStyle::Vocab);
  CHECK(decl["lm_head.weight"].style == SplitStyle::Vocab);
  CHECK(decl.count("norm.weight") == 0);
}

TEST_CASE("llama attention sharded by heads sums to the whole (GQA, local head counts)", "[llama]") {
  // What tensor parallelism does with the declaration above: each of 2 ranks
  // holds q/k/v rows of its heads and o_proj columns of them; the row-parallel
  // sum of their outputs must be the unsplit attention.
  torch::manual_seed(1);
  auto cfg = tiny_config().resolved();
  nnstrain::models::llama::Attention full(cfg);
  auto shard_cfg = cfg;
  shard_cfg.num_attention_heads /= 2;
  shard_cfg.num_key_value_heads /= 2;
  const int64_t hd = cfg.head_dim, T = 10;
  const auto inv = nnstrain::models::llama::rope_inv_freq(cfg);
  const auto freqs = torch::arange(T, torch::kFloat).unsqueeze(-1) * inv;
  const auto cos = torch::cat({freqs, freqs}, -1).cos(), sin = torch::cat({freqs, freqs}, -1).sin();
  const auto x = torch::randn({2, T, cfg.hidden_size});
  torch::NoGradGuard no_grad;
  const auto want = full->forward(x, cos, sin);
  auto sum = torch::zeros_like(want);
  for (int64_t r = 0; r < 2; ++r) {
    nnstrain::models::llama::Attention shard(shard_cfg);
    const int64_t q = shard_cfg.num_attention_heads * hd, kv = shard_cfg.num_key_value_heads * hd;
    shard->q_proj->weight.copy_(full->q_proj->weight.narrow(0, r * q, q));
    shard->k_proj->weight.copy_(full->k_proj->weight.narrow(0, r * kv, kv));
    shard->v_proj->weight.copy_(full->v_proj->weight.narrow(0, r * kv, kv));
    shard->o_proj->weight.copy_(full->o_proj->weight.narrow(1, r * q, q));
    sum += shard->forward(x, cos, sin);
  }
  CHECK(rel_err(sum, want) < 1e-5);
}

TEST_CASE("llama flops_per_token is 6 x matmul parameters plus attention, and dims for the planner", "[llama]") {
  for (bool tied : {false, true}) {
    auto cfg = tiny_config();
    cfg.tie_word_embeddings = tied;
    Llama m(cfg);
    double matmul = 0;
    for (const auto& p : m.named_parameters())
      if (p.value().dim() == 2) matmul += static_cast<double>(p.value().numel());
    if (!tied) matmul -= 96.0 * 32;  // the untied embedding is a lookup, not a matmul
    const int64_t T = 50;
    CHECK(m.flops_per_token(T) == Approx(6 * matmul + 12.0 * 2 * 32 * T));
    // MFU both ways: counting causal attention's masked half (12 L d T per token, the
    // convention above), and only the unmasked half (6 L d T).
    const auto mfu = nnstrain::train::model_flops_utilization(m.flops_per_token(T), m.flops_per_token(0), 1000.0, 1e9);
    CHECK(mfu.counted == Approx((6 * matmul + 12.0 * 2 * 32 * T) * 1000.0 / 1e9));
    CHECK(mfu.unmasked == Approx((6 * matmul + 6.0 * 2 * 32 * T) * 1000.0 / 1e9));
    const auto d = m.dims();
    CHECK(d.hidden == 32);
    CHECK(d.heads == 4);
    CHECK(d.kv_heads == 2);
    CHECK(d.ffn == 64);
    CHECK(d.vocab == 96);
    CHECK(d.tied_embeddings == tied);
    CHECK(m.lm_head->weight.defined() == !tied);  // untied: the head holds its own weight
  }
}

TEST_CASE("llama flops_per_token counts a sliding layer's band, not the whole causal triangle", "[llama]") {
  auto cfg = tiny_config();  // 2 layers, attention width 32
  Llama full(cfg);
  cfg.layer_windows = {0, 8};  // the second layer slides (window 8)
  Llama sliding(cfg);
  const int64_t T = 50;
  // Its term is twice the mean keys a query sees: (8 x 50 - 8 x 7 / 2) / 50 keys on average.
  const double band = 2 * (8.0 * T - 8.0 * 7 / 2) / T;
  CHECK(sliding.flops_per_token(T) == Approx(full.flops_per_token(0) + 12.0 * 32 * (T + band)));
  CHECK(sliding.flops_per_token(4) == Approx(full.flops_per_token(4)));  // a window past the sequence: all of it
  CHECK(sliding.flops_per_token(0) == Approx(full.flops_per_token(0)));
}

TEST_CASE("llama hf_config round-trips through config_from_hf", "[llama]") {
  auto cfg = tiny_config();
  cfg.head_dim = 16;
  cfg.rope_theta = 500000;
  cfg.rope_scaling.rope_type = "llama3";
  cfg.rope_scaling.factor = 32;
  cfg.rope_scaling.original_max_position_embeddings = 16;
  cfg.tie_word_embeddings = true;
  cfg.mlp_bias = true;
  Llama m(cfg);
  const auto j = m.hf_config();
  CHECK(j.at("architectures").at(0) == "LlamaForCausalLM");
  const auto back = nnstrain::models::llama::config_from_hf(j);
  CHECK(back->head_dim == 16);
  CHECK(back->num_key_value_heads == 2);
  CHECK(back->rope_theta == 500000);
  CHECK(back->rope_scaling.rope_type == "llama3");
  CHECK(back->rope_scaling.factor == 32);
  CHECK(back->rope_scaling.original_max_position_embeddings == 16);
  CHECK(back->tie_word_embeddings);
  CHECK(back->mlp_bias);
  CHECK_FALSE(back->attention_bias);
  CHECK(torch::equal(nnstrain::models::llama::rope_inv_freq(*back), nnstrain::models::llama::rope_inv_freq(cfg)));

  // transformers 5's spelling: theta inside rope_parameters.
  auto v5 = j;
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 250000.0}, {"factor", 4.0},
                           {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}};
  const auto b5 = nnstrain::models::llama::config_from_hf(v5);
  CHECK(b5->rope_theta == 250000);
  CHECK(b5->rope_scaling.factor == 4);
  CHECK(b5->rope_scaling.original_max_position_embeddings == cfg.max_position_embeddings);

  auto bad = j;
  bad["rope_scaling"] = {{"rope_type", "ntk-by-parts"}, {"factor", 4.0}};  // yarn and longrope are read (issue 51)
  CHECK_THROWS_WITH(nnstrain::models::llama::config_from_hf(bad), Catch::Contains("rope_scaling.rope_type 'ntk-by-parts'"));
  bad = j;
  bad.erase("hidden_size");
  CHECK_THROWS_WITH(nnstrain::models::llama::config_from_hf(bad), Catch::Contains("'hidden_size'"));
}

TEST_CASE("llama model.args are parsed and validated with the numbers at fault", "[llama]") {
  auto c = parse_yaml_args(
      "    vocab_size: 64\n    hidden_size: 48\n    intermediate_size: 96\n    num_hidden_layers: 2\n"
      "    num_attention_heads: 6\n    num_key_value_heads: 2\n    max_position_embeddings: 128\n"
      "    rope_theta: 500000\n    tie_word_embeddings: true\n"
      "    rope_scaling: {rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4,"
      " original_max_position_embeddings: 32}\n");
  REQUIRE(c);
  CHECK(c->head_dim == 8);
  CHECK(c->num_key_value_heads == 2);
  CHECK(c->rope_theta == 500000);
  CHECK(c->rope_scaling.rope_type == "llama3");
  CHECK(c->rope_scaling.original_max_position_embeddings == 32);
  CHECK(c->tie_word_embeddings);
  CHECK_FALSE(c->attention_bias);

  using nnstrain::config::ConfigError;
  CHECK_THROWS_WITH(parse_yaml_args("    hidden_size: 48\n    num_attention_heads: 6\n    num_key_value_heads: 4\n"),
                    Catch::Contains("num_key_value_heads") && Catch::Contains("num_attention_heads 6") &&
                        Catch::Contains("num_key_value_heads 4"));
  CHECK_THROWS_WITH(parse_yaml_args("    hidden_size: 50\n    num_attention_heads: 4\n"),
                    Catch::Contains("hidden_size 50") && Catch::Contains("num_attention_heads 4"));
  CHECK_THROWS_WITH(parse_yaml_args("    rope_scaling: {rope_type: ntk}\n"), Catch::Contains("rope_type"));
  CHECK_THROWS_WITH(parse_yaml_args("    rope_scaling: {rope_type: yarn}\n"), Catch::Contains("rope_scaling.factor"));
  CHECK_THROWS_AS(parse_yaml_args("    num_kv_heads: 2\n"), ConfigError);  // unknown key
}

TEST_CASE("llama logits and loss agree, and the loss honours chunking and recompute", "[llama]") {
  torch::manual_seed(2);
  Llama m(tiny_config());
  const auto idx = torch::randint(96, {2, 12}), targets = torch::randint(96, {2, 12});
  const auto logits = m.logits(idx);
  CHECK(logits.sizes() == torch::IntArrayRef({2, 12, 96}));
  const auto want = torch::nn::functional::cross_entropy(logits.reshape({-1, 96}), targets.reshape({-1}));
  CHECK(m.loss(idx, targets).item<double>() == Approx(want.item<double>()).epsilon(1e-6));
  nnstrain::models::RuntimeOptions opts;
  opts.loss = nnstrain::models::common::LossKind::Chunked;
  opts.loss_chunk_size = 5;
  opts.recompute_layers = {true, false};
  m.set_runtime_options(opts);
  CHECK(m.loss(idx, targets).item<double>() == Approx(want.item<double>()).epsilon(1e-6));
  CHECK_THROWS_WITH(m.loss(torch::randint(96, {1, 65}), torch::randint(96, {1, 65})),
                    Catch::Contains("max_position_embeddings 64"));
}

namespace {

struct ParityCase {
  std::string name, attn;
  LlamaConfig cfg;
  int64_t seq;
};

void check_parity(const ParityCase& pc) {
  TempDir dir;
  torch::manual_seed(0);
  write_file(dir.file("ours_config.json"), Llama(pc.cfg).hf_config().dump(2));
  const std::string script = std::string(NNSTRAIN_SOURCE_DIR) + "/tests/reference/llama_reference.py";
  std::string out;
  const int rc = run(std::string("OMP_NUM_THREADS=1 '") + NNSTRAIN_PYTHON + "' '" + script + "' '" +
                         dir.path + "' --attn " + pc.attn + " --seq " + std::to_string(pc.seq),
                     out);
  INFO(out);
  REQUIRE(rc == 0);

  // Build ours from transformers' own config.json and weights.
  nlohmann::json hf_json;
  std::ifstream(dir.file("hf/config.json")) >> hf_json;
  const auto cfg = nnstrain::models::llama::config_from_hf(hf_json);
  CHECK(cfg->num_key_value_heads == pc.cfg.num_key_value_heads);
  CHECK(cfg->rope_scaling.rope_type == pc.cfg.rope_scaling.rope_type);
  CHECK(cfg->tie_word_embeddings == pc.cfg.tie_word_embeddings);
  Llama m(*cfg);
  auto weights = nnstrain::checkpoint::load_tensors(dir.file("hf/model.safetensors"));
  auto ref = nnstrain::checkpoint::load_tensors(dir.file("reference.safetensors"));
  auto params = m.named_parameters();
  const auto names = m.hf_tensors();
  REQUIRE(names.size() == weights.size());
  {
    torch::NoGradGuard no_grad;
    for (const auto& t : names) {
      INFO(t.theirs);
      REQUIRE(weights.count(t.theirs) == 1);
      params[t.ours].copy_(weights.at(t.theirs));
    }
  }
  // The rotary frequencies, Llama 3.1 scaling included, bit for bit.
  CHECK(torch::equal(nnstrain::models::llama::rope_inv_freq(*cfg), ref.at("inv_freq")));

  const auto& idx = ref.at("input_ids");
  const auto& targets = ref.at("targets");
  auto compare = [&](const std::string& how) {
    m.zero_grad();
    auto loss = m.loss(idx, targets);
    loss.backward();
    const double loss_err = rel_err(loss.reshape({1}), ref.at("loss"));
    double worst = 0;
    std::string worst_name = "all exact";
    for (const auto& t : names) {
      const double e = rel_err(params[t.ours].grad(), ref.at("grad." + t.theirs));
      INFO(how << ": grad of " << t.theirs << " rel err " << e);
      CHECK(e < 1e-5);
      if (e > worst) worst = e, worst_name = t.theirs;
    }
    std::cout << "llama parity [" << pc.name << ", " << how << "]: loss rel err " << loss_err
              << ", max grad rel err " << worst << " (" << worst_name << ")\n";
    CHECK(loss_err < 1e-5);
  };
  compare("plain");
  nnstrain::models::RuntimeOptions opts;
  opts.loss = nnstrain::models::common::LossKind::Chunked;
  opts.loss_chunk_size = 7;
  opts.recompute_layers.assign(cfg->num_hidden_layers, true);
  m.set_runtime_options(opts);
  compare("chunked loss + recompute");
}

}  // namespace

TEST_CASE("llama matches transformers' LlamaForCausalLM: GQA, untied, sdpa", "[llama][parity]") {
  check_parity({"gqa-untied-sdpa", "sdpa", tiny_config(), 16});
}

TEST_CASE("llama matches transformers' LlamaForCausalLM: Llama 3.1 rope scaling, tied, biases, eager",
          "[llama][parity]") {
  auto cfg = tiny_config();
  cfg.vocab_size = 64;
  cfg.intermediate_size = 48;
  cfg.head_dim = 16;  // explicit, != hidden / heads
  cfg.max_position_embeddings = 32;
  cfg.rope_theta = 500000;
  cfg.rope_scaling.rope_type = "llama3";
  cfg.rope_scaling.factor = 8;
  cfg.rope_scaling.low_freq_factor = 1;
  cfg.rope_scaling.high_freq_factor = 4;
  cfg.rope_scaling.original_max_position_embeddings = 8;  // small: scaling changes every frequency
  cfg.tie_word_embeddings = true;
  cfg.attention_bias = cfg.mlp_bias = true;
  // The scaling must matter for this case to test it.
  auto unscaled = cfg;
  unscaled.rope_scaling.rope_type = "default";
  REQUIRE_FALSE(torch::allclose(nnstrain::models::llama::rope_inv_freq(cfg),
                                nnstrain::models::llama::rope_inv_freq(unscaled)));
  check_parity({"llama3-rope-tied-bias-eager", "eager", cfg, 24});
}
