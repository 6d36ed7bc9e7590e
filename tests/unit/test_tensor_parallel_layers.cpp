// Typed tensor-parallel layers without processes: models built for rank r of a
// tp group on meta and materialised on the CPU, put together by their layouts,
// equal the one-process model bitwise; the vocab-parallel loss and logits over
// two threads (a fake TpComm) equal the unsplit ones, ignore_index and padding included.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "models/common/init.h"
#include "models/common/layers.h"
#include "models/common/parallel_rng.h"
#include "models/common/recompute.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "models/model.h"
#include "test_support.h"
#include "trainer/interop/hf_import.h"
#include "trainer/checkpoint/tensor_io.h"

using nnstrain::models::CausalLM;
using nnstrain::models::SplitStyle;
using nnstrain::models::common::ParamLayout;
using nnstrain::models::common::ShardingContext;
using nnstrain::models::common::TpComm;
namespace common = nnstrain::models::common;

namespace {

// A communicator a model must not call while it is only built and materialised.
struct NoComm : TpComm {
  void all_reduce(at::Tensor&) override { FAIL("all_reduce called"); }
  void all_reduce_max(at::Tensor&) override { FAIL("all_reduce_max called"); }
  at::Tensor all_gather(const at::Tensor&) override { FAIL("all_gather called"); return {}; }
  at::Tensor reduce_scatter(const at::Tensor&) override { FAIL("reduce_scatter called"); return {}; }
};

ShardingContext meta_context(int tp, int rank) {
  ShardingContext ctx;
  ctx.tp = tp;
  ctx.rank = rank;
  ctx.options = ctx.options.device(c10::kMeta);
  if (tp > 1) ctx.comm = c10::make_intrusive<NoComm>();
  return ctx;
}

using Build = std::function<std::shared_ptr<CausalLM>(const ShardingContext&)>;
using Materialise = std::function<void(CausalLM&)>;

// Every rank's pieces written into global tensors; each element written exactly once
// for split parameters, and replicated ones equal on every rank.
std::map<std::string, at::Tensor> assemble(const Build& build, int tp, const Materialise& materialise) {
  std::map<std::string, at::Tensor> whole, written;
  for (int r = 0; r < tp; ++r) {
    auto model = build(meta_context(tp, r));
    materialise(*model);
    const auto params = model->named_parameters();
    for (const auto& l : model->param_layouts()) {
      const auto& local = params[l.name];
      REQUIRE(local.sizes().vec() == l.local_shape);
      REQUIRE(local.device().is_cpu());
      if (!whole.count(l.name)) {
        whole[l.name] = torch::full(l.global_shape, std::nan(""));
        written[l.name] = torch::zeros(l.global_shape, torch::kInt);
      }
      int64_t row = 0;
      for (const auto& b : l.blocks) {
        auto dst = whole[l.name], cnt = written[l.name];
        for (size_t d = 0; d < b.shape.size(); ++d) {
          dst = dst.narrow(int64_t(d), b.offsets[d], b.shape[d]);
          cnt = cnt.narrow(int64_t(d), b.offsets[d], b.shape[d]);
        }
        const auto piece = local.narrow(0, row, b.shape[0]);
        if (l.split_here()) {
          dst.copy_(piece);
          cnt.add_(1);
        } else if (r == 0) {
          dst.copy_(piece);
          cnt.fill_(1);
        } else {
          CHECK(torch::equal(dst, piece));  // replicated: the same on every rank
        }
        row += b.shape[0];
      }
      // Padding rows (a vocabulary tp does not divide) are zero.
      if (row < local.size(0)) CHECK(local.narrow(0, row, local.size(0) - row).abs().max().item<float>() == 0);
    }
  }
  for (const auto& item : written) {
    INFO(item.first);
    CHECK(item.second.eq(1).all().item<bool>());
  }
  return whole;
}

std::map<std::string, at::Tensor> assemble(const Build& build, int tp, uint64_t seed) {
  return assemble(build, tp, [seed](CausalLM& m) { common::materialise_fresh(m, c10::Device(c10::kCPU), seed); });
}

void check_shards_equal_one_process(const Build& build, std::vector<int> tps) {
  const uint64_t seed = 1337;
  const auto ref = assemble(build, 1, seed);
  // Not trivially equal: the weights are random and differ between parameters.
  bool some_split = false;
  for (int tp : tps) {
    const auto got = assemble(build, tp, seed);
    REQUIRE(got.size() == ref.size());
    for (const auto& [name, t] : ref) {
      INFO("tp " << tp << ": " << name);
      CHECK(torch::equal(got.at(name), t));
    }
    auto m = build(meta_context(tp, 0));
    for (const auto& l : m->param_layouts()) some_split |= l.split_here();
  }
  CHECK(some_split);
}

// A 2-layer GPT over 16 tokens.
nnstrain::models::gpt::GptConfig small_gpt(int64_t vocab, int64_t heads, int64_t embd, bool bias) {
  nnstrain::models::gpt::GptConfig cfg;
  cfg.vocab_size = vocab;
  cfg.block_size = 16;
  cfg.n_layer = 2;
  cfg.n_head = heads;
  cfg.n_embd = embd;
  cfg.bias = bias;
  return cfg;
}

}  // namespace

