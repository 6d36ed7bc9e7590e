#include "models/common/lm_loss.h"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <atomic>

#include "models/common/tp_ops.h"

namespace nnstrain::models::common {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> g_plain{0}, g_chunked{0}, g_fused{0};  // LossForwards

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

// Cross-entropy over vocabulary-split logits [N, rows]: per token, the global max,
// sum of exponentials and target logit are reduced over the group (two
// collectives: the max, then the other two packed in one tensor).
// The per-token statistics both vocabulary-split forms below share: the loss of
// each token (0 where ignored) and what backward needs (softmax, the local
// target, whether it is local, whether it counts).
// Gemma's final_logit_softcapping: logits -> c tanh(logits / c) (c 0: none),
// and its derivative 1 - (capped / c)^2 from the capped logits (undefined: none).
torch::Tensor cap_logits(torch::Tensor logits, double softcap) {
  return softcap > 0 ? logits.div_(softcap).tanh_().mul_(softcap) : logits;
}
torch::Tensor cap_derivative(const torch::Tensor& capped, double softcap) {
  if (softcap <= 0) return {};
  return 1 - (capped / softcap).square();
}

struct VocabParallelTokens {
  torch::Tensor per_token, softmax, local_t, in_range, valid;
};
VocabParallelTokens vocab_parallel_tokens(const torch::Tensor& logits, const torch::Tensor& targets,
                                          int64_t vocab_start, int64_t held, int64_t ignore_index, TpComm& c) {
  // Reduced in fp32 (fp64 for fp64 logits); padding columns never count.
  const auto acc = logits.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto lf = logits.narrow(1, 0, held).to(acc);
  auto mx = std::get<0>(lf.max(1)).contiguous();
  c.all_reduce_max(mx);
  auto shifted = lf - mx.unsqueeze(1);
  const auto valid = targets.ne(ignore_index);
  const auto in_range = valid & targets.ge(vocab_start) & targets.lt(vocab_start + held);
  const auto local_t = (targets - vocab_start).masked_fill(in_range.logical_not(), 0);
  auto target_logit = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(in_range.logical_not(), 0.0);
  auto e = shifted.exp();
  auto stats = torch::stack({target_logit, e.sum(1)});
  c.all_reduce(stats);
  const auto sum_exp = stats[1];
  auto softmax = e.div_(sum_exp.unsqueeze(1));
  auto per_token = (sum_exp.log() - stats[0]).masked_fill(valid.logical_not(), 0.0);
  return {per_token, softmax, local_t, in_range, valid};
}

// d loss / d logits from the saved statistics: (softmax - onehot(target)) where
// the token counts, times each token's incoming gradient `g_tok` ([N] or a
// scalar), padded back to the local rows and in the logits' dtype.
torch::Tensor vocab_parallel_logits_grad(AutogradContext* ctx, const torch::Tensor& g_tok) {
  const auto saved = ctx->get_saved_variables();
  auto grad = saved[0].clone();  // softmax - onehot(target) where the target is local
  grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
  grad.mul_(saved[3].to(grad.scalar_type()).unsqueeze(1));
  grad.mul_(g_tok.dim() == 0 ? g_tok : g_tok.to(grad.scalar_type()).unsqueeze(1));
  const int64_t pad = ctx->saved_data["rows"].toInt() - grad.size(1);
  if (pad > 0) grad = torch::constant_pad_nd(grad, {0, pad});
  return grad.to(static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt()));
}

