#include "models/common/varlen_attention.h"

#include "models/common/segments_cache.h"

#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <vector>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nnstrain::models::common {
namespace {

std::atomic<int64_t> calls{0};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [B, H, T, D] -> [B T, H, D] (contiguous) and back.
at::Tensor pack(const at::Tensor& t) { return t.transpose(1, 2).reshape({t.size(0) * t.size(2), t.size(1), t.size(3)}); }
at::Tensor unpack(const at::Tensor& t, int64_t B) {
  return t.view({B, t.size(0) / B, t.size(1), t.size(2)}).transpose(1, 2);
}

// The flash kernel's forward and backward on the packed tensors. Dropout is 0:
// the rng state it returns is kept only because its backward takes it.
class VarlenFlash : public torch::autograd::Function<VarlenFlash> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu, int64_t max_len, double scale) {
    auto [out, lse, rng, unused, debug] =
        at::_flash_attention_forward(q, k, v, cu, cu, max_len, max_len, /*dropout_p=*/0.0, /*is_causal=*/true,
                                     /*return_debug_mask=*/false, scale);
    ctx->save_for_backward({q, k, v, out, lse, cu, rng, unused});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    auto [dq, dk, dv] = at::_flash_attention_backward(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[5],
                                                      max_len, max_len, 0.0, /*is_causal=*/true, s[6], s[7], scale);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The reference on packed tensors: one causal SDPA per document (K/V heads repeated for GQA).
at::Tensor per_document(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu,
                        double scale) {
  const auto bounds = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = bounds.data_ptr<int64_t>();
  const int64_t rep = q.size(1) / k.size(1);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i + 1 < bounds.numel(); ++i) {
    const int64_t a = c[i], n = c[i + 1] - c[i];
    auto head_first = [&](const at::Tensor& t, int64_t r) {
      auto x = t.narrow(0, a, n).transpose(0, 1);  // [H, n, D]
      return r > 1 ? x.repeat_interleave(r, 0) : x;
    };
    auto y = at::scaled_dot_product_attention(head_first(q, 1), head_first(k, rep), head_first(v, rep), {}, 0.0,
                                              /*is_causal=*/true, scale);
    parts.push_back(y.transpose(0, 1));
  }
  return torch::cat(parts);
}

}  // namespace

bool varlen_flash_fits(const at::Tensor& q, const at::Tensor& k) {
  if (!q.is_cuda() || q.dim() != 4 || k.dim() != 4) return false;
  const auto t = q.scalar_type();
  if (t != at::kHalf && t != at::kBFloat16) return false;
  const int64_t D = q.size(3);
  if (D % 8 != 0 || D > 256 || q.size(1) % k.size(1) != 0) return false;
#ifdef NNSTRAIN_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, q.device().index()) != cudaSuccess) return false;
  return prop.major >= 8;
#else
  return false;
#endif
}

std::pair<at::Tensor, int64_t> document_cu_seqlens(const at::Tensor& segments, const at::Device& device) {
  const auto seg = segments.to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(seg.dim() == 2, "document_cu_seqlens: segments [B, T]");
  const int64_t B = seg.size(0), T = seg.size(1);
  std::vector<int32_t> cu{0};
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* s = seg.data_ptr<int64_t>() + b * T;
    for (int64_t p = 1; p <= T; ++p) {
      if (p < T) TORCH_CHECK(s[p] >= s[p - 1], "packed documents: segments decrease at token ", p, " of batch row ", b);
      if (p == T || s[p] != s[p - 1]) {  // a run ends at p
        const int64_t start = cu.back() - b * T;  // where it began, within the row
        longest = std::max(longest, p - start);
        cu.push_back(static_cast<int32_t>(b * T + p));
      }
    }
  }
  return {torch::tensor(cu, torch::kInt).to(device), longest};
}

at::Tensor varlen_document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& segments, std::optional<double> scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "varlen_document_attention: q [B, Hq, T, D], k and v [B, Hkv, T, D]");
  TORCH_CHECK(segments.dim() == 2 && segments.size(0) == q.size(0) && segments.size(1) == q.size(2),
              "varlen_document_attention: segments [B, T]");
  const int64_t B = q.size(0);
  const double s = scale.value_or(1.0 / std::sqrt(double(q.size(3))));
  static thread_local SegmentsCache<std::pair<at::Tensor, int64_t>> runs;  // one host copy per batch, not per layer
  const auto& [cu, longest] = runs.get(segments, [&](const at::Tensor& s) { return document_cu_seqlens(s, q.device()); });
  calls.fetch_add(1, std::memory_order_relaxed);
  const auto qp = pack(q), kp = pack(k), vp = pack(v);
  const auto out = q.is_cuda() ? VarlenFlash::apply(qp, kp, vp, cu, longest, s) : per_document(qp, kp, vp, cu, s);
  return unpack(out, B);
}

int64_t varlen_attention_calls() { return calls.load(); }

}  // namespace nnstrain::models::common
