// The setting every term reads (setting.h): bytes per element, this rank's
// flat buffers as the training state lays them out, the batch's shape.
#include "trainer/plan/cost/setting.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "trainer/optim/precision.h"
#include "trainer/state/training_state.h"

namespace nnstrain::parallel::cost {

PrecisionBytes precision_bytes(const config::TrainerArgs& a) {
  const auto p = optim::precision_setup(a.precision, a.compute_config.reduce_dtype);
  const auto b = state_bytes(p.param, p.grad, p.master_weights);
  return {b.param, b.grad, b.master, b.moments, b.param};
}

double update_bytes(const PrecisionBytes& pb) { return pb.master > 0 ? pb.master : pb.param; }

int reduce_group(const Candidate& c) { return c.dp * c.cp; }

StateLayout state_layout(const config::TrainerArgs& a, const ModelFacts& f, const Candidate& c,
                         const PrecisionBytes& pb, const std::vector<bool>& held) {
  StateLayout st;
  st.z = c.zero_stage ? std::max(1, reduce_group(c) / std::max(1, a.compute_config.zero_ngroups)) : 1;
  std::vector<int64_t> numels;
  std::vector<int> units;  // ZeRO-3: a bucket per unit, as the training state's
  std::vector<const ParamFact*> params;
  std::vector<bool> expert;
  std::map<int, double> frozen_units;  // ZeRO-3: a unit's frozen bytes (-1: outside the blocks)
  for (size_t i = 0; i < f.params.size(); ++i) {
    if (!held.empty() && !held[i]) continue;
    const auto& p = f.params[i];
    int64_t n = 1;
    for (auto dim : local_shape(p, c.tp, c.ep)) n *= dim;
    if (p.frozen()) {  // a buffer beside the training state (LoRA's base)
      st.frozen_elements += double(n);
      // ZeRO-3 without pp shards the compute-dtype base (not NF4 codes, not experts
      // under ep > 1) by unit in 16-byte pieces (ParameterUnits::shard_frozen).
      const bool sharded = c.zero_stage == 3 && c.pp == 1 && p.frozen_bytes == pb.param &&
                           !(p.split.style == models::SplitStyle::Expert && c.ep > 1);
      const double bytes = double(n) * p.frozen_bytes;
      if (sharded) frozen_units[p.unit] += std::ceil(bytes / 16) * 16;
      else st.frozen_bytes += bytes;
      continue;
    }
    numels.push_back(n);
    params.push_back(&p);
    if (c.zero_stage == 3) units.push_back(f.zero3_units[i]);
    st.elements += double(n);
    const bool is_expert = p.split.style == models::SplitStyle::Expert;
    expert.push_back(is_expert);
    if (is_expert) st.expert_elements += double(n);
  }
  if (!frozen_units.empty() && st.z < 2) {  // one rank: held whole
    for (const auto& [u, b] : frozen_units) st.frozen_bytes += b;
  } else {
    for (const auto& [u, b] : frozen_units) {
      const double whole = std::ceil(b / (16.0 * st.z)) * 16.0 * st.z;
      st.frozen_bytes += whole / st.z;  // this rank's chunk, kept
      if (u < 0) st.frozen_outer_gathered += whole;  // gathered through the step
      else st.frozen_block_gathered = std::max(st.frozen_block_gathered, whole);
    }
  }
  // At ep 1 experts are parameters like the rest (the trainer's rule: startup.cpp state_options).
  if (c.ep <= 1) expert.clear();
  st.ez = c.zero_stage ? std::max(1, st.z / std::max(1, c.ep)) : 1;
  bool blocks = false;
  for (const auto* p : params) blocks = blocks || p->unit >= 0;
  for (size_t i = 0; i < numels.size(); ++i)
    if (!blocks || params[i]->unit >= 0) st.largest_block_param = std::max(st.largest_block_param, double(numels[i]));
  std::map<int, double> per_block;
  for (size_t i = 0; i < numels.size(); ++i)
    if (params[i]->unit >= 0) per_block[params[i]->unit] += double(numels[i]);
  for (const auto& [u, n] : per_block) st.block_elements = std::max(st.block_elements, n);
  const int64_t cap = std::max<int64_t>(
      1, static_cast<int64_t>(a.compute_config.reducer_bucket_cap_mb * 1048576.0) / static_cast<int64_t>(pb.grad));
  // ZeRO-3: a bucket per unit, whatever the cap (TrainingState::layout_for).
  const auto layout =
      FlatLayout::make(numels, c.zero_stage == 3 ? std::numeric_limits<int64_t>::max() : cap, st.z, 0, units, expert, st.ez, 0);
  st.buckets = static_cast<int64_t>(layout.buckets.size());
  for (const auto& bk : layout.buckets) st.largest_bucket = std::max(st.largest_bucket, double(bk.end - bk.begin));
  st.padded = double(layout.size);
  for (const auto& bk : layout.buckets) {
    const double chunk = double(layout.chunk_size(bk));
    st.shard += chunk;
    if (bk.expert) st.expert_padded += double(bk.end - bk.begin), st.expert_shard += chunk;
  }
  if (c.ep <= 1) st.expert_padded = st.expert_shard = 0;  // no expert buckets: expert_elements only
  if (c.offload_ratio > 0) {  // TrainingState's rule: whole buckets in layout order until the ratio's share
    const double total = double(c.zero_stage ? layout.shard_size : layout.size);
    for (const auto& bk : layout.buckets) {
      if (st.host_elements >= c.offload_ratio * total) break;
      st.last_host_bucket = double(c.zero_stage ? layout.chunk_size(bk) : bk.end - bk.begin);
      st.host_elements += st.last_host_bucket;
    }
  }
  if (c.zero_stage == 3) {
    for (const auto& bk : layout.buckets) {
      const int u = units[bk.params.front()];
      const double n = double(bk.end - bk.begin);
      if (u == 0) st.embed_unit = n;
      else if (u == f.zero3_head_unit) st.head_unit = n;
      else st.largest_block = std::max(st.largest_block, n);
    }
  }
  return st;
}

Setting setting(const PlanRequest& req, const ModelFacts& f, const Candidate& c, const RankPart& part,
                const optim::StepCost* cost) {
  const auto& a = *req.args;
  const auto pb = precision_bytes(a);
  Setting x{req, a, f, c, pb, state_layout(a, f, c, pb, part.held)};
  x.t = c.tp;
  x.d = c.dp;
  // Rows per micro-batch: a preference micro-batch of P pairs runs 2P (chosen, rejected; trainer/align), P packed.
  x.b = double(a.micro_batch_size) * (a.alignment.enabled && !a.dataset.preference_train.pack ? 2 : 1);
  x.s = double(seq_len_of(a, f));
  x.h = double(f.dims.hidden);
  x.heads = double(f.dims.heads);
  x.kv = double(f.dims.kv_heads);
  x.ffn = double(f.dims.ffn);
  x.V = double(f.dims.vocab);
  x.L = double(f.layers);
  x.k = c.recompute_layers;
  x.micro_steps = std::max(1.0, std::floor(double(a.global_batch_size) / (double(a.micro_batch_size) * x.d)));
  x.cp = std::max(1, c.cp);
  x.tokens = x.b * x.s / x.cp;
  x.sp = c.tp > 1 && a.compute_config.sequence_parallel;
  x.rep = x.sp ? 1 / x.t : 1;
  x.v_local = (f.vocab_parallel_head && c.tp > 1) ? std::ceil(x.V / x.t) : x.V;
  x.attn_flops = std::max(0.0, f.flops_per_token(static_cast<int64_t>(x.s)) - f.flops_per_token(0)) /
                 std::max(1.0, x.L);
  if (f.experts > 0) {
    const auto& d = f.dims;
    x.moe_layers = double(d.moe_layers > 0 ? d.moe_layers : f.layers);
    x.moe = x.moe_layers / std::max(1.0, x.L);
    x.topk = double(std::max<int64_t>(1, d.experts_per_token));
    x.eff = double(d.expert_ffn);
    x.shf = double(d.shared_expert_ffn);
    x.E = double(f.experts);
    x.imb = c.ep > 1 ? moe_imbalance(req) : 1.0;
    x.expert_flops = 6 * x.moe_layers * x.topk * 3 * x.h * x.eff;
  }
  x.Lr = c.pp > 1 ? part.layers : x.L;
  x.kr = c.pp > 1 ? part.recomputed : x.k;
  x.live = part.live;
  x.first = part.first;
  x.last = part.last;
  x.sends = part.sends;
  x.w_live = part.w_live;
  x.split_layers = part.split_layers;
  x.ow = optimizer_work(cost ? *cost : optimizer_cost(req, f), f, c, part.held, x.st.z, x.st.ez);
  return x;
}

}  // namespace nnstrain::parallel::cost