class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               int64_t vocab_start, int64_t held, int64_t ignore_index,
                               const c10::intrusive_ptr<TpComm>& comm) {
    g_plain.fetch_add(1, std::memory_order_relaxed);
    ctx->saved_data["comm"] = comm_capsule(comm);
    auto s = vocab_parallel_tokens(logits, targets, vocab_start, held, ignore_index, comm_from(ctx->saved_data["comm"]));
    auto count = s.valid.sum().to(s.per_token.scalar_type());  // 0 counted -> NaN loss, zero gradients, as F::cross_entropy
    ctx->save_for_backward({s.softmax, s.local_t, s.in_range, s.valid, count.clamp_min(1)});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["rows"] = logits.size(1);
    return s.per_token.sum() / count;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto count = ctx->get_saved_variables()[4];
    return {vocab_parallel_logits_grad(ctx, (g[0] / count).reshape({})), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Per token: [N] losses (0 where ignored), each with its own gradient.
class VocabParallelTokenNll : public torch::autograd::Function<VocabParallelTokenNll> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               int64_t vocab_start, int64_t held, int64_t ignore_index,
                               const c10::intrusive_ptr<TpComm>& comm) {
    ctx->saved_data["comm"] = comm_capsule(comm);
    auto s = vocab_parallel_tokens(logits, targets, vocab_start, held, ignore_index, comm_from(ctx->saved_data["comm"]));
    ctx->save_for_backward({s.softmax, s.local_t, s.in_range, s.valid});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["rows"] = logits.size(1);
    return s.per_token;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {vocab_parallel_logits_grad(ctx, g[0]), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// The head and cross-entropy over token chunks, the logits recomputed in
// backward, over a vocabulary-split weight: per chunk, the statistics above;
// only the global per-token logsumexp is kept for backward. Over solo_comm()
// and the whole vocabulary it is the one-rank chunked loss.
class ChunkedVocabParallelCrossEntropy : public torch::autograd::Function<ChunkedVocabParallelCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t vocab_start, int64_t held, int64_t chunk,
                               int64_t ignore_index, double softcap, const c10::intrusive_ptr<TpComm>& comm) {
    g_chunked.fetch_add(1, std::memory_order_relaxed);
    ctx->saved_data["comm"] = comm_capsule(comm);
    auto& c = comm_from(ctx->saved_data["comm"]);
    const auto mm = matmul_dtype(hidden, weight);
    const auto acc = mm == torch::kDouble ? torch::kDouble : torch::kFloat;
    const int64_t N = hidden.size(0);
    const auto w = weight.narrow(0, 0, held).to(mm);
    auto lse = torch::empty({N}, hidden.options().dtype(acc));
    auto total = torch::zeros({}, hidden.options().dtype(acc));
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      auto logits = cap_logits(torch::mm(hidden.narrow(0, s, n).to(mm), w.t()).to(acc), softcap);
      const auto t = targets.narrow(0, s, n);
      const auto valid = t.ne(ignore_index);
      const auto in_range = valid & t.ge(vocab_start) & t.lt(vocab_start + held);
      auto mx = std::get<0>(logits.max(1)).contiguous();
      c.all_reduce_max(mx);
      const auto local_t = (t - vocab_start).masked_fill(in_range.logical_not(), 0);
      auto target_logit =
          logits.gather(1, local_t.unsqueeze(1)).squeeze(1).sub(mx).masked_fill(in_range.logical_not(), 0.0);
      auto stats = torch::stack({target_logit, (logits - mx.unsqueeze(1)).exp_().sum(1)});
      c.all_reduce(stats);
      auto l = mx + stats[1].log();
      lse.narrow(0, s, n).copy_(l);
      total += torch::where(valid, stats[1].log() - stats[0], torch::zeros_like(l)).sum();
    }
    auto count = targets.ne(ignore_index).sum().to(acc);
    ctx->save_for_backward({hidden, weight, targets, lse, count.clamp_min(1)});  // backward's scale: none counted, zero
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["held"] = held;
    ctx->saved_data["mm_dtype"] = static_cast<int64_t>(mm);
    ctx->saved_data["softcap"] = softcap;
    return total / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3], &count = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t vocab_start = ctx->saved_data["vocab_start"].toInt(), held = ctx->saved_data["held"].toInt();
    const auto mm = static_cast<at::ScalarType>(ctx->saved_data["mm_dtype"].toInt());
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const auto acc = lse.scalar_type();
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    const int64_t N = hidden.size(0);
    const auto w = weight.narrow(0, 0, held).to(mm);
    const auto scale = (grad_out[0].to(acc) / count).reshape({});
    torch::Tensor grad_h, grad_w;
    if (need_h) grad_h = torch::empty_like(hidden, at::MemoryFormat::Contiguous);
    if (need_w) grad_w = torch::zeros(weight.sizes(), weight.options().dtype(acc));  // padding rows stay 0
    for (int64_t s = 0; s < N && (need_h || need_w); s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      const auto h = hidden.narrow(0, s, n).to(mm);
      const auto t = targets.narrow(0, s, n);
      const auto valid = t.ne(ignore_index);
      const auto in_range = valid & t.ge(vocab_start) & t.lt(vocab_start + held);
      auto g = cap_logits(torch::mm(h, w.t()).to(acc), softcap);
      const auto dcap = cap_derivative(g, softcap);
      g.sub_(lse.narrow(0, s, n).unsqueeze(1)).exp_();
      g.scatter_add_(1, (t - vocab_start).masked_fill(in_range.logical_not(), 0).unsqueeze(1),
                     -in_range.to(acc).unsqueeze(1));
      g.mul_(torch::where(valid, scale, torch::zeros_like(scale)).unsqueeze(1));
      if (dcap.defined()) g.mul_(dcap);
      const auto gm = g.to(mm);
      if (need_h) grad_h.narrow(0, s, n).copy_(torch::mm(gm, w));  // this rank's part; the group sums it
      if (need_w) grad_w.narrow(0, 0, held).add_(torch::mm(gm.t(), h).to(acc));
    }
    if (need_w) grad_w = grad_w.to(weight.scalar_type());
    return {grad_h, grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// The head and cross-entropy over token chunks with the gradients made in
// forward: per chunk the logits (compute dtype), the statistics above reduced in
// fp32, then softmax - onehot (in place of the logits) times the chunk's hidden
// states and the weight. Backward only multiplies the kept gradients by the
// incoming one: no matmul on the logits there, so the head costs the plain
// loss's three matmuls instead of the chunked loss's four. The gradients are
// made only where `need_h` / `need_w` say (a forward under no_grad, e.g. the
// first pass of a recomputed region, makes none and costs one matmul).
class FusedVocabParallelCrossEntropy : public torch::autograd::Function<FusedVocabParallelCrossEntropy> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t vocab_start, int64_t held, int64_t chunk,
                               int64_t ignore_index, bool need_h, bool need_w, double softcap,
                               const c10::intrusive_ptr<TpComm>& comm) {
    g_fused.fetch_add(1, std::memory_order_relaxed);
    auto& c = *comm;
    const auto mm = matmul_dtype(hidden, weight);
    const auto acc = mm == torch::kDouble ? torch::kDouble : torch::kFloat;
    const int64_t N = hidden.size(0);
    const auto w = weight.narrow(0, 0, held).to(mm);
    auto total = torch::zeros({}, hidden.options().dtype(acc));
    // Kept in fp32 (fp64): unscaled until backward, where an fp16 loss scale
    // arrives, so nothing underflows in a 16-bit buffer meanwhile.
    torch::Tensor grad_h, grad_w;
    if (need_h) grad_h = torch::empty({N, hidden.size(1)}, hidden.options().dtype(acc));
    if (need_w) grad_w = torch::zeros(weight.sizes(), weight.options().dtype(acc));  // padding rows stay 0
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      const auto h = hidden.narrow(0, s, n).to(mm);
      auto logits = cap_logits(torch::mm(h, w.t()).to(acc), softcap);
      const auto dcap = need_h || need_w ? cap_derivative(logits, softcap) : torch::Tensor();  // before exp_ below
      const auto t = targets.narrow(0, s, n);
      const auto valid = t.ne(ignore_index);
      const auto in_range = valid & t.ge(vocab_start) & t.lt(vocab_start + held);
      auto mx = std::get<0>(logits.max(1)).contiguous();
      c.all_reduce_max(mx);
      const auto local_t = (t - vocab_start).masked_fill(in_range.logical_not(), 0).unsqueeze(1);
      auto target_logit = logits.gather(1, local_t).squeeze(1).sub(mx).masked_fill(in_range.logical_not(), 0.0);
      logits.sub_(mx.unsqueeze(1)).exp_();  // shifted exponentials, in place
      auto stats = torch::stack({target_logit, logits.sum(1)});
      c.all_reduce(stats);
      const auto log_sum = stats[1].log();
      total += torch::where(valid, log_sum - stats[0], torch::zeros_like(log_sum)).sum();
      if (!need_h && !need_w) continue;
      // softmax - onehot(target where it is this rank's), zero on ignored tokens
      auto& g = logits.div_(stats[1].unsqueeze(1));
      g.scatter_add_(1, local_t, -in_range.to(acc).unsqueeze(1));
      g.mul_(valid.to(acc).unsqueeze(1));
      if (dcap.defined()) g.mul_(dcap);  // through the cap: d(c tanh(x / c)) / dx
      const auto gm = g.to(mm);
      // hidden's: this rank's part (the group sums it); written in place when
      // the dtypes allow, else through a compute-dtype temporary.
      if (need_h) {
        auto dst = grad_h.narrow(0, s, n);
        if (mm == acc) torch::mm_out(dst, gm, w); else dst.copy_(torch::mm(gm, w));
      }
      if (need_w) {
        auto dst = grad_w.narrow(0, 0, held);
        if (mm == acc) dst.addmm_(gm.t(), h); else dst.add_(torch::mm(gm.t(), h));  // no fp32 copy of the 16-bit one
      }
    }
    auto count = targets.ne(ignore_index).sum().to(acc);  // 0 counted -> NaN loss, zero gradients, as F::cross_entropy
    const auto inv = count.clamp_min(1).reciprocal();
    // Consumed (moved out) by the one backward; kept out of save_for_backward
    // so backward may scale them in place without a second buffer.
    if (need_h) ctx->saved_data["grad_h"] = grad_h.mul_(inv);
    if (need_w) ctx->saved_data["grad_w"] = grad_w.mul_(inv);
    ctx->saved_data["h_dtype"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return total / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto take = [&](const char* key, const char* dtype_key) -> torch::Tensor {
      auto it = ctx->saved_data.find(key);
      if (it == ctx->saved_data.end()) return {};
      auto g = it->second.toTensor();
      ctx->saved_data.erase(it);
      const auto scale = grad_out[0].to(g.scalar_type()).reshape({});
      return g.mul_(scale).to(static_cast<at::ScalarType>(ctx->saved_data[dtype_key].toInt()));
    };
    TORCH_CHECK(!ctx->saved_data.count("done"),
                "fused linear cross-entropy: backward ran twice (its gradients, made in forward, are consumed by the "
                "first); retain_graph is not supported");
    ctx->saved_data["done"] = true;
    if (!grad_out[0].defined()) return variable_list(11);
    auto gh = take("grad_h", "h_dtype"), gw = take("grad_w", "w_dtype");
    return {gh,
            gw,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

// The head losses' inputs: hidden [N, C], weight [rows, C] of which the first
// `held` rows are the vocabulary, targets [N], chunks of at least one token.
void check_head_inputs(const char* what, const torch::Tensor& hidden, const torch::Tensor& weight,
                       const torch::Tensor& targets, int64_t held, int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0, what, ": chunk_size must be positive, got ", chunk_size);
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1) && held >= 1 &&
                  held <= weight.size(0),
              what, ": expected hidden [N, C] and weight [V, C] (this rank's rows of V), got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), what, ": expected targets [", hidden.size(0),
              "], got ", targets.sizes());
}

}  // namespace

