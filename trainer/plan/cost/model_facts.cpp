// The model as the cost model sees it: its dimensions, parameters and
// declared splits (model_facts), a parameter's piece on one rank
// (local_shape), and what tensor parallelism cannot split (tp_failures).
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "base/text.h"
#include "models/model.h"
#include "trainer/plan/cost_model.h"
#include "trainer/state/training_state.h"

namespace nnstrain::parallel {

namespace {

// The split dimension of a declared style (Row on a 1-D tensor: its only dim).
int split_dim(const ParamFact& p) {
  if (p.split.style == models::SplitStyle::Row && p.shape.size() >= 2) return 1;
  return 0;
}

}  // namespace

ModelFacts model_facts(const models::CausalLM& model) {
  ModelFacts f;
  f.dims = model.dims();
  f.layers = f.dims.layers > 0 ? f.dims.layers : model.num_layers();
  if (f.dims.hidden <= 0 || f.dims.heads <= 0 || f.dims.vocab <= 0)
    throw PlanError("the model declares no dimensions (CausalLM::dims: hidden, heads, vocab); the planner needs them");
  if (f.dims.kv_heads <= 0) f.dims.kv_heads = f.dims.heads;
  if (f.dims.ffn <= 0) f.dims.ffn = 4 * f.dims.hidden;
  std::map<std::string, models::ParamSplit> declared;
  for (const auto& s : model.split_declaration()) {
    declared[s.param] = s;
    if (s.style == models::SplitStyle::Vocab) f.vocab_parallel_head = true;
  }
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    ParamFact pf;
    pf.name = p.key();
    pf.shape = p.value().sizes().vec();
    pf.numel = p.value().numel();
    auto it = declared.find(pf.name);
    if (it != declared.end()) pf.split = it->second;
    else pf.split.param = pf.name;
    pf.unit = model.block_of(pf.name);
    if (pf.name.find("gate_proj") != std::string::npos) f.gated_mlp = true;
    f.params.push_back(std::move(pf));
  }
  f.zero3_units = parameter_units(model);
  f.zero3_head_unit = static_cast<int>(model.num_layers()) + 1;
  f.flops_per_token = [&model](int64_t seq) { return model.flops_per_token(seq); };  // facts live no longer than the model
  f.experts = f.dims.experts;
  for (const auto& p : f.params)
    if (f.experts == 0 && p.split.style == models::SplitStyle::Expert && !p.shape.empty()) f.experts = p.shape[0];
  return f;
}

ModelFacts model_facts(const PlanRequest& req) {
  auto f = model_facts(*req.model);
  if (req.adjust_facts) req.adjust_facts(f);
  return f;
}

const char* split_style_name(models::SplitStyle s) {
  switch (s) {
    case models::SplitStyle::Column: return "column";
    case models::SplitStyle::Row: return "row";
    case models::SplitStyle::Vocab: return "vocab";
    case models::SplitStyle::Expert: return "expert";
    default: return "replicate";
  }
}

std::vector<int64_t> local_shape(const ParamFact& p, int tp, int ep) {
  auto s = p.shape;
  if (p.split.style == models::SplitStyle::Expert && !s.empty()) {  // whole experts, the same on every tp rank
    s[0] = s[0] / std::max(1, ep);
    return s;
  }
  if (tp < 2 || p.split.style == models::SplitStyle::Replicate || s.empty()) return s;
  // The largest piece, rank 0's: each fused part is dealt out in whole units,
  // the first ranks one more (6 heads over 4: 2, 2, 1, 1); a padded vocabulary's
  // first ranks hold ceil(V / tp) rows (unit 1).
  auto& d = s[split_dim(p)];
  const int64_t unit = std::max<int64_t>(1, p.split.unit);
  const auto parts = p.split.fused_parts.empty() ? std::vector<int64_t>{d} : p.split.fused_parts;
  d = 0;
  for (auto part : parts) d += (part / unit + tp - 1) / tp * unit;
  return s;
}

// Why tp cannot split this model, one message per failure (empty: it can).
// Splits need not be even (6 heads over 4 ranks: 2, 2, 1, 1; models/common/sharding.h),
// so only what leaves a rank nothing is refused: fewer heads (or key/value heads,
// whose query groups travel with them) or ffn columns than ranks.
std::vector<std::string> tp_failures(const ModelFacts& f, int tp) {
  std::vector<std::string> out;
  if (tp < 1) return {"tp must be >= 1, got " + std::to_string(tp)};
  if (tp == 1) return out;
  const auto& d = f.dims;
  const std::string t = std::to_string(tp);
  auto check = [&](const char* what, int64_t n) {
    if (n < tp) out.push_back(std::string(what) + " " + std::to_string(n) + " are fewer than tp " + t);
  };
  check("attention heads", d.heads);
  if (d.kv_heads != d.heads) {
    check("key/value heads", d.kv_heads);
    if (d.heads % d.kv_heads != 0)
      out.push_back("attention heads " + std::to_string(d.heads) + " do not group over key/value heads " +
                    std::to_string(d.kv_heads));
  }
  check("ffn width", d.ffn);
  // A vocabulary tp does not divide is padded (model.make_vocab_size_divisible_by).
  if (!out.empty()) return out;
  // The declaration itself: every split dimension (or fused part) in whole units, at least one per rank.
  for (const auto& p : f.params) {
    if (p.split.style == models::SplitStyle::Replicate || p.split.style == models::SplitStyle::Vocab ||
        p.split.style == models::SplitStyle::Expert || p.shape.empty())
      continue;
    const int dim = split_dim(p);
    const int64_t unit = std::max<int64_t>(1, p.split.unit);
    std::vector<int64_t> parts = p.split.fused_parts;
    if (p.split.style != models::SplitStyle::Column || parts.empty()) parts = {p.shape[dim]};
    for (auto part : parts)
      if (part % unit != 0 || part / unit < tp) {
        out.push_back(p.name + " (" + split_style_name(p.split.style) + " split of dim " + std::to_string(dim) +
                      (parts.size() > 1 ? ", fused part of " : ", size ") + std::to_string(part) + ") " +
                      (part % unit ? "is not a whole number of units of " + std::to_string(unit)
                                   : "has " + std::to_string(part / unit) + " units of " + std::to_string(unit) +
                                         ", fewer than tp " + t));
        break;
      }
  }
  return out;
}

void check_tp_feasible(const models::CausalLM& model, int tp) {
  const auto f = model_facts(model);
  const auto fails = tp_failures(f, tp);
  if (!fails.empty()) throw PlanError("tensor parallel size " + std::to_string(tp) + " cannot split the model: " + util::join(fails, "; "));
}

int64_t seq_len_of(const config::TrainerArgs& a, const ModelFacts& f) {
  const int64_t s = a.dataset.train_args.seq_len;
  return s > 0 ? s : f.dims.max_seq;
}

}  // namespace nnstrain::parallel
