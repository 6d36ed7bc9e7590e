// Context-parallel attention (models/common/context_attention.h) against plain
// single-rank attention on the whole sequence: the cp ranks run as threads of
// this process, each with its own Gloo group over one in-memory c10d store, and
// each holding only its own tokens' q, k and v, so no rank can get its rows
// right without the other ranks' keys. Every configuration: output, lse and the
// gradients of q, k and v within 2e-6 (fp32) of at::scaled_dot_product_attention.
#include <catch2/catch.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "models/common/context_attention.h"
#include "models/common/cp_document_layout.h"
#include "models/common/varlen_attention.h"
#include "models/llama/llama.h"
#include "trainer/dist/process_groups.h"
#include "trainer/state/context_parallel.h"

using namespace nnstrain;
using models::common::CpAttentionOptions;
using models::common::CpCommType;
using models::common::CpLayout;

namespace {

constexpr double kTol = 2e-6;
constexpr auto kTimeout = std::chrono::milliseconds(30000);

// Runs fn(rank, comm) on cp threads, each rank a dist::Runtime of cp ranks
// (Gloo) over one in-memory store; returns each rank's error ("" if none).
std::vector<std::string> on_ranks(int cp, const std::function<void(int, c10::intrusive_ptr<models::common::CpComm>)>& fn) {
  static std::atomic<int> job{0};
  auto store = c10::make_intrusive<c10d::PrefixStore>("cp" + std::to_string(job++),
                                                      c10::make_intrusive<c10d::HashStore>());
  std::vector<std::string> errors(cp);
  std::vector<std::thread> threads;
  for (int r = 0; r < cp; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::DistEnv env;
        env.rank = r;
        env.world_size = cp;
        dist::RuntimeOptions ro;
        ro.cp = cp;
        ro.backend = "gloo";
        ro.timeout = kTimeout;
        dist::Runtime rt(env, ro, store);
        fn(r, parallel::make_cp_comm(rt));
        rt.shutdown();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

struct Case {
  CpCommType comm;
  CpLayout layout;
  bool causal;
  int64_t hq, hkv;
  std::string name() const {
    return std::string(to_string(comm)) + " " + to_string(layout) + (causal ? " causal" : " full") + " Hq " +
           std::to_string(hq) + " Hkv " + std::to_string(hkv);
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (auto comm : {CpCommType::P2P, CpCommType::AllGather})
    for (auto layout : {CpLayout::Zigzag, CpLayout::Contiguous})
      for (bool causal : {true, false})
        for (auto heads : {std::pair<int64_t, int64_t>{4, 2}, {2, 2}}) out.push_back({comm, layout, causal, heads.first, heads.second});
  return out;
}

struct Inputs {
  at::Tensor q, k, v, g;  // full sequence; g: the output's gradient
};

constexpr int64_t kB = 2, kSeq = 24, kD = 8;  // 24: a multiple of 2 cp for cp 2, 3 and 4

Inputs make_inputs(const Case& c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return {at::randn({kB, c.hq, kSeq, kD}, gen), at::randn({kB, c.hkv, kSeq, kD}, gen),
          at::randn({kB, c.hkv, kSeq, kD}, gen), at::randn({kB, c.hq, kSeq, kD}, gen)};
}

// Single-rank attention on the full sequence: out, lse, dq, dk, dv.
struct Reference {
  at::Tensor out, lse, dq, dk, dv;
};

Reference reference(const Case& c, const Inputs& in) {
  auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
  auto out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, std::nullopt, c.hq != c.hkv);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {in.g});
  // lse in plain math: the scores of every query head against its KV head.
  torch::NoGradGuard ng;
  auto ke = in.k.repeat_interleave(c.hq / c.hkv, 1);
  auto s = at::matmul(in.q, ke.transpose(-2, -1)) / std::sqrt(static_cast<double>(kD));
  if (c.causal) s = s.masked_fill(at::ones({kSeq, kSeq}, at::kBool).triu(1), -std::numeric_limits<float>::infinity());
  return {out.detach(), at::logsumexp(s, -1), grads[0], grads[1], grads[2]};
}

struct RankResult {
  at::Tensor out, lse, dq, dk, dv;
};

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a - b).abs().max().item<double>();
}

