#include "models/common/lm_loss.h"

#include <ATen/autocast_mode.h>

#include <algorithm>

namespace nnstrain::models::common {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The head's matmul runs in the dtype autocast would pick (it casts every
// floating type but fp64), else in the inputs' common dtype. Fixed at forward
// time so backward recomputes the very same logits even outside autocast.
at::ScalarType matmul_dtype(const torch::Tensor& hidden, const torch::Tensor& weight) {
  const auto common = at::result_type(hidden, weight);
  const auto dev = hidden.device().type();
  if (common != torch::kDouble && at::autocast::is_autocast_enabled(dev))
    return at::autocast::get_autocast_dtype(dev);
  return common;
}

class ChunkedLinearCrossEntropy : public torch::autograd::Function<ChunkedLinearCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t chunk, int64_t ignore_index) {
    const auto mm = matmul_dtype(hidden, weight);
    const auto acc = mm == torch::kDouble ? torch::kDouble : torch::kFloat;
    const int64_t N = hidden.size(0);
    const auto w = weight.to(mm);
    auto lse = torch::empty({N}, hidden.options().dtype(acc));
    auto total = torch::zeros({}, hidden.options().dtype(acc));
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      auto logits = torch::mm(hidden.narrow(0, s, n).to(mm), w.t()).to(acc);
      const auto t = targets.narrow(0, s, n);
      const auto valid = t.ne(ignore_index);
      auto l = torch::logsumexp(logits, 1);
      lse.narrow(0, s, n).copy_(l);
      auto picked = logits.gather(1, t.masked_fill(valid.logical_not(), 0).unsqueeze(1)).squeeze(1);
      total += torch::where(valid, l - picked, torch::zeros_like(l)).sum();
    }
    // Mean over counted tokens, as F::cross_entropy does (0 counted -> NaN there too).
    auto count = targets.ne(ignore_index).sum().to(acc);
    ctx->save_for_backward({hidden, weight, targets, lse, count});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["mm_dtype"] = static_cast<int64_t>(mm);
    return total / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3], &count = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const auto mm = static_cast<at::ScalarType>(ctx->saved_data["mm_dtype"].toInt());
    const auto acc = lse.scalar_type();
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);

    const int64_t N = hidden.size(0);
    const auto w = weight.to(mm);
    const auto scale = (grad_out[0].to(acc) / count).reshape({});  // d loss / d (per-token loss)
    torch::Tensor grad_h, grad_w;
    if (need_h) grad_h = torch::empty_like(hidden, at::MemoryFormat::Contiguous);
    if (need_w) grad_w = torch::zeros(weight.sizes(), weight.options().dtype(acc));
    for (int64_t s = 0; s < N && (need_h || need_w); s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      const auto h = hidden.narrow(0, s, n).to(mm);
      const auto t = targets.narrow(0, s, n);
      const auto valid = t.ne(ignore_index);
      // softmax - onehot, times the incoming gradient over the count; ignored rows are zero.
      auto g = torch::mm(h, w.t()).to(acc);
      g.sub_(lse.narrow(0, s, n).unsqueeze(1)).exp_();
      g.scatter_add_(1, t.masked_fill(valid.logical_not(), 0).unsqueeze(1),
                     -valid.to(acc).unsqueeze(1));
      g.mul_(torch::where(valid, scale, torch::zeros_like(scale)).unsqueeze(1));
      const auto gm = g.to(mm);
      if (need_h) grad_h.narrow(0, s, n).copy_(torch::mm(gm, w));
      if (need_w) {
        if (mm == acc)
          grad_w.addmm_(gm.t(), h);
        else
          grad_w.add_(torch::mm(gm.t(), h));
      }
    }
    if (need_w) grad_w = grad_w.to(weight.scalar_type());
    return {grad_h, grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t chunk_size,
                                           int64_t ignore_index) {
  TORCH_CHECK(chunk_size > 0, "chunked_linear_cross_entropy: chunk_size must be positive, got ", chunk_size);
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "chunked_linear_cross_entropy: expected hidden [N, C] and weight [V, C], got ", hidden.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0),
              "chunked_linear_cross_entropy: expected targets [", hidden.size(0), "], got ", targets.sizes());
  return ChunkedLinearCrossEntropy::apply(hidden, weight, targets.to(torch::kLong), chunk_size, ignore_index);
}

}  // namespace nnstrain::models::common