TEST_CASE("fresh init: GPT shards at tp 2 and 4 put together equal tp 1 bitwise", "[tp_layers]") {
  auto cfg = small_gpt(64, 4, 32, true);
  Build build = [&](const ShardingContext& ctx) { return std::make_shared<nnstrain::models::gpt::Gpt>(cfg, ctx); };
  check_shards_equal_one_process(build, {2, 4});
  // A vocabulary tp does not divide: 65 rows as 33 + 32 at tp 2, 17 + 17 + 17 + 14 at tp 4.
  auto odd = cfg;
  odd.vocab_size = 65;
  Build build_odd = [&](const ShardingContext& ctx) { return std::make_shared<nnstrain::models::gpt::Gpt>(odd, ctx); };
  check_shards_equal_one_process(build_odd, {2, 4});
  CHECK(build_odd(meta_context(4, 3))->named_parameters()["wte.weight"].size(0) == 14);

  // The rules are nanoGPT's: 0.02, residual projections 0.02 / sqrt(2 L), zero biases, unit LN weights.
  auto m = build(meta_context(1, 0));
  common::materialise_fresh(*m, c10::Device(c10::kCPU), 7);
  const auto p = m->named_parameters();
  CHECK(p["h.0.attn.c_attn.weight"].std().item<double>() == Approx(0.02).epsilon(0.1));
  CHECK(p["h.1.mlp.c_proj.weight"].std().item<double>() == Approx(0.01).epsilon(0.1));
  CHECK(p["h.0.attn.c_attn.bias"].abs().max().item<float>() == 0);
  CHECK(p["ln_f.weight"].eq(1).all().item<bool>());
  CHECK(!torch::equal(p["h.0.attn.c_attn.weight"].narrow(0, 0, 32), p["h.1.attn.c_attn.weight"].narrow(0, 0, 32)));
  // Another seed, other values.
  auto m2 = build(meta_context(1, 0));
  common::materialise_fresh(*m2, c10::Device(c10::kCPU), 8);
  CHECK(!torch::equal(m2->named_parameters()["wte.weight"], p["wte.weight"]));
}

TEST_CASE("fresh init: Llama (GQA, untied and tied) shards at tp 2 and 4 equal tp 1 bitwise", "[tp_layers]") {
  for (bool tied : {false, true}) {
    nnstrain::models::llama::LlamaConfig cfg;
    cfg.vocab_size = 96;
    cfg.hidden_size = 64;
    cfg.intermediate_size = 64;
    cfg.num_hidden_layers = 2;
    cfg.num_attention_heads = 8;
    cfg.num_key_value_heads = 4;
    cfg.max_position_embeddings = 32;
    cfg.attention_bias = true;
    cfg.tie_word_embeddings = tied;
    INFO("tied " << tied);
    Build build = [&](const ShardingContext& ctx) {
      return std::make_shared<nnstrain::models::llama::Llama>(cfg, ctx);
    };
    check_shards_equal_one_process(build, {2, 4});
    // One vocab-parallel head, on the right weight.
    auto m = build(meta_context(2, 1));
    CHECK(m->named_parameters().contains("lm_head.weight") == !tied);
    int vocab_splits = 0;
    for (const auto& s : m->split_declaration()) vocab_splits += s.style == SplitStyle::Vocab;
    CHECK(vocab_splits == (tied ? 1 : 2));
  }
}