void check_matrix(int cp) {
  const auto cases = all_cases();
  std::vector<Inputs> inputs;
  for (size_t i = 0; i < cases.size(); ++i) inputs.push_back(make_inputs(cases[i], 100 + i));
  // results[case][rank]
  std::vector<std::vector<RankResult>> results(cases.size(), std::vector<RankResult>(cp));
  const auto errors = on_ranks(cp, [&](int r, c10::intrusive_ptr<models::common::CpComm> comm) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& c = cases[i];
      const auto& in = inputs[i];
      CpAttentionOptions o;
      o.comm_type = c.comm;
      o.layout = c.layout;
      auto shard = [&](const at::Tensor& x) { return models::common::cp_shard(x, 2, cp, r, c.layout).contiguous(); };
      auto q = shard(in.q).requires_grad_(), k = shard(in.k).requires_grad_(), v = shard(in.v).requires_grad_();
      auto out = models::common::context_parallel_attention(q, k, v, c.causal, comm, o);
      out.backward(shard(in.g));
      auto lse = models::common::context_parallel_attention_lse(q.detach(), k.detach(), v.detach(), c.causal, comm, o);
      results[i][r] = {out.detach(), lse.second, q.grad(), k.grad(), v.grad()};
    }
  });
  for (int r = 0; r < cp; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto ref = reference(cases[i], inputs[i]);
    for (int r = 0; r < cp; ++r) {
      INFO("cp " << cp << " " << cases[i].name() << " rank " << r);
      const auto layout = cases[i].layout;
      auto shard = [&](const at::Tensor& x) { return models::common::cp_shard(x, 2, cp, r, layout); };
      const auto& got = results[i][r];
      CHECK(max_diff(got.out, shard(ref.out)) <= kTol);
      CHECK(max_diff(got.lse, shard(ref.lse)) <= kTol);
      CHECK(max_diff(got.dq, shard(ref.dq)) <= kTol);
      CHECK(max_diff(got.dk, shard(ref.dk)) <= kTol);
      CHECK(max_diff(got.dv, shard(ref.dv)) <= kTol);
    }
  }
}

}  // namespace

TEST_CASE("context-parallel attention equals single-rank attention at cp 2", "[cp][attention]") { check_matrix(2); }
TEST_CASE("context-parallel attention equals single-rank attention at cp 3", "[cp][attention]") { check_matrix(3); }
TEST_CASE("context-parallel attention equals single-rank attention at cp 4", "[cp][attention]") { check_matrix(4); }

TEST_CASE("context-parallel layouts hold the tokens issue 22 assigns", "[cp][attention]") {
  using models::common::cp_position_ids;
  // Zigzag: 2 cp chunks, rank r holds chunks r and 2 cp - 1 - r.
  REQUIRE(cp_position_ids(8, 2, 0, CpLayout::Zigzag) == std::vector<int64_t>{0, 1, 6, 7});
  REQUIRE(cp_position_ids(8, 2, 1, CpLayout::Zigzag) == std::vector<int64_t>{2, 3, 4, 5});
  REQUIRE(cp_position_ids(12, 3, 1, CpLayout::Zigzag) == std::vector<int64_t>{2, 3, 8, 9});
  REQUIRE(cp_position_ids(6, 3, 2, CpLayout::Contiguous) == std::vector<int64_t>{4, 5});
  // cp_unshard undoes cp_shard.
  auto full = at::arange(24, at::kFloat).view({1, 24, 1}) * 10 + at::arange(3, at::kFloat).view({1, 1, 3});
  for (auto layout : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < 4; ++r) parts.push_back(models::common::cp_shard(full, 1, 4, r, layout));
    REQUIRE(parts[1].size(1) == 6);
    REQUIRE(at::equal(models::common::cp_unshard(at::stack(parts), 1, layout), full));
  }
}

