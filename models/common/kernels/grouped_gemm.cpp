#include "models/common/kernels/grouped_gemm.h"

#include "models/common/kernels/kernels.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <numeric>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nnstrain::models::common::kernels {
namespace {

std::atomic<int> last{-1};  // the GroupedGemm the last call ran

// Compute capability major of x's CUDA device (0 when unknown), asked once per
// device: cudaGetDeviceProperties costs far more than the choice it informs.
int cuda_major(const at::Tensor& x) {
#ifdef NNSTRAIN_CUDA
  static std::array<std::atomic<int>, 64> known{};  // major + 1; 0: not asked yet
  const int d = x.device().index();
  if (d < 0 || d >= static_cast<int>(known.size())) return 0;
  int k = known[d].load(std::memory_order_relaxed);
  if (k == 0) {
    cudaDeviceProp prop{};
    k = 1 + (cudaGetDeviceProperties(&prop, d) == cudaSuccess ? prop.major : 0);
    known[d].store(k, std::memory_order_relaxed);
  }
  return k - 1;
#else
  (void)x;
  return 0;
#endif
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Host integers on `d` as int64: on CUDA through pinned memory, so the copy is
// asynchronous (a pageable one blocks the host per layer); the caching host
// allocator keeps the block until the copy has run.
at::Tensor to_device(const std::vector<int64_t>& v, const c10::Device& d) {
  auto h = torch::empty({static_cast<int64_t>(v.size())},
                        torch::TensorOptions().dtype(torch::kLong).pinned_memory(d.is_cuda()));
  std::copy(v.begin(), v.end(), h.data_ptr<int64_t>());
  return d.is_cuda() ? h.to(d, /*non_blocking=*/true) : h;
}

// No rows: [0, N] from x and w's first group, so autograd reaches both (zero
// gradients) and every collective behind them runs in backward.
at::Tensor no_rows(const at::Tensor& x, const at::Tensor& w) {
  return torch::mm(x, (w.size(0) > 0 ? w[0] : w.sum(0)).t());
}

// Runs fn(g, first row of g) for every group with rows. On the CPU the groups are
// dealt to the intra-op threads in contiguous ranges of about equal rows, each
// group's small GEMM on one thread: at moe_mini's sizes (a few hundred rows of
// 128) splitting one GEMM over threads gains little, splitting the experts scales.
template <class Fn>
void for_each_group(const std::vector<int64_t>& counts, bool on_cpu, const Fn& fn) {
  const int64_t G = static_cast<int64_t>(counts.size());
  std::vector<int64_t> first(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) first[g + 1] = first[g] + counts[g];
  const int64_t T = on_cpu && !at::in_parallel_region() ? std::min<int64_t>(at::get_num_threads(), G) : 1;
  if (T <= 1) {
    for (int64_t g = 0; g < G; ++g)
      if (counts[g] > 0) fn(g, first[g]);
    return;
  }
  std::vector<int64_t> cut(T + 1, G);  // range r: groups [cut[r], cut[r + 1])
  cut[0] = 0;
  for (int64_t r = 1, g = 0; r < T; ++r) {
    while (g < G && first[g + 1] * T < first[G] * r) ++g;
    cut[r] = std::max(cut[r - 1], g);
  }
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    // OpenMP workers do not inherit the caller's thread-local state: the GEMMs
    // write into outputs (out= forms), which autograd must not see.
    at::NoGradGuard no_grad;
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = cut[r]; g < cut[r + 1]; ++g)
        if (counts[g] > 0) fn(g, first[g]);
  });
}