TEST_CASE("fresh init: heads tp does not divide split unevenly (6 over 4: 2, 2, 1, 1) and equal tp 1 bitwise",
          "[tp_layers]") {
  // shakespeare_char's shape, smaller: 6 heads, an MLP tp divides, a vocabulary it does not.
  auto cfg = small_gpt(65, 6, 48, false);
  Build build = [&](const ShardingContext& ctx) { return std::make_shared<nnstrain::models::gpt::Gpt>(cfg, ctx); };
  check_shards_equal_one_process(build, {4, 5});
  const std::vector<int64_t> want_heads{2, 2, 1, 1};
  for (int r = 0; r < 4; ++r) {
    auto m = std::dynamic_pointer_cast<nnstrain::models::gpt::Gpt>(build(meta_context(4, r)));
    auto attn = m->h->ptr<nnstrain::models::gpt::BlockImpl>(0)->attn;
    INFO("rank " << r);
    CHECK(attn->heads == want_heads[r]);
    const auto p = m->named_parameters();
    CHECK(p["h.0.attn.c_attn.weight"].size(0) == 3 * want_heads[r] * 8);  // this rank's heads of Q, K and V
    CHECK(p["h.0.attn.c_proj.weight"].size(1) == want_heads[r] * 8);      // and their output columns
    CHECK(p["h.0.mlp.c_fc.weight"].size(0) == 48);                        // 192 / 4
  }
  // Llama with GQA: key/value heads split unevenly, each carrying its query group (kv 2, 1, 1; q 4, 2, 2).
  nnstrain::models::llama::LlamaConfig lc;
  lc.vocab_size = 96;
  lc.hidden_size = 64;
  lc.intermediate_size = 96;
  lc.num_hidden_layers = 1;
  lc.num_attention_heads = 8;
  lc.num_key_value_heads = 4;
  lc.max_position_embeddings = 32;
  Build build_llama = [&](const ShardingContext& ctx) { return std::make_shared<nnstrain::models::llama::Llama>(lc, ctx); };
  check_shards_equal_one_process(build_llama, {3});
  const std::vector<int64_t> kv{2, 1, 1};
  int64_t q_offset = 0;
  for (int r = 0; r < 3; ++r) {
    auto m = std::dynamic_pointer_cast<nnstrain::models::llama::Llama>(build_llama(meta_context(3, r)));
    auto attn = m->layers->ptr<nnstrain::models::llama::DecoderLayerImpl>(0)->self_attn;
    INFO("rank " << r);
    CHECK(attn->kv_heads == kv[r]);
    CHECK(attn->heads == 2 * kv[r]);
    for (const auto& l : m->param_layouts())
      if (l.name == "layers.0.self_attn.q_proj.weight") {
        CHECK(l.blocks[0].offsets[0] == q_offset);  // query heads 4r.. with key/value heads 2r..
        q_offset += l.blocks[0].shape[0];
      }
  }
  CHECK(q_offset == 64);
}

TEST_CASE("fresh init: pieces spanning several generated row blocks, column and row split", "[tp_layers]") {
  // 3000 rows of 1200: blocks of 873 rows, so pieces straddle block edges.
  const std::vector<int64_t> shape{3000, 1200};
  REQUIRE(common::init_rows_per_block(shape) < 1500);
  auto whole = torch::zeros(shape);
  ParamLayout ref = common::replicated_layout("x.weight", shape, common::InitRule::normal(1.0));
  common::fill_fresh(ref, whole, 5);
  for (int tp : {2, 3, 4}) {
    for (int r = 0; r < tp; ++r) {
      auto ctx = meta_context(tp, r);
      for (auto l : {common::column_layout("x.weight", ctx, shape, {1200, 1200, 600}, 1, common::InitRule::normal(1.0)),
                     common::row_layout("x.weight", ctx, shape, 1, common::InitRule::normal(1.0))}) {
        auto local = torch::zeros(l.local_shape);
        common::fill_fresh(l, local, 5);
        int64_t row = 0;
        for (const auto& b : l.blocks) {
          const auto want = whole.narrow(0, b.offsets[0], b.shape[0]).narrow(1, b.offsets[1], b.shape[1]);
          INFO("tp " << tp << " rank " << r << " " << (l.split.style == SplitStyle::Row ? "row" : "column"));
          CHECK(torch::equal(local.narrow(0, row, b.shape[0]), want));
          row += b.shape[0];
        }
      }
    }
  }
}