TEST_CASE("a row whose keys are all masked gets lse -inf and contributes nothing", "[cp][attention]") {
  const float inf = std::numeric_limits<float>::infinity();
  auto gen = at::detail::createCPUGenerator(7);
  auto q = at::randn({1, 4, 6, kD}, gen), k = at::randn({1, 2, 6, kD}, gen), v = at::randn({1, 2, 6, kD}, gen);
  CpAttentionOptions o;
  SECTION("contiguous: rank 0's queries come before all of rank 1's keys") {
    o.layout = CpLayout::Contiguous;
    auto [out, lse] = models::common::cp_attention_block(q, k, v, true, 2, 0, 1, o);
    REQUIRE((lse == -inf).all().item<bool>());
    REQUIRE(out.eq(0).all().item<bool>());
  }
  SECTION("zigzag: rank 0's first chunk sees none of rank 1's keys, its last chunk all of them") {
    o.layout = CpLayout::Zigzag;
    auto [out, lse] = models::common::cp_attention_block(q, k, v, true, 2, 0, 1, o);
    REQUIRE((lse.narrow(2, 0, 3) == -inf).all().item<bool>());
    REQUIRE(out.narrow(2, 0, 3).eq(0).all().item<bool>());
    auto ke = k.repeat_interleave(2, 1);
    auto want = at::logsumexp(at::matmul(q.narrow(2, 3, 3), ke.transpose(-2, -1)) / std::sqrt(double(kD)), -1);
    REQUIRE(max_diff(lse.narrow(2, 3, 3), want) <= kTol);
  }
  SECTION("merging: -inf into -inf stays -inf with out 0, and into a finite row changes nothing") {
    auto out = at::zeros({1, 1, 2, 3}), lse = at::full({1, 1, 2}, -inf);
    models::common::merge_attention(out, lse, at::zeros({1, 1, 2, 3}), at::full({1, 1, 2}, -inf));
    REQUIRE((lse == -inf).all().item<bool>());
    REQUIRE(out.eq(0).all().item<bool>());
    auto fin_out = at::randn({1, 1, 2, 3}, gen), fin_lse = at::randn({1, 1, 2}, gen);
    auto o2 = fin_out.clone(), l2 = fin_lse.clone();
    models::common::merge_attention(o2, l2, at::randn({1, 1, 2, 3}, gen), at::full({1, 1, 2}, -inf));
    REQUIRE(at::equal(o2, fin_out));
    REQUIRE(at::equal(l2, fin_lse));
  }
}

TEST_CASE("a sequence that 2 x cp does not divide is refused naming the sizes", "[cp][attention]") {
  try {
    models::common::check_cp_split(10, 4, CpLayout::Zigzag);
    FAIL("no error");
  } catch (const std::invalid_argument& e) {
    REQUIRE(std::string(e.what()) ==
            "sequence length 10 does not split over 4 context-parallel ranks with load balance zigzag: it must be a "
            "multiple of 2 x context_parallel_size (8)");
  }
  REQUIRE_NOTHROW(models::common::check_cp_split(12, 4, CpLayout::Contiguous));
  // The op itself: 3 local tokens per rank at cp 2 is a sequence of 6, not a multiple of 4.
  const auto errors = on_ranks(2, [&](int r, c10::intrusive_ptr<models::common::CpComm> comm) {
    auto q = at::randn({1, 2, 3, kD});
    models::common::context_parallel_attention(q, q, q, true, comm, CpAttentionOptions{});
  });
  for (const auto& e : errors) REQUIRE(e.find("sequence length 6 does not split over 2 context-parallel ranks") !=
                                       std::string::npos);
}

