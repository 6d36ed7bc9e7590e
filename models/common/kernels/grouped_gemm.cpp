#include "models/common/kernels/grouped_gemm.h"

#include "models/common/kernels/kernels.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <numeric>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nnstrain::models::common::kernels {
namespace {

std::atomic<int> last{-1};  // the GroupedGemm the last call ran

// Compute capability major of x's CUDA device (0 when unknown).
int cuda_major(const at::Tensor& x) {
#ifdef NNSTRAIN_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, x.device().index()) == cudaSuccess) return prop.major;
#endif
  (void)x;
  return 0;
}

at::Tensor loop(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> parts;
  parts.reserve(counts.size());
  int64_t pos = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] > 0) parts.push_back(torch::mm(x.narrow(0, pos, counts[g]), w[g].t()));
    pos += counts[g];
  }
  if (parts.empty()) return x.new_zeros({0, w.size(1)});
  return parts.size() == 1 ? parts[0] : torch::cat(parts);
}

// Rows into a zero-padded [G, max, K] batch (index_put: differentiable), one bmm, rows back.
at::Tensor padded_bmm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  const int64_t G = static_cast<int64_t>(counts.size()), M = x.size(0), K = x.size(1);
  const int64_t most = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  if (M == 0 || most == 0) return x.new_zeros({M, w.size(1)});
  std::vector<int64_t> slot(M);  // row -> g * most + its place in group g
  int64_t r = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < counts[g]; ++i) slot[r++] = g * most + i;
  const auto index = torch::tensor(slot, torch::kLong).to(x.device());
  auto batch = x.new_zeros({G * most, K}).index_copy(0, index, x).view({G, most, K});
  auto y = torch::bmm(batch, w.transpose(1, 2));  // [G, most, N]
  return y.reshape({G * most, -1}).index_select(0, index);
}

at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  std::vector<int32_t> ends(counts.size());
  int64_t pos = 0;
  for (size_t g = 0; g < counts.size(); ++g) ends[g] = static_cast<int32_t>(pos += counts[g]);
  const auto offs = torch::tensor(ends, torch::kInt).to(x.device(), /*non_blocking=*/true);
  return at::_grouped_mm(x, w.transpose(1, 2), offs);
}

}  // namespace

GroupedGemm choose_grouped_gemm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts) {
  if (x.is_cuda()) {
    const bool fits = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.size(1) % 8 == 0 &&
                      w.size(1) % 8 == 0 && cuda_major(x) >= 9;
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
  switch (which) {
    case GroupedGemm::GroupedMm: return grouped_mm(x, w, counts);
    case GroupedGemm::PaddedBmm: return padded_bmm(x, w, counts);
    default: return loop(x, w, counts);
  }
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