// The experts' SwiGLU MLP as one autograd node, group by group: each group's three
// GEMMs and its SwiGLU run while its rows are in cache, and the backward needs one
// parallel pass instead of six. Autograd through w[g] and row slices would give each
// group a SelectBackward/SliceBackward that zero-fills a whole [G, N, K] / [M, K]
// gradient (G^2 work per layer: the fill_ that dominated moe_mini's CPU profile);
// here each group's gradients go into their slices. Saves gate and up outputs (a, b).
class LoopSwigluMlp : public torch::autograd::Function<LoopSwigluMlp> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down, std::vector<int64_t> counts) {
    const int64_t M = x.size(0), I = gate.size(1);
    auto a = x.new_empty({M, I}), b = x.new_empty({M, I}), y = x.new_empty({M, down.size(1)});
    for_each_group(counts, x.is_cpu(), [&](int64_t g, int64_t pos) {
      const int64_t m = counts[g];
      const auto xg = x.narrow(0, pos, m);
      auto ag = a.narrow(0, pos, m), bg = b.narrow(0, pos, m), yg = y.narrow(0, pos, m);
      at::mm_out(ag, xg, gate[g].t());
      at::mm_out(bg, xg, up[g].t());
      at::mm_out(yg, at::silu(ag).mul_(bg), down[g].t());
    });
    ctx->save_for_backward({x, gate, up, down, a, b});
    ctx->saved_data["counts"] = counts;
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &gate = s[1], &up = s[2], &down = s[3], &a = s[4], &b = s[5];
    const auto counts = ctx->saved_data["counts"].toIntVector();
    const auto gy = grads[0].contiguous();
    auto gx = x.new_empty(x.sizes());
    auto ggate = gate.new_empty(gate.sizes()), gup = up.new_empty(up.sizes()), gdown = down.new_empty(down.sizes());
    for (size_t g = 0; g < counts.size(); ++g)  // a group with no rows: zero
      if (counts[g] == 0) ggate[g].zero_(), gup[g].zero_(), gdown[g].zero_();
    for_each_group(counts, x.is_cpu(), [&](int64_t g, int64_t pos) {
      const int64_t m = counts[g];
      const auto xg = x.narrow(0, pos, m), ag = a.narrow(0, pos, m), bg = b.narrow(0, pos, m);
      const auto gyg = gy.narrow(0, pos, m);
      const auto act = at::silu(ag);
      auto wd = gdown[g], wg = ggate[g], wu = gup[g], dx = gx.narrow(0, pos, m);
      at::mm_out(wd, gyg.t(), act * bg);                       // d down_g = dy^T h
      const auto dh = at::mm(gyg, down[g]);                     // dh = dy down_g
      const auto db = dh * act;                                 // h = silu(a) b
      const auto da = at::silu_backward(dh.mul_(bg), ag);
      at::mm_out(wg, da.t(), xg);                               // d gate_g = da^T x
      at::mm_out(wu, db.t(), xg);                               // d up_g = db^T x
      at::mm_out(dx, da, gate[g]);                              // dx = da gate_g + db up_g
      dx.addmm_(db, up[g]);
    });
    return {gx, ggate, gup, gdown, at::Tensor()};
  }
};

// One mm per group through autograd: the reference form of a single projection
// (the experts' MLP runs LoopSwigluMlp above, which writes gradients in place).
at::Tensor loop(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> parts;
  int64_t pos = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] > 0) parts.push_back(torch::mm(x.narrow(0, pos, counts[g]), w[g].t()));
    pos += counts[g];
  }
  if (parts.empty()) return no_rows(x, w);
  return parts.size() == 1 ? parts[0] : torch::cat(parts);
}

// Rows into a zero-padded [G, max, K] batch (index_put: differentiable), one bmm, rows back.
at::Tensor padded_bmm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t G = static_cast<int64_t>(counts.size()), M = x.size(0), K = x.size(1);
  const int64_t most = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  if (M == 0 || most == 0) return no_rows(x, w);
  // Row -> g * most + its place in group g, made on x's device from the G counts
  // (one asynchronous copy of G integers, not M).
  const auto n = to_device(counts, x.device());
  const auto group = torch::repeat_interleave(torch::arange(G, n.options()), n, 0, M);
  const auto first = n.cumsum(0) - n;
  const auto index = group * most + torch::arange(M, n.options()) - first.index_select(0, group);
  auto batch = x.new_zeros({G * most, K}).index_copy(0, index, x).view({G, most, K});
  auto y = torch::bmm(batch, w.transpose(1, 2));  // [G, most, N]
  return y.reshape({G * most, -1}).index_select(0, index);
}