TEST_CASE("ranks are laid out tensor-parallel innermost, then context-parallel, then data-parallel", "[cp][attention]") {
  // 8 ranks, tp 2 x cp 2 x dp 2, each a dist::Runtime on a thread over one in-memory store.
  constexpr int kWorld = 8;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::vector<int>> tp(kWorld), cp(kWorld), dp(kWorld);
  std::vector<float> received(kWorld, -1);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::DistEnv env;
        env.rank = r;
        env.world_size = kWorld;
        dist::RuntimeOptions ro;
        ro.tp = 2;
        ro.cp = 2;
        ro.backend = "gloo";
        ro.timeout = kTimeout;
        dist::Runtime rt(env, ro, store);
        tp[r] = rt.tp.ranks;
        cp[r] = rt.cp.ranks;
        dp[r] = rt.dp.ranks;
        // The ring runs over the context-parallel group: each rank gets its cp predecessor's value.
        auto comm = parallel::make_cp_comm(rt);
        received[r] = comm->ring_shift_start(at::full({1}, float(r)), 0)()[0].item<float>();
        rt.shutdown();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    // rank = (dp index x 2 + cp index) x 2 + tp index
    const int t = r % 2, c = (r / 2) % 2, d = r / 4;
    CHECK(tp[r] == std::vector<int>{(d * 2 + c) * 2, (d * 2 + c) * 2 + 1});
    CHECK(cp[r] == std::vector<int>{d * 4 + t, d * 4 + 2 + t});
    CHECK(dp[r] == std::vector<int>{c * 2 + t, 4 + c * 2 + t});
    CHECK(received[r] == float(c == 0 ? r + 2 : r - 2));
  }
  CHECK(cp[5] == std::vector<int>{5, 7});  // spelled out: rank 5 is dp 1, cp 0, tp 1
  CHECK(dp[5] == std::vector<int>{1, 5});
  CHECK(tp[5] == std::vector<int>{4, 5});
}

TEST_CASE("a llama with context-parallel attention equals one rank in loss and every gradient", "[cp][attention]") {
  // Each rank holds only its tokens of every sequence: attention must reach the
  // others' keys and rotary embeddings must take global positions, or the loss moves.
  models::llama::LlamaConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.15;
  torch::manual_seed(3);
  models::llama::Llama ref(c);
  const auto idx = torch::randint(96, {2, 24}), targets = torch::randint(96, {2, 24});
  const auto ref_loss = ref.loss(idx, targets);
  ref_loss.backward();
  const auto ref_params = ref.named_parameters();
  struct Setup {
    int cp;
    CpCommType comm;
    CpLayout layout;
  };
  for (const auto& s : {Setup{2, CpCommType::P2P, CpLayout::Zigzag}, Setup{3, CpCommType::AllGather, CpLayout::Zigzag},
                        Setup{4, CpCommType::P2P, CpLayout::Contiguous}}) {
    INFO("cp " << s.cp << " " << to_string(s.comm) << " " << to_string(s.layout));
    std::vector<double> losses(s.cp);
    std::vector<std::map<std::string, at::Tensor>> grads(s.cp);
    const auto errors = on_ranks(s.cp, [&](int r, c10::intrusive_ptr<models::common::CpComm> comm) {
      models::common::ShardingContext ctx;
      ctx.cp_comm = comm;
      ctx.cp_comm_type = s.comm;
      ctx.cp_layout = s.layout;
      models::llama::Llama m(c, ctx);
      {
        torch::NoGradGuard ng;
        for (auto& p : m.named_parameters()) p.value().copy_(ref_params[p.key()]);
      }
      auto shard = [&](const at::Tensor& x) { return models::common::cp_shard(x, 1, s.cp, r, s.layout).contiguous(); };
      auto loss = m.loss(shard(idx), shard(targets)) / s.cp;  // equal token counts: the mean is the ranks' mean
      loss.backward();
      losses[r] = loss.item<double>();
      for (const auto& p : m.named_parameters()) grads[r][p.key()] = p.value().grad().clone();
    });
    for (int r = 0; r < s.cp; ++r) {
      INFO("rank " << r << ": " << errors[r]);
      REQUIRE(errors[r].empty());
    }
    double total = 0;
    for (double l : losses) total += l;
    CHECK(std::abs(total - ref_loss.item<double>()) <= 1e-6 * std::abs(ref_loss.item<double>()));
    for (const auto& p : ref_params) {
      auto sum = grads[0][p.key()].clone();
      for (int r = 1; r < s.cp; ++r) sum += grads[r][p.key()];
      const auto& want = p.value().grad();
      INFO(p.key());
      CHECK((sum - want).abs().max().item<double>() <= 1e-5 * want.abs().max().item<double>());
    }
  }
}

