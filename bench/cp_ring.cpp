// One rank's share of context-parallel ring attention against one plain SDPA
// call doing the same unmasked FLOPs (issue 22's GPU goal: >= 0.85).
//
// The ring: context_parallel_attention (models/common/context_attention.cpp)
// forward and backward, causal, p2p, zigzag, at cp ranks, run as rank --rank of
// that ring on one device. Its communicator is a stand-in that knows every
// rank's K/V block (random, made here): a "receive" hands over the block the
// real ring would deliver at that step, without moving a byte, and the K/V
// gradients travelling home are handed back as they are. So the time is
// exactly the compute the real rank does (every block's kernel calls, the fp32
// log-sum-exp merges, the gradient accumulation, the copies and casts the op
// makes) and nothing of the communication: no sends or receives, no NCCL
// kernels sharing the SMs, no waiting for a slower peer.
//
// The baseline: one scaled_dot_product_attention call forward and backward with
// the rank's queries against as many keys as it sees under the causal mask
// (zigzag rank: 2 cp - 1 full chunks and two half chunks = T_local x T / 2
// keys), no mask, GQA as the model has it; once per backend that runs (flash
// with GQA native, cuDNN and memory-efficient with K/V expanded, ATen's choice).
// efficiency = baseline time / ring time, the best backend's.
//
//   cmake --build build --target nnstrain_bench_cp_ring
//   build/nnstrain_bench_cp_ring --device cuda --dtype bf16 --seq 131072 --cp 8 --rank 0
//       [--heads 32] [--kv-heads 8] [--dim 128] [--batch 1] [--repeats 5] [--warmup 2] [--check]
// Prints what it measured and one JSON line last.
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <utility>
#include <sstream>
#include <string>
#include <vector>

#include "bench/attention_args.h"
#include "models/common/context_attention.h"

using namespace nnstrain::models::common;

namespace {

struct Args : nnstrain::bench::AttentionArgs {
  int cp = 8, rank = 0;
  Args() { seq = 131072; }
};

// The ring with every peer's block already here: see the file comment.
class StandInRing : public CpComm {
 public:
  StandInRing(int size, int rank, std::vector<at::Tensor> blocks) : size_(size), rank_(rank), blocks_(std::move(blocks)) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  Pending ring_shift_start(const at::Tensor& t, int channel) override {
    if (channel == 1) return [t] { return t; };  // gradients on their way home: no compute, no bytes moved
    // The block after t's in the order blocks arrive (rank - 1, rank - 2, ...).
    int from = rank_;
    for (int i = 0; i < size_; ++i)
      if (blocks_[i].defined() && blocks_[i].data_ptr() == t.data_ptr()) from = i;
    const at::Tensor next = blocks_[((from - 1) % size_ + size_) % size_];
    return [next] { return next; };
  }
  at::Tensor all_gather(const at::Tensor& t) override {
    std::vector<at::Tensor> all(blocks_);
    all[rank_] = t;
    return at::stack(all);
  }
  at::Tensor reduce_scatter(const at::Tensor& t) override { return t[rank_]; }

 private:
  int size_, rank_;
  std::vector<at::Tensor> blocks_;  // [2, B, Hkv, Tl, D] of every rank but this one
};

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index() < 0 ? 0 : d.index());
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of fn() (forward + backward) over `repeats` runs after `warmup`.
template <class F>
double timed(const Args& a, const at::Device& d, F&& fn) {
  for (int i = 0; i < a.warmup; ++i) fn();
  sync(d);
  std::vector<double> t;
  for (int i = 0; i < a.repeats; ++i) {
    const double t0 = now_s();
    fn();
    sync(d);
    t.push_back(now_s() - t0);
  }
  return median(t);
}

const char* backend_name(int64_t b) {
  switch (b) {
    case 0: return "math";
    case 1: return "flash";
    case 2: return "efficient";
    case 3: return "cudnn";
    case 4: return "overrideable";
    default: return "none";
  }
}

// Only backend `b` allowed (-1: ATen's default choice among all).
void allow_only(int64_t b) {
  auto& c = at::globalContext();
  c.setSDPUseMath(b < 0 || b == 0);
  c.setSDPUseFlash(b < 0 || b == 1);
  c.setSDPUseMemEfficient(b < 0 || b == 2);
  c.setSDPUseCuDNN(b < 0 || b == 3);
}

