// The MoE token dispatcher (models/common/moe_dispatch.h): at ep 1 against a
// per-assignment loop written here, and under expert parallelism (2 and 3
// ranks as threads over an in-process EpComm) against ep 1 on all the tokens:
// outputs, input gradients and expert-weight gradients, with dropped
// assignments, an expert nobody picks and a rank that sends another nothing.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "models/common/kernels/grouped_gemm.h"
#include "models/common/moe_dispatch.h"

using namespace nnstrain::models::common;

namespace {

// Ranks as threads: each posts what it sends, all meet, each takes what is addressed to it.
struct Exchange {
  explicit Exchange(int n) : n(n), posted(n) {}
  int n;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int64_t generation = 0;
  std::vector<std::vector<at::Tensor>> posted;  // [source][destination]
  int64_t all_to_alls = 0;
  std::vector<int64_t> calls = std::vector<int64_t>(n, 0);  // exchanges each rank entered
  void barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const auto gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      // A peer that never comes (a rank that skipped a collective) fails the test, not hangs it.
      if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return generation != gen; }))
        throw std::runtime_error("a peer never reached the exchange (it skipped a collective)");
    }
  }
  std::vector<at::Tensor> swap(int me, std::vector<at::Tensor> out) {
    {
      std::lock_guard<std::mutex> lock(mu);
      posted[me] = std::move(out);
      if (me == 0) ++all_to_alls;
      ++calls[me];
    }
    barrier();
    std::vector<at::Tensor> in;
    for (int s = 0; s < n; ++s) in.push_back(posted[s][me].clone());
    barrier();  // nobody posts the next exchange before everyone took this one
    return in;
  }
};

class ThreadEpComm : public EpComm {
 public:
  ThreadEpComm(Exchange& x, int rank) : x_(x), rank_(rank) {}
  int size() const override { return x_.n; }
  int rank() const override { return rank_; }
  at::Tensor exchange_counts(const at::Tensor& counts) override {
    std::vector<at::Tensor> out;
    for (int d = 0; d < x_.n; ++d) out.push_back(counts[d]);
    return torch::stack(x_.swap(rank_, out));
  }
  at::Tensor all_to_all(const at::Tensor& t, const std::vector<int64_t>& send, const std::vector<int64_t>& recv) override {
    std::vector<at::Tensor> out;
    int64_t at = 0;
    for (int d = 0; d < x_.n; ++d) out.push_back(t.narrow(0, at, send[d])), at += send[d];
    auto in = x_.swap(rank_, out);
    for (int s = 0; s < x_.n; ++s) REQUIRE(in[s].size(0) == recv[s]);
    return torch::cat(in);
  }

 private:
  Exchange& x_;
  int rank_;
};

constexpr int64_t E = 6, C = 4, N = 5, K = 2;

// Expert e: rows @ W[e] + e (the bias tells experts apart even on zero rows' neighbours).
ExpertsFn experts_of(const at::Tensor& W, int64_t first) {
  return [W, first](const at::Tensor& rows, const std::vector<int64_t>& counts) {
    std::vector<at::Tensor> out;
    int64_t at = 0;
    for (size_t j = 0; j < counts.size(); ++j) {
      out.push_back(rows.narrow(0, at, counts[j]).matmul(W[j]) + double(first + j));
      at += counts[j];
    }
    return torch::cat(out);
  };
}

// Tokens and routes of `ranks` ranks: expert 4 is never chosen; rank 0 drops one
// assignment; rank 1 routes only to experts 0..1 (at ep 3: nothing to rank 2).
std::vector<std::pair<at::Tensor, at::Tensor>> make_inputs(int ranks) {
  torch::manual_seed(7);
  std::vector<std::pair<at::Tensor, at::Tensor>> in;
  for (int r = 0; r < ranks; ++r) {
    auto x = torch::randn({N, C}, torch::kDouble);
    auto ids = torch::randint(0, E - 1, {N, K}, torch::kLong);
    ids = torch::where(ids.ge(4), ids + 1, ids);  // skip expert 4
    if (r == 1) ids = ids.remainder(2);
    if (r == 0) ids.index_put_({2, 1}, -1);
    in.push_back({x, ids});
  }
  return in;
}

}  // namespace

TEST_CASE("moe dispatch at ep 1 equals a per-assignment loop, dropped assignments zero", "[moe]") {
  auto [x, ids] = make_inputs(1)[0];
  auto W = torch::randn({E, C, C}, torch::kDouble);
  DispatchStats stats;
  const auto y = run_experts(x, ids, E, ShardingContext{}, experts_of(W, 0), &stats);
  REQUIRE(y.sizes() == torch::IntArrayRef{N, K, C});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < K; ++j) {
      const auto e = ids[n][j].item<int64_t>();
      const auto want = e < 0 ? torch::zeros({C}, torch::kDouble) : x[n].matmul(W[e]) + double(e);
      CHECK(torch::allclose(y[n][j], want, 1e-12, 1e-12));
    }
  CHECK(stats.tokens_per_expert[4] == 0);
  int64_t kept = 0;
  for (auto c : stats.tokens_per_expert) kept += c;
  CHECK(kept == N * K - 1);
}