namespace {

// Packed documents: per batch row, document numbers along the sequence (documents
// crossing the cp ranks' chunk boundaries), and the dense block-diagonal causal mask.
at::Tensor doc_segments(const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<at::Tensor> rows;
  for (const auto& row : lengths) {
    std::vector<int64_t> s;
    for (size_t d = 0; d < row.size(); ++d) s.insert(s.end(), size_t(row[d]), int64_t(d));
    rows.push_back(torch::tensor(s, torch::kLong));
  }
  return torch::stack(rows);
}

// Rank r's tokens (dim 2) as the trainer cuts a document-masked batch: zigzag is
// the layout balanced for the batch's documents, contiguous as without documents.
at::Tensor doc_shard(const at::Tensor& x, const at::Tensor& seg, int cp, int r, CpLayout layout) {
  if (layout == CpLayout::Contiguous) return models::common::cp_shard(x, 2, cp, r, layout).contiguous();
  const auto idx = torch::tensor(models::common::cp_document_layout(seg, cp)[size_t(r)], torch::kLong);
  return x.index_select(2, idx).contiguous();
}

Reference doc_reference(const Inputs& in, const at::Tensor& seg, int64_t hq, int64_t hkv) {
  const auto T = seg.size(1);
  auto mask = (seg.unsqueeze(2) == seg.unsqueeze(1)).logical_and(at::ones({T, T}, at::kBool).tril()).unsqueeze(1);
  auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
  auto ke = k.repeat_interleave(hq / hkv, 1), ve = v.repeat_interleave(hq / hkv, 1);
  auto out = at::scaled_dot_product_attention(q, ke, ve, mask);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {in.g});
  return {out.detach(), {}, grads[0], grads[1], grads[2]};
}

}  // namespace

TEST_CASE("varlen document attention: the packing and lengths equal the tiles' block-diagonal attention",
          "[attention][document_mask][varlen]") {
  // The CUDA kernel's packing ([B T, H, D], cumulative lengths per (row, document))
  // runs here with the per-document reference in place of the flash kernel.
  const auto seg = doc_segments({{5, 19, 7, 11, 6}, {13, 9, 17, 9}});
  const auto [cu, longest] = models::common::document_cu_seqlens(seg, at::kCPU);
  CHECK(cu.scalar_type() == at::kInt);
  const std::vector<int32_t> want_cu = {0, 5, 24, 31, 42, 48, 61, 70, 87, 96};
  CHECK(std::vector<int32_t>(cu.data_ptr<int32_t>(), cu.data_ptr<int32_t>() + cu.numel()) == want_cu);
  CHECK(longest == 19);
  auto gen = at::detail::createCPUGenerator(11);
  const int64_t T = seg.size(1);
  const Inputs in{at::randn({kB, 4, T, kD}, gen), at::randn({kB, 2, T, kD}, gen), at::randn({kB, 2, T, kD}, gen),
                  at::randn({kB, 4, T, kD}, gen)};
  const auto ref = doc_reference(in, seg, 4, 2);
  auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
  const auto before = models::common::varlen_attention_calls();
  auto out = models::common::varlen_document_attention(q, k, v, seg);
  out.backward(in.g);
  CHECK(models::common::varlen_attention_calls() == before + 1);
  CHECK(max_diff(out.detach(), ref.out) <= kTol);
  CHECK(max_diff(q.grad(), ref.dq) <= kTol);
  CHECK(max_diff(k.grad(), ref.dk) <= kTol);
  CHECK(max_diff(v.grad(), ref.dv) <= kTol);
  // Not the kernel's business to guess: the CPU never takes the CUDA path.
  CHECK_FALSE(models::common::varlen_flash_fits(q, k));
  // A decreasing document number is refused, naming the row.
  CHECK_THROWS_WITH(models::common::document_cu_seqlens(at::tensor({0, 1, 0}, at::kLong).view({1, 3}), at::kCPU),
                    Catch::Contains("segments decrease at token 2 of batch row 0"));
}