namespace {

// Collectives between threads of one process (one thread per rank).
struct ThreadGroup {
  explicit ThreadGroup(int n) : n(n), slots(n) {}
  std::vector<at::Tensor> exchange(int rank, const at::Tensor& t) {
    std::unique_lock<std::mutex> lock(m);
    slots[rank] = t.detach().clone();
    const int64_t my = generation;
    if (++arrived == n) {
      arrived = 0;
      result = slots;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != my; });
    }
    return result;
  }
  int n, arrived = 0;
  int64_t generation = 0;
  std::mutex m;
  std::condition_variable cv;
  std::vector<at::Tensor> slots, result;
  int calls = 0;
};

struct ThreadComm : TpComm {
  ThreadComm(ThreadGroup& g, int rank) : g(g), rank(rank) {}
  void all_reduce(at::Tensor& t) override {
    auto v = g.exchange(rank, t);
    t.copy_(torch::stack(v).sum(0));
  }
  void all_reduce_max(at::Tensor& t) override {
    auto v = g.exchange(rank, t);
    t.copy_(std::get<0>(torch::stack(v).max(0)));
  }
  at::Tensor all_gather(const at::Tensor& t) override { return torch::stack(g.exchange(rank, t)); }
  at::Tensor reduce_scatter(const at::Tensor& t) override {
    auto v = g.exchange(rank, t);
    auto out = torch::zeros_like(t[rank]);
    for (auto& x : v) out += x[rank];
    return out;
  }
  ThreadGroup& g;
  int rank;
};

}  // namespace

TEST_CASE("vocab-parallel loss (plain, chunked and fused) and logits over 2 ranks equal the unsplit ones, "
          "ignore_index and vocabulary padding included", "[tp_layers]") {
  namespace F = torch::nn::functional;
  torch::manual_seed(3);
  const int64_t N = 14, C = 8, V = 9;  // 9 rows over 2 ranks: 5 + 4 and one padding row
  const int tp = 2;
  const auto hidden = torch::randn({2, N / 2, C}, torch::kDouble);
  const auto weight = torch::randn({V, C}, torch::kDouble);
  for (int64_t ignore : {int64_t{-100}, int64_t{3}}) {
    auto targets = torch::randint(V, {2, N / 2});
    targets[0][1] = ignore;
    targets[1][4] = ignore;
    targets[1][5] = 3;  // the ignored id itself when ignore == 3
    REQUIRE(targets.ne(ignore).sum().item<int64_t>() < N);
    // The reference: F::cross_entropy on the whole logits.
    auto h_ref = hidden.clone().requires_grad_(true);
    auto w_ref = weight.clone().requires_grad_(true);
    auto ref = F::cross_entropy(F::linear(h_ref.reshape({-1, C}), w_ref), targets.reshape({-1}),
                                F::CrossEntropyFuncOptions().ignore_index(ignore));
    ref.backward();
    const auto full_logits = F::linear(hidden, weight);

    // (no structured binding: the thread lambdas capture these, which C++17 forbids)
    for (const auto& kc : {std::pair{common::LossKind::Plain, int64_t{0}},
                           std::pair{common::LossKind::Chunked, int64_t{4}},
                           std::pair{common::LossKind::Fused, int64_t{4}},
                           std::pair{common::LossKind::Fused, int64_t{100}}}) {
      const auto kind = kc.first;
      const int64_t chunk = kc.second;
      INFO("ignore_index " << ignore << ", loss kind " << int(kind) << ", chunk " << chunk);
      ThreadGroup group(tp);
      std::vector<double> loss(tp);
      std::vector<at::Tensor> gh(tp), gw(tp), logits(tp);
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r)
        threads.emplace_back([&, r] {
          ShardingContext ctx;
          ctx.tp = tp;
          ctx.rank = r;
          ctx.options = ctx.options.dtype(torch::kDouble);
          ctx.comm = c10::make_intrusive<ThreadComm>(group, r);
          common::ParallelLmHead head(ctx, V, C, /*own_weight=*/false, common::InitRule::normal(1.0));
          const int64_t rows = 5, start = r * rows, held = std::min<int64_t>(rows, V - start);
          auto w = weight.narrow(0, start, held).clone().requires_grad_(true);  // rank 1: 4 true rows, no padding row
          auto h = hidden.clone().requires_grad_(true);
          auto l = head->loss(h, w, targets, kind, chunk, ignore);
          l.backward();
          loss[r] = l.item<double>();
          gh[r] = h.grad();
          gw[r] = w.grad();
          torch::NoGradGuard no_grad;
          logits[r] = head->logits(hidden, w.detach());
        });
      for (auto& t : threads) t.join();
      for (int r = 0; r < tp; ++r) {
        INFO("rank " << r);
        CHECK(loss[r] == Approx(ref.item<double>()).epsilon(1e-12));
        CHECK(torch::allclose(gh[r], h_ref.grad(), 1e-10, 1e-12));
        const int64_t start = r * 5, held = std::min<int64_t>(5, V - start);
        CHECK(gw[r].size(0) == held);
        CHECK(torch::allclose(gw[r], w_ref.grad().narrow(0, start, held), 1e-10, 1e-12));
        CHECK(logits[r].sizes() == full_logits.sizes());  // padding column dropped
        CHECK(torch::allclose(logits[r], full_logits, 1e-12, 1e-12));
      }
    }
  }
}

