#include "trainer/parallel/tensor_parallel.h"

#include <torch/torch.h>

#include <map>

#include "models/model.h"
#include "trainer/checkpoint/tensor_io.h"

namespace nnstrain::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

dist::Runtime* runtime_of(AutogradContext* ctx) {
  return reinterpret_cast<dist::Runtime*>(static_cast<intptr_t>(ctx->saved_data["rt"].toInt()));
}
int64_t pack(dist::Runtime* rt) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(rt)); }

at::Tensor all_reduce_copy(dist::Runtime* rt, const at::Tensor& t, const char* what) {
  auto y = t.contiguous().clone();
  rt->all_reduce(rt->tp, y, what);
  return y;
}

// f: identity forward, all-reduce of the input gradient backward.
struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t rt) {
    ctx->saved_data["rt"] = rt;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_copy(runtime_of(ctx), g[0], "tensor-parallel input-gradient all-reduce"), at::Tensor()};
  }
};

// g: all-reduce forward, identity backward.
struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t rt) {
    return all_reduce_copy(reinterpret_cast<dist::Runtime*>(static_cast<intptr_t>(rt)), x,
                           "tensor-parallel output all-reduce");
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

// Cross-entropy over vocabulary-split logits [N, V/tp]: only per-token
// statistics cross ranks (max, sum of exponentials, target logit).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_start, int64_t rt_packed) {
    auto* rt = reinterpret_cast<dist::Runtime*>(static_cast<intptr_t>(rt_packed));
    const int64_t local_vocab = logits.size(1);
    auto lf = logits.to(torch::kFloat32);
    auto mx = std::get<0>(lf.max(1));
    rt->all_reduce_max(rt->tp, mx, "vocab-parallel cross-entropy max");
    auto shifted = lf - mx.unsqueeze(1);
    auto in_range = (targets >= vocab_start) & (targets < vocab_start + local_vocab);
    auto local_t = (targets - vocab_start).masked_fill(in_range.logical_not(), 0);
    auto target_logit = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(in_range.logical_not(), 0.0);
    rt->all_reduce(rt->tp, target_logit, "vocab-parallel cross-entropy target logit");
    auto e = shifted.exp();
    auto sum_exp = e.sum(1);
    rt->all_reduce(rt->tp, sum_exp, "vocab-parallel cross-entropy normaliser");
    auto softmax = e.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, local_t, in_range});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sum_exp.log() - target_logit).mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();  // softmax - onehot(target) where the target is local
    grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(g[0] / static_cast<double>(grad.size(0)));
    return {grad.to(static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt())), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

struct Slice {
  std::vector<checkpoint::ShardSpec::Block> blocks;  // of the global tensor, in local storage order
};

// This rank's rows (dim 0) or columns (dim 1) of a split parameter.
Slice slice_of(const models::ParamSplit& d, const at::Tensor& p, int tp, int r) {
  const auto shape = p.sizes().vec();
  Slice s;
  if (d.style == models::SplitStyle::Row) {
    const int64_t n = shape.at(1) / tp;
    auto off = std::vector<int64_t>(shape.size(), 0), sz = shape;
    off[1] = r * n;
    sz[1] = n;
    s.blocks.push_back({off, sz});
    return s;
  }
  // Column or vocab: along dim 0, each fused part split on its own.
  std::vector<int64_t> parts = d.fused_parts.empty() ? std::vector<int64_t>{shape.at(0)} : d.fused_parts;
  int64_t start = 0;
  for (auto part : parts) {
    const int64_t n = part / tp;
    auto off = std::vector<int64_t>(shape.size(), 0), sz = shape;
    off[0] = start + r * n;
    sz[0] = n;
    s.blocks.push_back({off, sz});
    start += part;
  }
  return s;
}

at::Tensor take(const at::Tensor& p, const Slice& s) {
  std::vector<at::Tensor> pieces;
  for (const auto& b : s.blocks) {
    at::Tensor t = p;
    for (size_t d = 0; d < b.shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.shape[d]);
    pieces.push_back(t);
  }
  return pieces.size() == 1 ? pieces[0].contiguous() : torch::cat(pieces, 0).contiguous();
}

std::string style_name(models::SplitStyle s) {
  switch (s) {
    case models::SplitStyle::Column: return "column";
    case models::SplitStyle::Row: return "row";
    case models::SplitStyle::Vocab: return "vocab";
    default: return "replicate";
  }
}

}  // namespace

void check_tensor_parallel(const models::CausalLM& model, int tp) {
  if (tp <= 1) return;
  auto params = const_cast<models::CausalLM&>(model).named_parameters();
  for (const auto& d : model.split_declaration()) {
    if (d.style == models::SplitStyle::Replicate) continue;
    const auto* p = params.find(d.param);
    if (!p) throw TpError("split declaration names '" + d.param + "', which is not a parameter of the model");
    const auto shape = p->sizes();
    const int64_t dim = d.style == models::SplitStyle::Row ? 1 : 0;
    std::vector<int64_t> parts = d.fused_parts.empty() ? std::vector<int64_t>{shape[dim]} : d.fused_parts;
    for (auto part : parts) {
      if (part % (tp * d.unit) != 0) {
        std::string what = d.style == models::SplitStyle::Vocab ? "vocabulary" : "dimension";
        std::string msg = "cannot split '" + d.param + "' (" + style_name(d.style) + "-parallel) over " +
                          std::to_string(tp) + " ranks: its " + what + " of " + std::to_string(part) +
                          " is not a multiple of " + std::to_string(tp) + " x " + std::to_string(d.unit);
        if (d.unit > 1) msg += " (" + std::to_string(part / d.unit) + " heads of " + std::to_string(d.unit) + ")";
        if (d.style == models::SplitStyle::Vocab) {
          const int64_t padded = (part + tp * 64 - 1) / (tp * 64) * (tp * 64);
          msg += "; pad the vocabulary to a multiple (e.g. vocab_size: " + std::to_string(padded) + ")";
        }
        throw TpError(msg);
      }
    }
  }
}