TEST_CASE("document-masked context-parallel attention equals one rank's block-diagonal attention",
          "[cp][attention][document_mask]") {
  // 48 tokens: documents of 5 to 19 tokens crossing every chunk boundary at cp 2 and 4.
  const auto seg = doc_segments({{5, 19, 7, 11, 6}, {13, 9, 17, 9}});
  auto gen = at::detail::createCPUGenerator(7);
  const int64_t T = seg.size(1);
  const Inputs in{at::randn({kB, 4, T, kD}, gen), at::randn({kB, 2, T, kD}, gen), at::randn({kB, 2, T, kD}, gen),
                  at::randn({kB, 4, T, kD}, gen)};
  const auto ref = doc_reference(in, seg, 4, 2);
  {  // one process: the same tiles without communication
    auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
    auto out = models::common::document_attention(q, k, v, seg);
    out.backward(in.g);
    CHECK(max_diff(out.detach(), ref.out) <= kTol);
    CHECK(max_diff(q.grad(), ref.dq) <= kTol);
    CHECK(max_diff(k.grad(), ref.dk) <= kTol);
    CHECK(max_diff(v.grad(), ref.dv) <= kTol);
  }
  for (int cp : {2, 4}) {
    for (auto comm_type : {CpCommType::P2P, CpCommType::AllGather}) {
      for (auto layout : {CpLayout::Zigzag, CpLayout::Contiguous}) {
        std::vector<RankResult> got(cp);
        const auto before = models::common::document_tiles_computed();
        const auto errors = on_ranks(cp, [&](int r, c10::intrusive_ptr<models::common::CpComm> comm) {
          CpAttentionOptions o;
          o.comm_type = comm_type;
          o.layout = layout;
          o.segments = seg;  // every rank holds the whole batch's document numbers
          auto shard = [&](const at::Tensor& x) { return doc_shard(x, seg, cp, r, layout); };
          auto q = shard(in.q).requires_grad_(), k = shard(in.k).requires_grad_(), v = shard(in.v).requires_grad_();
          auto out = models::common::context_parallel_attention(q, k, v, true, comm, o);
          out.backward(shard(in.g));
          got[r] = {out.detach(), {}, q.grad(), k.grad(), v.grad()};
        });
        CHECK(models::common::document_tiles_computed() > before);
        for (int r = 0; r < cp; ++r) {
          INFO("cp " << cp << " " << to_string(comm_type) << " " << to_string(layout) << " rank " << r << ": "
                     << errors[r]);
          REQUIRE(errors[r].empty());
          auto shard = [&](const at::Tensor& x) { return doc_shard(x, seg, cp, r, layout); };
          CHECK(max_diff(got[r].out, shard(ref.out)) <= kTol);
          CHECK(max_diff(got[r].dq, shard(ref.dq)) <= kTol);
          CHECK(max_diff(got[r].dk, shard(ref.dk)) <= kTol);
          CHECK(max_diff(got[r].dv, shard(ref.dv)) <= kTol);
        }
      }
    }
  }
}