Args parse(int argc, char** argv) {
  Args a;
  nnstrain::bench::parse_attention_args(argc, argv, a, [&](const std::string& k, const auto& value) {
    if (k == "--cp") a.cp = std::stoi(value());
    else if (k == "--rank") a.rank = std::stoi(value());
    else return false;
    return true;
  });
  if (a.rank < 0 || a.rank >= a.cp) throw std::invalid_argument("--rank must be in [0, --cp)");
  check_cp_split(a.seq, a.cp, CpLayout::Zigzag);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "nnstrain_bench_cp_ring: " << e.what() << "\n";
    return 2;
  }
  torch::NoGradGuard outer_off;  // turned back on around each measured call
  const at::Device dev(a.device);
  const auto opts = torch::TensorOptions().device(dev).dtype(a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat);
  const int64_t tl = a.seq / a.cp;
  torch::manual_seed(0);
  auto q = torch::randn({a.batch, a.heads, tl, a.dim}, opts);
  auto k = torch::randn({a.batch, a.kv_heads, tl, a.dim}, opts);
  auto v = torch::randn({a.batch, a.kv_heads, tl, a.dim}, opts);
  auto dout = torch::randn({a.batch, a.heads, tl, a.dim}, opts);
  std::vector<at::Tensor> blocks(a.cp);
  for (int r = 0; r < a.cp; ++r)
    if (r != a.rank) blocks[r] = torch::randn({2, a.batch, a.kv_heads, tl, a.dim}, opts);
  auto comm = c10::make_intrusive<StandInRing>(a.cp, a.rank, blocks);
  CpAttentionOptions o;
  o.comm_type = CpCommType::P2P;
  o.layout = CpLayout::Zigzag;

  auto ring_step = [&](bool backward) {
    torch::AutoGradMode on(true);
    auto qq = q.detach().requires_grad_(backward), kk = k.detach().requires_grad_(backward),
         vv = v.detach().requires_grad_(backward);
    auto out = context_parallel_attention(qq, kk, vv, /*causal=*/true, comm, o);
    if (backward) out.backward(dout);
    return out.detach();
  };

  std::ostringstream json;
  json.precision(6);
  // Unmasked score entries of this rank: its rows times the keys each sees.
  const auto pos = cp_position_ids(a.seq, a.cp, a.rank, CpLayout::Zigzag);
  double entries = 0;
  for (int64_t p : pos) entries += static_cast<double>(p + 1);
  const auto keys = static_cast<int64_t>(entries / tl);  // the baseline's key count (T / 2 for zigzag)
  // FLOPs: forward 2 matmuls (4 B H Lq Lk D), backward 5 (10 ...), as flash attention counts them.
  const double fwd_flops = 4.0 * a.batch * a.heads * entries * a.dim;
  std::cout << "ring attention, one rank's share: seq " << a.seq << " at cp " << a.cp << " (zigzag, causal, p2p), rank "
            << a.rank << ": " << tl << " queries x " << a.cp << " ring steps of " << tl << " keys; heads " << a.heads
            << "/" << a.kv_heads << ", dim " << a.dim << ", " << a.dtype << ", batch " << a.batch << ", " << a.device
            << "\nbaseline: one SDPA call, " << tl << " queries x " << keys << " keys, no mask (the same "
            << entries / 1e9 << " G score entries per head)\nnot included: any communication (the ring's K/V and "
            << "gradient transfers, NCCL kernels beside the compute, waiting for peers)\n";

  if (a.check) {  // the stand-in ring computes the real thing: against one masked SDPA over the whole sequence
    std::vector<at::Tensor> all(blocks);
    all[a.rank] = torch::stack({k, v});
    auto full = cp_unshard(torch::stack(all), 3, CpLayout::Zigzag);  // [2, B, Hkv, T, D]
    auto pos_t = torch::tensor(pos, torch::kLong).to(dev);
    auto mask = pos_t.unsqueeze(1) >= torch::arange(a.seq, torch::TensorOptions().dtype(torch::kLong).device(dev));
    const int64_t g = a.heads / a.kv_heads;
    auto want = at::scaled_dot_product_attention(q.to(torch::kFloat), full[0].repeat_interleave(g, 1).to(torch::kFloat),
                                                 full[1].repeat_interleave(g, 1).to(torch::kFloat), mask);
    const double err = (ring_step(false).to(torch::kFloat) - want).abs().max().item<double>();
    const double tol = a.dtype == "bf16" ? 2e-2 : 1e-4;
    std::cout << "check: ring output vs one masked SDPA over the whole sequence: max abs diff " << err << " (tolerance "
              << tol << ")\n";
    if (!(err <= tol)) {
      std::cerr << "nnstrain_bench_cp_ring: the stand-in ring's output differs from the whole sequence's attention\n";
      return 1;
    }
    json << "\"check_max_abs_diff\": " << err << ", ";
  }

  const double ring_fwd = timed(a, dev, [&] { ring_step(false); });
  const double ring_fb = timed(a, dev, [&] { ring_step(true); });
  std::cout << "ring: forward " << ring_fwd * 1e3 << " ms, forward + backward " << ring_fb * 1e3 << " ms ("
            << 3.5 * fwd_flops / ring_fb / 1e12 << " TFLOP/s)\n";

  // The baseline on the same data: q against `keys` keys (wrapping round the K/V blocks).
  std::vector<at::Tensor> kv_list;
  for (int r = 0; r < a.cp; ++r) kv_list.push_back(r == a.rank ? torch::stack({k, v}) : blocks[r]);
  auto kv_cat = torch::cat(kv_list, 3);  // [2, B, Hkv, T, D]
  auto kb = kv_cat[0].narrow(2, 0, keys).contiguous(), vb = kv_cat[1].narrow(2, 0, keys).contiguous();
  const int64_t g = a.heads / a.kv_heads;
  auto kx = kb.repeat_interleave(g, 1), vx = vb.repeat_interleave(g, 1);
  std::map<std::string, double> base;
  std::string best;
  // (backend, GQA native): flash takes the KV heads as they are; cuDNN and
  // memory-efficient get them expanded (repeat_interleave, outside the timing).
  const std::vector<std::pair<int64_t, bool>> runs =
      dev.is_cuda() ? std::vector<std::pair<int64_t, bool>>{{-1, true}, {1, true}, {3, false}, {2, false}}
                    : std::vector<std::pair<int64_t, bool>>{{-1, true}};
  for (const auto& [b, gqa] : runs) {
    allow_only(b);
    const auto& k0 = gqa ? kb : kx;
    const auto& v0 = gqa ? vb : vx;
    std::string name = b < 0 ? "default" : backend_name(b);
    try {
      if (b < 0) name += std::string(" (") + backend_name(at::_fused_sdp_choice(q, k0, v0, {}, 0.0, false, std::nullopt, gqa)) + ")";
      if (!gqa) name += ", K/V expanded";
      const double t = timed(a, dev, [&] {
        torch::AutoGradMode on(true);
        auto qq = q.detach().requires_grad_(true), kk = k0.detach().requires_grad_(true),
             vv = v0.detach().requires_grad_(true);
        at::scaled_dot_product_attention(qq, kk, vv, {}, 0.0, false, std::nullopt, gqa).backward(dout);
      });
      base[name] = t;
      std::cout << "baseline " << name << ": forward + backward " << t * 1e3 << " ms (" << 3.5 * fwd_flops / t / 1e12
                << " TFLOP/s)\n";
      if (best.empty() || t < base[best]) best = name;
    } catch (const std::exception& e) {
      std::string m = e.what();
      std::cout << "baseline " << name << ": did not run (" << m.substr(0, m.find('\n')) << ")\n";
    }
  }
  allow_only(-1);
  if (best.empty()) {
    std::cerr << "nnstrain_bench_cp_ring: no SDPA backend ran the baseline\n";
    return 1;
  }
  const double eff = base[best] / ring_fb;
  std::cout << "efficiency (best baseline, " << best << ", over the ring, forward + backward): " << eff
            << " (goal >= 0.85)\n";
  json << "\"benchmark\": \"cp_ring\", \"libtorch\": \"" << TORCH_VERSION << "\", \"device\": \"" << a.device
       << "\", \"dtype\": \"" << a.dtype << "\", \"seq\": " << a.seq << ", \"cp\": " << a.cp << ", \"rank\": " << a.rank
       << ", \"batch\": " << a.batch << ", \"heads\": " << a.heads << ", \"kv_heads\": " << a.kv_heads
       << ", \"dim\": " << a.dim << ", \"local_queries\": " << tl << ", \"baseline_keys\": " << keys
       << ", \"fwd_flops\": " << fwd_flops << ", \"ring_fwd_ms\": " << ring_fwd * 1e3
       << ", \"ring_fwd_bwd_ms\": " << ring_fb * 1e3 << ", \"baseline_ms\": {";
  bool first = true;
  for (const auto& [n, t] : base) {
    json << (first ? "" : ", ") << "\"" << n << "\": " << t * 1e3;
    first = false;
  }
  json << "}, \"best_baseline\": \"" << best << "\", \"efficiency\": " << eff
       << ", \"includes_communication\": false}";
  std::cout << "{" << json.str() << "\n";
  return 0;
}