std::vector<ParamShard> apply_tensor_parallel(models::CausalLM& model, dist::Runtime* rt, int world_size) {
  const int tp = rt ? rt->tp.size() : 1;
  const int tp_rank = rt ? rt->tp.rank : 0;
  check_tensor_parallel(model, tp);
  std::vector<int> all(world_size);
  for (int r = 0; r < world_size; ++r) all[r] = r;
  // Ranks at my tensor-parallel position hold the same pieces as I do.
  std::vector<int> same_pos = rt ? rt->dp.ranks : all;
  std::sort(same_pos.begin(), same_pos.end());

  std::map<std::string, models::ParamSplit> decl;
  if (tp > 1)
    for (const auto& d : model.split_declaration())
      if (d.style != models::SplitStyle::Replicate) decl[d.param] = d;
  auto modules = model.named_modules("", /*include_self=*/false);
  auto module_of = [&](const std::string& param) -> std::shared_ptr<torch::nn::Module> {
    const auto dot = param.rfind('.');
    const auto* m = modules.find(param.substr(0, dot));
    return m ? *m : nullptr;
  };
  const int64_t packed = pack(rt);

  std::vector<ParamShard> out;
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    const auto& name = item.key();
    auto& p = item.value();
    auto spec = checkpoint::ShardSpec::full(name, checkpoint::dtype_name(checkpoint::to_dtype(p.scalar_type())),
                                            p.sizes().vec());
    auto it = decl.find(name);
    if (it == decl.end()) {
      spec.replica_ranks = all;
      out.push_back({name, p, spec, tp > 1 ? 1.0 / tp : 1.0});
      continue;
    }
    const auto& d = it->second;
    const auto slice = slice_of(d, p, tp, tp_rank);
    p.set_data(take(p, slice));
    spec.offsets = slice.blocks[0].offsets;
    spec.shape = slice.blocks[0].shape;
    spec.more_blocks.assign(slice.blocks.begin() + 1, slice.blocks.end());
    spec.replica_ranks = same_pos;
    out.push_back({name, p, spec, 1.0});

    // The communicating forward for the layer owning this weight.
    const bool is_weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
    if (!is_weight) continue;
    auto mod = module_of(name);
    if (auto* lin = dynamic_cast<models::common::LinearImpl*>(mod.get())) {
      if (d.style == models::SplitStyle::Column) {
        lin->override_forward = [packed](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
          return torch::nn::functional::linear(CopyToTp::apply(x, packed), w, b);
        };
      } else if (d.style == models::SplitStyle::Row) {
        lin->override_forward = [packed](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
          auto y = ReduceFromTp::apply(torch::nn::functional::linear(x, w), packed);
          return b.defined() ? y + b : y;
        };
      }
    } else if (auto* emb = dynamic_cast<models::common::EmbeddingImpl*>(mod.get())) {
      const int64_t v0 = spec.offsets[0], vn = spec.shape[0];
      emb->override_forward = [packed, v0, vn](const at::Tensor& idx, const at::Tensor& w) {
        auto outside = (idx < v0) | (idx >= v0 + vn);
        auto local = (idx - v0).masked_fill(outside, 0);
        auto e = torch::embedding(w, local).masked_fill(outside.unsqueeze(-1), 0.0);
        return ReduceFromTp::apply(e, packed);
      };
    }
    // A vocabulary-split weight feeding the output head: vocab-parallel loss.
    if (d.style == models::SplitStyle::Vocab) {
      if (auto* head = model.output_head()) {
        const int64_t v0 = spec.offsets[0];
        const auto head_ptr = p.unsafeGetTensorImpl();
        head->override_loss = [packed, v0, head_ptr](const at::Tensor& hidden, const at::Tensor& w,
                                                     const at::Tensor& targets) {
          TORCH_CHECK(w.unsafeGetTensorImpl() == head_ptr, "vocab-parallel loss installed for another weight");
          auto h = CopyToTp::apply(hidden.reshape({-1, hidden.size(-1)}), packed);
          auto logits = torch::nn::functional::linear(h, w);
          return VocabParallelCrossEntropy::apply(logits, targets.reshape({-1}), v0, packed);
        };
        head->override_logits = [packed, head_ptr, rt](const at::Tensor& hidden, const at::Tensor& w) {
          auto local = torch::nn::functional::linear(CopyToTp::apply(hidden, packed), w).contiguous();
          auto gathered = torch::empty({rt->tp.size() * local.numel()}, local.options());
          rt->wait(rt->all_gather_async(rt->tp, gathered, local.reshape({-1}), "tensor-parallel logits all-gather"),
                   rt->tp, "tensor-parallel logits all-gather");
          auto chunks = gathered.view({rt->tp.size(), -1}).unbind(0);
          std::vector<at::Tensor> views;
          for (auto& c : chunks) views.push_back(c.view(local.sizes()));
          return torch::cat(views, -1);  // evaluation only: no gradient through the gather
        };
      }
    }
  }
  return out;
}

}  // namespace nnstrain::parallel