TEST_CASE("a batch's document plan is derived once per rank, however many layers and ring steps use it",
          "[cp][attention][document_mask]") {
  auto seg = doc_segments({{5, 19, 7, 11, 6}, {13, 9, 17, 9}});
  auto gen = at::detail::createCPUGenerator(11);
  const int64_t T = seg.size(1);
  auto q = at::randn({kB, 4, T, kD}, gen).requires_grad_(), k = at::randn({kB, 2, T, kD}, gen).requires_grad_(),
       v = at::randn({kB, 2, T, kD}, gen).requires_grad_();
  auto derived = [before = models::common::document_plans_derived()]() mutable {
    const auto now = models::common::document_plans_derived(), d = now - before;
    before = now;
    return d;
  };
  // Three layers' forward and backward on one process, then the same at cp 2 (each rank a thread).
  at::Tensor loss = at::zeros({});
  for (int layer = 0; layer < 3; ++layer) loss = loss + models::common::document_attention(q, k, v, seg).square().sum();
  loss.backward();
  CHECK(derived() == 1);
  const auto errors = on_ranks(2, [&](int r, c10::intrusive_ptr<models::common::CpComm> comm) {
    CpAttentionOptions o;
    o.segments = seg;
    auto shard = [&](const at::Tensor& x) { return doc_shard(x, seg, 2, r, o.layout).requires_grad_(); };
    auto qs = shard(q.detach()), ks = shard(k.detach()), vs = shard(v.detach());
    at::Tensor l = at::zeros({});
    for (int layer = 0; layer < 3; ++layer)
      l = l + models::common::context_parallel_attention(qs, ks, vs, true, comm, o).square().sum();
    l.backward();
  });
  for (const auto& e : errors) REQUIRE(e.empty());
  CHECK(derived() == 2);  // one per rank, for 3 layers x 2 ring steps x forward and backward
  // Another batch's segments (a new tensor, equal values) and a write in place are derived anew.
  models::common::document_attention(q.detach(), k.detach(), v.detach(), seg.clone());
  CHECK(derived() == 1);
  models::common::document_attention(q.detach(), k.detach(), v.detach(), seg);
  CHECK(derived() == 1);  // seg's plan was displaced by the clone's: the cache holds one batch
  seg.add_(0);
  models::common::document_attention(q.detach(), k.detach(), v.detach(), seg);
  CHECK(derived() == 1);
}

TEST_CASE("document tiles skip masked blocks and balance the ranks' work on packed data",
          "[cp][attention][document_mask]") {
  // Masked tiles are skipped: one process computes under a quarter of the causal
  // triangle's pairs when 16 documents share the sequence.
  const auto seg16 = doc_segments({std::vector<int64_t>(16, 256)});
  const int64_t T = 4096;
  const auto one = models::common::document_work(seg16, 1, CpLayout::Contiguous);
  CHECK(one[0] < T * (T + 1) / 2 / 4);
  // Documents of 64 to 640 tokens (tenfold), packed into 8192-token samples: under
  // zigzag (the layout balanced per batch) the busiest rank does at most 1.15 x the
  // idlest's work. (A static layout cannot promise it: contiguous is not checked.)
  auto gen = at::detail::createCPUGenerator(11);
  std::vector<std::vector<int64_t>> rows;
  for (int b = 0; b < 4; ++b) {
    std::vector<int64_t> row;
    int64_t left = 8192;
    while (left > 0) {
      const int64_t n = std::min(left, 64 + at::randint(0, 577, {1}, gen).item<int64_t>());
      row.push_back(n);
      left -= n;
    }
    rows.push_back(row);
  }
  const auto seg = doc_segments(rows);
  for (int cp : {2, 4}) {
    const auto w = models::common::document_work(seg, cp, CpLayout::Zigzag);
    const double ratio = double(*std::max_element(w.begin(), w.end())) / double(*std::min_element(w.begin(), w.end()));
    INFO("cp " << cp << " zigzag: busiest / idlest " << ratio);
    CHECK(ratio <= 1.15);
  }
}
