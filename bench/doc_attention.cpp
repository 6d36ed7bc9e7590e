// Packed documents at cp 1 (issue 40): document-masked attention forward and
// backward by each kernel nnstrain has for it, on the same packed batch.
//
//   varlen  common::document_attention under auto: on CUDA flash attention's
//           variable-length kernel (models/common/varlen_attention.h)
//   tiles   the same under NNSTRAIN_KERNELS=composite: query tiles against the
//           key range their documents reach, masked blocks never computed
//   dense   SDPA with the dense [B, 1, T, T] block-diagonal causal mask (what
//           CUDA ran before the varlen kernel; K/V repeated for GQA)
// and, as the yardstick, causal SDPA over the whole sequence without documents
// (more work than any of them: every earlier document too). The documents'
// lengths vary tenfold (drawn in [T/40, T/4], the last cut to fit). --check
// compares varlen's and dense's outputs and gradients with the tiles'.
//
//   cmake --build build --target nnstrain_bench_doc_attention
//   build/nnstrain_bench_doc_attention --device cuda --dtype bf16 --seq 8192
//       [--batch 2] [--heads 32] [--kv-heads 8] [--dim 128] [--repeats 5] [--warmup 2] [--check]
// Prints one JSON line last: milliseconds per kernel, which kernel ran, the check.
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench/attention_args.h"
#include "models/common/context_attention.h"
#include "models/common/kernels/kernels.h"
#include "models/common/varlen_attention.h"

namespace mc = nnstrain::models::common;

namespace {

struct Args : nnstrain::bench::AttentionArgs {
  Args() { batch = 2; }
};

Args parse(int argc, char** argv) {
  Args a;
  nnstrain::bench::parse_attention_args(argc, argv, a);
  if (a.seq < 40) throw std::invalid_argument("--seq must be at least 40");
  return a;
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

// Document numbers [B, T], lengths drawn in [T/40, T/4] (tenfold), the last cut to fit.
at::Tensor packed_segments(int64_t B, int64_t T, std::vector<int64_t>& lengths) {
  auto seg = torch::empty({B, T}, torch::kLong);
  auto gen = at::detail::createCPUGenerator(1234);
  for (int64_t b = 0; b < B; ++b) {
    int64_t at_ = 0, doc = 0;
    while (at_ < T) {
      const int64_t lo = std::max<int64_t>(1, T / 40), hi = std::max(lo, T / 4);
      const int64_t n = std::min(T - at_, lo + torch::randint(hi - lo + 1, {1}, gen).item<int64_t>());
      seg[b].narrow(0, at_, n).fill_(doc++);
      lengths.push_back(n);
      at_ += n;
    }
  }
  return seg;
}

struct Run {
  at::Tensor out, dq, dk, dv;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "nnstrain_bench_doc_attention: " << e.what() << "\n";
    return 2;
  }
  torch::NoGradGuard outer;  // re-enabled per call below
  const torch::Device dev(a.device);
  const auto dt = a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const auto opt = torch::TensorOptions().device(dev).dtype(dt);
  std::vector<int64_t> lengths;
  const auto seg = packed_segments(a.batch, a.seq, lengths).to(dev);
  torch::manual_seed(7);
  const auto q0 = torch::randn({a.batch, a.heads, a.seq, a.dim}, opt), k0 = torch::randn({a.batch, a.kv_heads, a.seq, a.dim}, opt),
             v0 = torch::randn({a.batch, a.kv_heads, a.seq, a.dim}, opt), g = torch::randn({a.batch, a.heads, a.seq, a.dim}, opt);
  const int64_t rep = a.heads / a.kv_heads;
  const auto dense_mask = mc::document_causal_mask(seg);
  using Fn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
  auto call = [&](const Fn& f) {
    torch::AutoGradMode on(true);
    auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    auto out = f(q, k, v);
    out.backward(g);
    return Run{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  auto timed = [&](const Fn& f) {
    for (int i = 0; i < a.warmup; ++i) call(f);
    std::vector<double> t;
    for (int i = 0; i < a.repeats; ++i) {
      sync(dev);
      const auto t0 = std::chrono::steady_clock::now();
      call(f);
      sync(dev);
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2] * 1e3;
  };
  const std::map<std::string, Fn> kernels = {
      {"varlen", [&](auto& q, auto& k, auto& v) {
         mc::kernels::set_impl(mc::kernels::Impl::Auto);
         return mc::document_attention(q, k, v, seg);
       }},
      {"tiles", [&](auto& q, auto& k, auto& v) {
         mc::kernels::set_impl(mc::kernels::Impl::Composite);
         auto y = mc::document_attention(q, k, v, seg);
         mc::kernels::set_impl(mc::kernels::Impl::Auto);
         return y;
       }},
      {"dense", [&](auto& q, auto& k, auto& v) {
         return at::scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 dense_mask);
       }},
      {"causal_whole_sequence", [&](auto& q, auto& k, auto& v) {
         return at::scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), {}, 0.0,
                                                 true);
       }},
  };
  std::ostringstream json;
  json.precision(6);
  json << "\"benchmark\": \"doc_attention\", \"libtorch\": \"" << TORCH_VERSION << "\", \"device\": \"" << a.device
       << "\", \"dtype\": \"" << a.dtype << "\", \"batch\": " << a.batch << ", \"seq\": " << a.seq
       << ", \"heads\": " << a.heads << ", \"kv_heads\": " << a.kv_heads << ", \"dim\": " << a.dim
       << ", \"documents\": " << lengths.size() << ", \"shortest\": " << *std::min_element(lengths.begin(), lengths.end())
       << ", \"longest\": " << *std::max_element(lengths.begin(), lengths.end());
  const auto before = mc::varlen_attention_calls();
  call(kernels.at("varlen"));
  const bool varlen_ran = mc::varlen_attention_calls() > before;
  json << ", \"varlen_kernel_ran\": " << (varlen_ran ? "true" : "false");
  if (a.check) {
    const auto ref = call(kernels.at("tiles"));
    for (const char* name : {"varlen", "dense"}) {
      const auto got = call(kernels.at(name));
      double worst = 0;
      for (auto [x, y] : {std::pair{got.out, ref.out}, {got.dq, ref.dq}, {got.dk, ref.dk}, {got.dv, ref.dv}})
        worst = std::max(worst, (x.to(torch::kFloat) - y.to(torch::kFloat)).abs().max().item<double>());
      json << ", \"check_" << name << "_vs_tiles_max_abs\": " << worst;
      std::cerr << "check " << name << " vs tiles: max abs difference " << worst << "\n";
    }
  }
  json << ", \"fwd_bwd_ms\": {";
  bool first = true;
  for (const auto& [name, f] : kernels) {
    const double ms = timed(f);
    std::cerr << name << ": " << ms << " ms forward + backward\n";
    json << (first ? "" : ", ") << "\"" << name << "\": " << ms;
    first = false;
  }
  json << "}";
  std::cout << "{" << json.str() << "}\n";
  return 0;
}