TEST_CASE("HF init_from at tp 2 reads only each rank's slices and equals the tp 1 load", "[tp_layers]") {
  nnstrain::models::llama::LlamaConfig lcfg;
  lcfg.vocab_size = 512;
  lcfg.hidden_size = 128;
  lcfg.intermediate_size = 256;
  lcfg.num_hidden_layers = 2;
  lcfg.num_attention_heads = 4;
  lcfg.num_key_value_heads = 2;
  lcfg.max_position_embeddings = 32;
  nnstrain::models::gpt::GptConfig gcfg;
  gcfg.vocab_size = 64;
  gcfg.block_size = 16;
  gcfg.n_layer = 2;
  gcfg.n_head = 4;
  gcfg.n_embd = 32;
  const std::vector<std::pair<std::string, Build>> models = {
      {"llama", [&](const ShardingContext& c) { return std::make_shared<nnstrain::models::llama::Llama>(lcfg, c); }},
      {"gpt", [&](const ShardingContext& c) { return std::make_shared<nnstrain::models::gpt::Gpt>(gcfg, c); }}};
  for (const auto& [type, build] : models) {
    INFO(type);
    // A Hugging Face folder written from a fresh one-process model.
    nnstrain::testing::TempDir dir("nnstrain_hf_tp");
    auto src = build(meta_context(1, 0));
    common::materialise_fresh(*src, c10::Device(c10::kCPU), 11);
    const auto params = src->named_parameters();
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& h : src->hf_tensors()) {
      auto t = params[h.ours];
      tensors.push_back({h.theirs, h.transpose ? t.t().contiguous() : t});
    }
    nnstrain::checkpoint::save_tensors(dir / "model.safetensors", tensors);
    { std::ofstream(dir / "config.json") << src->hf_config().dump(); }

    std::vector<nnstrain::interop::HfLoadReport> reports;
    auto load = [&](CausalLM& m) { reports.push_back(nnstrain::interop::load_hf_weights(m, dir.path)); };
    const auto one = assemble(build, 1, load);
    const auto two = assemble(build, 2, load);
    for (const auto& [name, t] : one) {
      INFO(name);
      CHECK(torch::equal(t, params[name]));
      CHECK(torch::equal(two.at(name), t));
    }
    REQUIRE(reports.size() == 3);
    CHECK(reports[0].bytes_read == reports[0].bytes_needed);
    for (int r = 1; r <= 2; ++r) {
      const double share = double(reports[r].bytes_read) / double(reports[r].bytes_needed);
      INFO("rank " << r - 1 << " read " << reports[r].bytes_read << " of " << reports[r].bytes_needed << " bytes");
      CHECK(share < 0.55);  // half of every split tensor, plus the small replicated ones
      CHECK(share > 0.45);
    }
  }
}

namespace {
// One rank alone: every collective is the identity (enough to run a rank's forward).
struct SoloComm : TpComm {
  void all_reduce(at::Tensor&) override {}
  void all_reduce_max(at::Tensor&) override {}
  at::Tensor all_gather(const at::Tensor& t) override { return t.unsqueeze(0); }
  at::Tensor reduce_scatter(const at::Tensor& t) override { return t[0]; }
};
}  // namespace

