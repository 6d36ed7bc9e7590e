// The optimizer's step: what its registry entry says a step costs per
// parameter (optimizer_cost), laid over the candidate (optimizer_work: state
// per element, whole-matrix owners and their exchange), and its time on the
// device (optimizer_time_term).
#include <algorithm>
#include <functional>
#include <queue>
#include <string>
#include <utility>

#include "trainer/optim/registry.h"
#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel {

optim::StepCost optimizer_cost(const PlanRequest& req, const ModelFacts& f) {
  const auto& o = req.args->optimizer;
  const auto& entry = optim::optimizer_entry(o.type);
  std::vector<optim::CostParam> params;  // the trained ones (a frozen base weight has no optimizer state)
  for (const auto& p : f.params)
    if (!p.frozen()) params.push_back({p.name, p.shape, p.unit >= 0});
  auto cost = entry.cost ? entry.cost(o, params, req.device.name != "cpu") : optim::StepCost{};
  cost.state_tensors.resize(params.size(), 2);  // an entry without a cost hook: AdamW's shape
  cost.matrix_flops.resize(params.size(), 0.0);
  // Back to f.params' order, the frozen at zero.
  optim::StepCost all = cost;
  all.state_tensors.assign(f.params.size(), 0);
  all.matrix_flops.assign(f.params.size(), 0.0);
  for (size_t i = 0, k = 0; i < f.params.size(); ++i)
    if (!f.params[i].frozen()) all.state_tensors[i] = cost.state_tensors[k], all.matrix_flops[i] = cost.matrix_flops[k++];
  return all;
}

namespace cost {

OptimizerWork optimizer_work(const optim::StepCost& cost, const ModelFacts& f, const Candidate& c,
                             const std::vector<bool>& held, int z, int ez) {
  OptimizerWork w;
  w.bf16 = cost.bf16;
  const int dpcp = c.dp * std::max(1, c.cp);
  w.members = c.tp * dpcp;
  struct Matrix {
    double flops, numel, gather, scatter, workspace;
  };
  std::vector<Matrix> mats;
  double elements = 0, state = 0, matrix = 0;
  for (size_t i = 0; i < f.params.size(); ++i) {
    if ((!held.empty() && !held[i]) || f.params[i].frozen()) continue;
    const auto& p = f.params[i];
    double n = 1;
    for (auto d : local_shape(p, c.tp, c.ep)) n *= double(d);
    elements += n;
    state += n * cost.state_tensors[i];
    if (cost.matrix_flops[i] <= 0 || p.shape.size() < 2) continue;
    matrix += n;
    const auto style = p.split.style;
    const bool expert = style == models::SplitStyle::Expert && c.ep > 1;
    const double zs = c.zero_stage ? (expert ? ez : z) : 1;
    const bool split = c.tp > 1 && (style == models::SplitStyle::Column || style == models::SplitStyle::Row ||
                                    style == models::SplitStyle::Vocab);
    const double pieces = (split ? c.tp : 1) * zs;
    const double holders = expert ? double(c.tp) * dpcp / c.ep : double(w.members);
    const double q = holders / w.members, replicas = holders / pieces;
    w.piece += n / zs;
    const double rows = double(p.shape[p.shape.size() - 2]), cols = double(p.shape.back());
    const double numel = rows * cols, s = std::min(rows, cols), l = std::max(rows, cols);
    int64_t count = 1;
    for (size_t d = 0; d + 2 < p.shape.size(); ++d) count *= p.shape[d];
    const Matrix m{cost.matrix_flops[i], numel, numel * (1 - q / pieces), numel * (replicas - q / pieces),
                   2 * s * l + 2 * s * s};  // X and its successor, the gram and its polynomial
    mats.insert(mats.end(), static_cast<size_t>(count), m);
  }
  w.state_scale = elements > 0 ? state / elements / 2 : 1.0;
  w.matrix_share = elements > 0 ? matrix / elements : 0.0;
  w.matrices = static_cast<int64_t>(mats.size());
  w.scatter_recv = w.piece * (1 - 1.0 / w.members);
  if (mats.empty()) return w;
  std::stable_sort(mats.begin(), mats.end(), [](const Matrix& a, const Matrix& b) { return a.flops > b.flops; });
  // Least load first, then the lowest member: a min-heap on (load, member).
  using Slot = std::pair<double, int>;
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> least;
  for (int m = 0; m < w.members; ++m) least.push({0.0, m});
  std::vector<double> gather(w.members, 0.0), scatter(w.members, 0.0), owned(w.members, 0.0);
  double total_gather = 0;
  for (const auto& m : mats) {
    auto [load, o] = least.top();
    least.pop();
    least.push({load + m.flops, o});
    w.busiest_flops = std::max(w.busiest_flops, load + m.flops);
    gather[o] += m.gather, scatter[o] += m.scatter, owned[o] += m.numel;
    total_gather += m.gather;
    w.workspace = std::max(w.workspace, m.workspace);
  }
  w.gather_recv = *std::max_element(gather.begin(), gather.end());
  w.gather_mean = total_gather / w.members;
  w.scatter_send = *std::max_element(scatter.begin(), scatter.end());
  w.owned = *std::max_element(owned.begin(), owned.end());
  return w;
}

// The optimizer's step on the device. Element-wise: every element of this
// rank's device state (its ZeRO shard; the host's buckets are offload's) reads
// and writes its weight and its state tensors and reads its gradient, at the
// device's memory bandwidth; a whole-matrix optimizer also writes its piece
// into the exchange and reads its update back. Matrix work: the busiest
// owner's FLOPs at the exchange dtype's peak x kAssumedEfficiency (the stage
// waits for it: the scatter is a collective). Exchange: two all-to-alls over
// the stage, each the larger of what its busiest rank sends or receives,
// over the stage group's link (NVLink while it fits a node). Nothing of it
// overlaps: it runs between the gradients' reduction and the next forward.
void optimizer_time_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto& w = x.ow;
  const auto& pb = x.pb;
  const auto& dev = x.req.device;
  const double stepped = std::max(0.0, (x.c.zero_stage ? x.st.shard : x.st.elements) - x.st.host_elements);
  const double per_element =
      2 * update_bytes(pb) + pb.grad + 2 * pb.moments * w.state_scale + w.matrix_share * 2 * w.wire();
  e.optim_elementwise_s = dev.memory_bw > 0 ? stepped * per_element / dev.memory_bw : 0.0;
  if (w.matrices > 0) {
    const std::string precision = w.bf16 ? "bf16-mixed" : "32-true";
    e.optim_matrix_flops = w.busiest_flops;
    e.optim_matrix_s = w.busiest_flops / (peak_flops_for(dev, precision, x.a.compute_config.allow_tf32) * kAssumedEfficiency);
    if (w.members > 1) {
      // The stage's members: tp x cp consecutive ranks, then dp members tp x cp x pp apart.
      const double span = x.c.dp > 1 ? double(x.c.tp) * x.c.cp * x.c.pp * x.c.dp : double(x.c.tp) * x.c.cp;
      const double gather = std::max(w.gather_recv, w.gather_mean), scatter = std::max(w.scatter_send, w.scatter_recv);
      e.optim_gather_bytes = gather * w.wire();
      e.optim_scatter_bytes = scatter * w.wire();
      e.optim_exchange_s =
          2 * dev.collective_latency_s + (e.optim_gather_bytes + e.optim_scatter_bytes) / link_bw(dev, span);
    }
  }
  e.optim_step_s = e.optim_elementwise_s + e.optim_matrix_s + e.optim_exchange_s;
}

}  // namespace cost
}  // namespace nnstrain::parallel