// offs (each group's end row, int32) computed on the device from the counts.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  const auto offs = to_device(counts, x.device()).cumsum(0).to(torch::kInt);
  return at::_grouped_mm(x, w.transpose(1, 2), offs);
}

}  // namespace

bool grouped_mm_fits(int cc_major, bool bf16, int64_t K, int64_t N, const std::vector<const void*>& operands) {
  if (cc_major != 9 || !bf16 || K % 8 != 0 || N % 8 != 0) return false;
  return std::all_of(operands.begin(), operands.end(), aligned16);
}

GroupedGemm choose_grouped_gemm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                                const std::vector<const at::Tensor*>& more) {
  if (x.is_cuda()) {
    bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
    std::vector<const void*> ptrs = {x.data_ptr(), w.data_ptr()};
    for (const auto* t : more) bf16 = bf16 && t->scalar_type() == at::kBFloat16, ptrs.push_back(t->data_ptr());
    const bool fits = grouped_mm_fits(cuda_major(x), bf16, x.size(1), w.size(1), ptrs);
    return fits ? GroupedGemm::GroupedMm : GroupedGemm::PaddedBmm;
  }
  // CPU: a per-group mm costs a call each; padding costs copies of max x G rows.
  // The loop wins unless the groups are many and each holds a handful of rows.
  const int64_t G = static_cast<int64_t>(counts.size());
  const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int64_t most = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  return (G >= 16 && M < 4 * G && most * G <= 2 * M) ? GroupedGemm::PaddedBmm : GroupedGemm::Loop;
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                          GroupedGemm which) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == x.size(1) && w.size(0) == int64_t(counts.size()),
              "grouped_linear: x [M, K], w [G, N, K], one count per group");
  // NNSTRAIN_KERNELS=composite: the reference form, one mm per group (the GPU battery's baseline).
  if (which == GroupedGemm::Auto)
    which = impl() == Impl::Composite ? GroupedGemm::Loop : choose_grouped_gemm(x, w, counts);
  last.store(static_cast<int>(which));
  if (x.size(0) == 0) return no_rows(x, w);  // every form: a result in the graph
  switch (which) {
    case GroupedGemm::GroupedMm: return grouped_mm(x, w, counts);
    case GroupedGemm::PaddedBmm: return padded_bmm(x, w, counts);
    default: return loop(x, w, counts);
  }
}

at::Tensor grouped_swiglu_mlp(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                              const at::Tensor& down, const std::vector<int64_t>& counts, GroupedGemm which) {
  TORCH_CHECK(x.dim() == 2 && gate.dim() == 3 && gate.sizes() == up.sizes() && down.dim() == 3 &&
                  gate.size(2) == x.size(1) && down.size(2) == gate.size(1) && gate.size(0) == int64_t(counts.size()) &&
                  down.size(0) == gate.size(0),
              "grouped_swiglu_mlp: x [M, C], gate and up [G, I, C], down [G, C, I], one count per group");
  if (which == GroupedGemm::Auto)
    which = impl() == Impl::Composite ? GroupedGemm::Loop : choose_grouped_gemm(x, gate, counts, {&up, &down});
  if (which != GroupedGemm::Loop)
    return grouped_linear(swiglu(grouped_linear(x, gate, counts, which), grouped_linear(x, up, counts, which)), down,
                          counts, which);
  last.store(static_cast<int>(which));
  return LoopSwigluMlp::apply(x.contiguous(), gate, up, down, counts);
}

const char* grouped_gemm_name(GroupedGemm g) {
  switch (g) {
    case GroupedGemm::GroupedMm: return "grouped_mm";
    case GroupedGemm::PaddedBmm: return "padded_bmm";
    case GroupedGemm::Loop: return "loop";
    default: return "auto";
  }
}

std::string last_grouped_gemm() {
  const int l = last.load();
  return l < 0 ? std::string() : grouped_gemm_name(static_cast<GroupedGemm>(l));
}

}  // namespace nnstrain::models::common::kernels