TEST_CASE("model-parallel RNG: a fork draws per TP rank and leaves the default stream as it was", "[tp_layers]") {
  using nnstrain::models::common::ParallelRng;
  const c10::Device cpu(c10::kCPU);
  CHECK(common::parallel_rng_seed(1337, 0, 0) != common::parallel_rng_seed(1337, 0, 1));
  CHECK(common::parallel_rng_seed(1337, 0, 1) != common::parallel_rng_seed(1337, 1, 0));
  torch::manual_seed(5);
  const auto plain = torch::rand({64});  // the default stream with no fork
  std::vector<at::Tensor> sharded(2), again(2), after(2);
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(5);
    ParallelRng rng(common::parallel_rng_seed(1337, 0, r));
    {
      auto fork = rng.fork(cpu);
      sharded[r] = torch::rand({64});
    }
    after[r] = torch::rand({64});
    const auto state = rng.state(cpu);
    {
      auto fork = rng.fork(cpu);
      again[r] = torch::rand({64});
    }
    CHECK(!torch::equal(again[r], sharded[r]));  // the rank's own stream moves on
    rng.set_state(cpu, state);                   // and restores (checkpoints, recompute)
    auto fork = rng.fork(cpu);
    CHECK(torch::equal(torch::rand({64}), again[r]));
  }
  CHECK(!torch::equal(sharded[0], sharded[1]));  // sharded regions: independent masks per TP rank
  CHECK(torch::equal(after[0], after[1]));       // replicated regions: the same on every rank...
  CHECK(torch::equal(after[0], plain));          // ...and as if no fork had happened
}

TEST_CASE("model-parallel RNG: GPT attention dropout at tp 2 differs per rank on its heads, "
          "the replicated output dropout agrees", "[tp_layers]") {
  nnstrain::models::gpt::GptConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 32;
  cfg.block_size = 16;
  cfg.dropout = 0.5;
  const auto x = torch::randn({2, 16, 32});
  auto forward = [&](int rng_rank) {
    ShardingContext ctx;
    ctx.tp = 2;
    ctx.rank = 0;  // the same weights on both: only the generator differs
    ctx.comm = c10::make_intrusive<SoloComm>();
    ctx.rng = std::make_shared<nnstrain::models::common::ParallelRng>(common::parallel_rng_seed(1, 0, rng_rank));
    torch::manual_seed(9);
    nnstrain::models::gpt::CausalSelfAttention attn(cfg, ctx);
    // A nonzero bias, so a query whose attention the dropout emptied does not
    // give exact zeros: zeros then come from the output dropout alone.
    torch::NoGradGuard no_grad;
    attn->c_proj->bias.fill_(1.0);
    attn->train();
    torch::manual_seed(10);
    auto y = attn->forward(x);
    return std::make_pair(y, torch::rand({16}));  // the default stream after the block
  };
  const auto [y0, next0] = forward(0);
  const auto [y1, next1] = forward(1);
  const auto [y0b, next0b] = forward(0);
  CHECK(torch::equal(y0, y0b));    // deterministic per rank
  CHECK(!torch::equal(y0, y1));    // attention-probability masks differ between TP ranks
  const auto zeros0 = y0.eq(0), zeros1 = y1.eq(0);
  CHECK(zeros0.sum().item<int64_t>() > 100);  // the output dropout (p 0.5) zeroed elements...
  CHECK(torch::equal(zeros0, zeros1));        // ...at the same positions on both ranks
  CHECK(torch::equal(next0, next1));          // and the default stream moved alike
}

TEST_CASE("model-parallel RNG: a recomputed block replays its sharded-region masks", "[tp_layers]") {
  nnstrain::models::gpt::GptConfig cfg;
  cfg.n_layer = 1;
  cfg.n_head = 4;
  cfg.n_embd = 32;
  cfg.block_size = 16;
  cfg.dropout = 0.3;
  const auto x = torch::randn({2, 16, 32});
  auto grads = [&](bool recompute) {
    ShardingContext ctx;
    ctx.tp = 2;
    ctx.comm = c10::make_intrusive<SoloComm>();
    ctx.rng = std::make_shared<nnstrain::models::common::ParallelRng>(common::parallel_rng_seed(3, 0, 1));
    torch::manual_seed(4);
    nnstrain::models::gpt::Block block(cfg, ctx);
    block->train();
    torch::manual_seed(5);
    auto xin = x.clone().requires_grad_(true);
    auto fn = [&](const torch::Tensor& t) { return block->forward(t); };
    auto y = recompute ? common::recompute(fn, xin, ctx.rng.get()) : fn(xin);
    y.pow(2).sum().backward();
    std::vector<at::Tensor> g{xin.grad()};
    for (const auto& p : block->parameters()) g.push_back(p.grad());
    return g;
  };
  const auto plain = grads(false), replayed = grads(true);
  REQUIRE(plain.size() == replayed.size());
  for (size_t i = 0; i < plain.size(); ++i) CHECK(torch::allclose(plain[i], replayed[i], 1e-5, 1e-6));
}