LossForwards loss_forwards() {
  return {g_plain.load(std::memory_order_relaxed), g_chunked.load(std::memory_order_relaxed),
          g_fused.load(std::memory_order_relaxed)};
}

void count_plain_loss_forward() { g_plain.fetch_add(1, std::memory_order_relaxed); }

torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t chunk_size,
                                           int64_t ignore_index, double softcap) {
  check_head_inputs("chunked_linear_cross_entropy", hidden, weight, targets, weight.size(0), chunk_size);
  return ChunkedVocabParallelCrossEntropy::apply(hidden, weight, targets.to(torch::kLong), /*vocab_start=*/0,
                                                 /*held=*/weight.size(0), chunk_size, ignore_index, softcap,
                                                 solo_comm());
}

}  // namespace nnstrain::models::common

namespace nnstrain::models::common {

namespace {
void check_vocab_parallel_inputs(const char* what, const torch::Tensor& logits, const torch::Tensor& targets,
                                 int64_t held) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) && held >= 1 &&
                  held <= logits.size(1),
              what, ": expected logits [N, rows] and targets [N], got ", logits.sizes(), " and ", targets.sizes());
}
}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_start, int64_t held, int64_t ignore_index,
                                           const c10::intrusive_ptr<TpComm>& comm) {
  check_vocab_parallel_inputs("vocab_parallel_cross_entropy", logits, targets, held);
  return VocabParallelCrossEntropy::apply(logits, targets.to(torch::kLong), vocab_start, held, ignore_index, comm);
}