TEST_CASE("moe dispatch under expert parallelism equals ep 1: outputs and gradients", "[moe]") {
  for (int ep : {2, 3}) {
    INFO("ep " << ep);
    const auto inputs = make_inputs(ep);
    torch::manual_seed(11);
    const auto W = torch::randn({E, C, C}, torch::kDouble);
    std::vector<at::Tensor> R;
    for (int r = 0; r < ep; ++r) R.push_back(torch::randn({N, K, C}, torch::kDouble));

    // Reference: one process, every rank's tokens, all experts.
    std::vector<at::Tensor> ref_y, ref_gx;
    auto Wr = W.clone().requires_grad_(true);
    for (int r = 0; r < ep; ++r) {
      auto x = inputs[r].first.clone().requires_grad_(true);
      auto y = run_experts(x, inputs[r].second, E, ShardingContext{}, experts_of(Wr, 0));
      (y * R[r]).sum().backward();
      ref_y.push_back(y.detach());
      ref_gx.push_back(x.grad());
    }

    Exchange ex(ep);
    std::vector<at::Tensor> got_y(ep), got_gx(ep), got_gw(ep);
    std::vector<DispatchStats> stats(ep);
    std::vector<std::string> errors(ep);
    std::vector<std::thread> threads;
    for (int r = 0; r < ep; ++r)
      threads.emplace_back([&, r] {
        try {
          ShardingContext ctx;
          ctx.ep = ep;
          ctx.ep_rank = r;
          ctx.ep_comm = c10::make_intrusive<ThreadEpComm>(ex, r);
          const int64_t L = E / ep;
          auto w = W.narrow(0, r * L, L).clone().requires_grad_(true);  // this rank's experts
          auto x = inputs[r].first.clone().requires_grad_(true);
          auto y = run_experts(x, inputs[r].second, E, ctx, experts_of(w, r * L), &stats[r]);
          (y * R[r]).sum().backward();
          got_y[r] = y.detach(), got_gx[r] = x.grad(), got_gw[r] = w.grad();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ep; ++r) {
      INFO("rank " << r << ": " << errors[r]);
      REQUIRE(errors[r].empty());
      CHECK(torch::allclose(got_y[r], ref_y[r], 1e-12, 1e-12));
      CHECK(torch::allclose(got_gx[r], ref_gx[r], 1e-12, 1e-12));
      const int64_t L = E / ep;
      CHECK(torch::allclose(got_gw[r], Wr.grad().narrow(0, r * L, L), 1e-12, 1e-12));
    }
    // Tokens really travelled: forward (counts, rows out, rows back) and backward (two), per call.
    CHECK(ex.all_to_alls == 5);
    int64_t sent = 0;
    for (const auto& s : stats) sent += s.rows_sent;
    CHECK(sent > 0);
  }
}

TEST_CASE("moe dispatch: a rank whose experts receive no rows still runs its backward all-to-alls", "[moe]") {
  // Issue 58, item 1: every token routes to rank 0's experts, so rank 1's experts get zero
  // rows. Its backward must still issue the combine's and the dispatch's all-to-alls (its
  // peer waits for them), whichever grouped GEMM runs its experts, and reach its weights.
  namespace Kn = nnstrain::models::common::kernels;
  for (auto which : {Kn::GroupedGemm::PaddedBmm, Kn::GroupedGemm::Loop}) {
    INFO(Kn::grouped_gemm_name(which));
    constexpr int ep = 2;
    constexpr int64_t G = 20, H = 4;  // 40 experts, 20 per rank (the CPU's padded_bmm range)
    Exchange ex(ep);
    std::vector<std::string> errors(ep);
    std::vector<at::Tensor> grads(ep);
    std::vector<std::thread> threads;
    for (int r = 0; r < ep; ++r)
      threads.emplace_back([&, r] {
        try {
          ShardingContext ctx;
          ctx.ep = ep;
          ctx.ep_rank = r;
          ctx.ep_comm = c10::make_intrusive<ThreadEpComm>(ex, r);
          torch::manual_seed(20 + r);
          auto gate = torch::randn({G, H, C}).requires_grad_(true), up = torch::randn({G, H, C}).requires_grad_(true),
               down = torch::randn({G, C, H}).requires_grad_(true);
          auto x = torch::randn({N, C}).requires_grad_(true);
          const auto ids = torch::randint(0, G, {N, K}, torch::kLong);  // rank 0's experts only
          auto y = run_experts(x, ids, 2 * G, ctx, [&](const at::Tensor& rows, const std::vector<int64_t>& counts) {
            return Kn::grouped_swiglu_mlp(rows, gate, up, down, counts, which);
          });
          (y.sum() + x.sum()).backward();  // the residual keeps x in the graph on every rank
          grads[r] = gate.grad();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ep; ++r) {
      INFO("rank " << r << ": " << errors[r]);
      CHECK(errors[r].empty());
      CHECK(grads[r].defined());  // the empty shard's weights are reached (zero gradient)
    }
    // Forward: counts, rows out, rows back; backward: two. The same on both ranks.
    CHECK(ex.calls[0] == 5);
    CHECK(ex.calls[1] == 5);
  }
}