TEST_CASE("sequence parallelism over threads: GPT with 6 heads and biases at tp 2 and 4 equals tp 1, loss and "
          "every gradient, a recomputed block and the fused loss included", "[tp_layers]") {
  // T = 16 and B = 3: at tp 2 a rank's 24 tokens cross a sequence boundary, at tp 4 (heads 2, 2, 1, 1) its 12 do not fill one.
  auto cfg = small_gpt(65, 6, 48, true);
  const uint64_t seed = 5;
  torch::manual_seed(3);
  const auto idx = torch::randint(0, 65, {3, 16}, torch::kLong), targets = torch::randint(0, 65, {3, 16}, torch::kLong);
  nnstrain::models::RuntimeOptions recompute_first;
  recompute_first.recompute_layers = {true, false};

  auto ref_model = std::make_shared<nnstrain::models::gpt::Gpt>(cfg, meta_context(1, 0));
  common::materialise_fresh(*ref_model, c10::Device(c10::kCPU), seed);
  const auto ref_loss = ref_model->loss(idx, targets);
  ref_loss.backward();
  const auto ref_params = ref_model->named_parameters();

  // tp 2 with the plain loss and with the fused one (chunks of 10 of the 48 tokens), tp 4 fused.
  for (int run = 0; run < 3; ++run) {
    const int tp = run < 2 ? 2 : 4;
    recompute_first.loss = run == 0 ? common::LossKind::Plain : common::LossKind::Fused;
    recompute_first.loss_chunk_size = 10;
    ThreadGroup group(tp);
    std::vector<std::shared_ptr<nnstrain::models::gpt::Gpt>> models(tp);
    std::vector<double> loss(tp);
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r)
      threads.emplace_back([&, r] {
        auto ctx = meta_context(tp, r);
        ctx.comm = c10::make_intrusive<ThreadComm>(group, r);
        ctx.sequence_parallel = true;
        models[r] = std::make_shared<nnstrain::models::gpt::Gpt>(cfg, ctx);
        common::materialise_fresh(*models[r], c10::Device(c10::kCPU), seed);
        models[r]->set_runtime_options(recompute_first);
        auto l = models[r]->loss(idx, targets);
        l.backward();
        loss[r] = l.item<double>();
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < tp; ++r) CHECK(loss[r] == Approx(ref_loss.item<double>()).epsilon(1e-6));
    std::vector<std::vector<ParamLayout>> layouts;
    for (const auto& m : models) layouts.push_back(m->param_layouts());
    for (size_t i = 0; i < layouts[0].size(); ++i) {
      const auto& l = layouts[0][i];
      INFO("tp " << tp << ", loss kind " << int(recompute_first.loss) << ": " << l.name);
      const auto want = ref_params[l.name].grad();
      REQUIRE(want.defined());
      const double scale = want.abs().max().item<double>();
      if (!l.split_here()) {
        // Replicated: whole on every rank (norms and biases summed over the group), and equal on all of them.
        const auto g0 = models[0]->named_parameters()[l.name].grad();
        CHECK(torch::allclose(g0, want, 1e-4, 1e-6 * scale));
        for (int r = 1; r < tp; ++r) CHECK(torch::equal(models[r]->named_parameters()[l.name].grad(), g0));
        continue;
      }
      auto whole = torch::zeros_like(want);
      for (int r = 0; r < tp; ++r) {
        const auto local = models[r]->named_parameters()[l.name].grad();
        int64_t row = 0;
        for (const auto& b : layouts[r][i].blocks) {
          auto dst = whole;
          for (size_t d = 0; d < b.shape.size(); ++d) dst = dst.narrow(int64_t(d), b.offsets[d], b.shape[d]);
          dst.copy_(local.narrow(0, row, b.shape[0]));
          row += b.shape[0];
        }
      }
      CHECK(torch::allclose(whole, want, 1e-4, 1e-6 * scale));
    }
  }
}