torch::Tensor vocab_parallel_token_nll(const torch::Tensor& logits, const torch::Tensor& targets,
                                       int64_t vocab_start, int64_t held, int64_t ignore_index,
                                       const c10::intrusive_ptr<TpComm>& comm) {
  check_vocab_parallel_inputs("vocab_parallel_token_nll", logits, targets, held);
  return VocabParallelTokenNll::apply(logits, targets.to(torch::kLong), vocab_start, held, ignore_index, comm);
}

torch::Tensor chunked_vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                   const torch::Tensor& targets, int64_t vocab_start, int64_t held,
                                                   int64_t chunk_size, int64_t ignore_index,
                                                   const c10::intrusive_ptr<TpComm>& comm, double softcap) {
  check_head_inputs("chunked_vocab_parallel_cross_entropy", hidden, weight, targets, held, chunk_size);
  return ChunkedVocabParallelCrossEntropy::apply(hidden, weight, targets.to(torch::kLong), vocab_start, held,
                                                 chunk_size, ignore_index, softcap, comm);
}

torch::Tensor fused_vocab_parallel_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                 const torch::Tensor& targets, int64_t vocab_start, int64_t held,
                                                 int64_t chunk_size, int64_t ignore_index,
                                                 const c10::intrusive_ptr<TpComm>& comm, double softcap) {
  check_head_inputs("fused linear cross-entropy", hidden, weight, targets, held, chunk_size);
  // Gradients only where backward can come: grad mode on and the input requiring them.
  const bool grad = torch::GradMode::is_enabled();
  return FusedVocabParallelCrossEntropy::apply(hidden, weight, targets.to(torch::kLong), vocab_start, held,
                                               chunk_size, ignore_index, grad && hidden.requires_grad(),
                                               grad && weight.requires_grad(), softcap, comm ? comm : solo_comm());
}

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& targets, int64_t chunk_size, int64_t ignore_index,
                                         double softcap) {
  return fused_vocab_parallel_cross_entropy(hidden, weight, targets, 0, weight.size(0), chunk_size, ignore_index,
                                            solo_comm(), softcap);
}

}  // namespace nnstrain::models::common
