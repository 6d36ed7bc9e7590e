#include "trainer/plan/cost_model.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <optional>
#include <queue>
#include <tuple>

#include <unistd.h>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

#include "models/model.h"
#include "trainer/optim/precision.h"
#include "trainer/optim/registry.h"
#include "trainer/pipeline/schedule.h"
#include "trainer/pipeline/stages.h"
#include "trainer/state/training_state.h"

namespace nnstrain::parallel {

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The table. Memory as the driver reports it (GiB); dense peaks from the data
// sheets (SXM parts); bandwidth: NVLink per direction for ranks of one node,
// one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU between nodes.
const std::vector<DeviceSpec>& table() {
  static const std::vector<DeviceSpec> t = {
      // Host link: PCIe Gen5 x16 (H100/H200) or Gen4 (A100) as achieved by
      // pinned copies, about half the nominal; host AdamW: a server socket's
      // memory bandwidth shared by 8 ranks, a rough figure.
      // Device memory bandwidth: the data sheets' HBM figure.
      {"H100", 80 * kGiB, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6, 25e9, 10e9, 3.35e12},
      {"H200", 141e9, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6, 25e9, 10e9, 4.8e12},
      {"A100-80G", 80 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6, 12e9, 10e9, 2.039e12},
      {"A100-40G", 40 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6, 12e9, 10e9, 1.555e12},
      // A CPU rank: memory is filled in from the machine; the rates are a
      // rough server-socket figure, for relative choices only.
      {"cpu", 0, 1e12, 1e12, 1e12, 10e9, 1.25e9, 8, 100e-6, 10e9, 10e9, 10e9},
  };
  return t;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
}

DeviceSpec table_entry(const std::string& name) {
  for (const auto& d : table())
    if (lower(d.name) == lower(name)) {
      DeviceSpec s = d;
      if (s.name == "cpu") s.memory_bytes = physical_memory_bytes();
      return s;
    }
  throw PlanError("unknown device '" + name + "'; known: H100, H200, A100-80G, A100-40G, cpu, auto");
}

// The current CUDA device (the rank's own once bound) as a table entry: matched
// by name, memory as reported.
DeviceSpec cuda_device_spec() {
#ifdef NNSTRAIN_CUDA
  cudaDeviceProp prop{};
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
    const std::string name = prop.name;
    const double mem = double(prop.totalGlobalMem);
    DeviceSpec s = table_entry("H100");
    if (name.find("H200") != std::string::npos) s = table_entry("H200");
    else if (name.find("A100") != std::string::npos) s = table_entry(mem > 60 * kGiB ? "A100-80G" : "A100-40G");
    else if (name.find("H100") == std::string::npos) s.name = name + " (H100 rates assumed)";
    s.memory_bytes = mem;
    if (s.name.find(name) == std::string::npos) s.name += " (" + name + ")";
    return s;
  }
#endif
  DeviceSpec s = table_entry("H100");
  s.name = "cuda (name unknown to this build: H100 assumed)";
  return s;
}

// The split dimension of a declared style (Row on a 1-D tensor: its only dim).
int split_dim(const ParamFact& p) {
  if (p.split.style == models::SplitStyle::Row && p.shape.size() >= 2) return 1;
  return 0;
}

// Bytes per element: parameters (the copy compute reads), gradients (the
// reduction buffer), optimizer state (fp32 masters under *-mixed plus AdamW's
// two moments), activations. The first three are what TrainingState allocates
// (parallel::state_bytes, the same function the trainer's start-up line checks).
struct PrecisionBytes {
  double param, grad, master, moments, act;
};

PrecisionBytes precision_bytes(const config::TrainerArgs& a) {
  const auto p = optim::precision_setup(a.precision, a.compute_config.reduce_dtype);
  const auto b = state_bytes(p.param, p.grad, p.master_weights);
  return {b.param, b.grad, b.master, b.moments, b.param};
}

// The flat buffers of one rank, element counts, as TrainingState lays them out
// (FlatLayout: buckets in reverse registration order, each padded to a multiple
// of the ZeRO group) or, under ZeRO-3, as units (each block one unit, the
// parameters before the first block one, those after it one), each padded.
struct StateLayout {
  double elements = 0;  // this rank's parameter elements (after tp; the first tp rank, which holds most)
  double padded = 0;    // in the flat buffers, padding included
  double shard = 0;     // this rank's ZeRO chunks (padded: every bucket's chunk; no ZeRO: padded)
  int z = 1;            // ZeRO group size (1: no ZeRO)
  // Expert parallelism: the expert parameters' share of the above (their own
  // buckets, E / ep experts each, ZeRO-sharded over dp x cp / ep ranks).
  double expert_elements = 0, expert_padded = 0, expert_shard = 0;
  int ez = 1;
  int64_t buckets = 0;
  double largest_bucket = 0, largest_block_param = 0;  // a block's largest parameter (any, without blocks)
  double block_elements = 0;                            // the largest block's parameters
  double embed_unit = 0, head_unit = 0, largest_block = 0;  // ZeRO-3, padded
  // Offload: the optimizer elements on the host (whole buckets, as the
  // training state takes them) and the last of those buckets.
  double host_elements = 0, last_host_bucket = 0;
};

// The gradient-reduction (and ZeRO) group: parameters are replicated over
// cp, so their gradients are reduced over dp x cp.
int reduce_group(const Candidate& c) { return c.dp * c.cp; }

// `held` (empty: every parameter): the parameters of this rank's pipeline stages.
StateLayout state_layout(const config::TrainerArgs& a, const ModelFacts& f, const Candidate& c,
                         const PrecisionBytes& pb, const std::vector<bool>& held) {
  StateLayout st;
  st.z = c.zero_stage ? std::max(1, reduce_group(c) / std::max(1, a.compute_config.zero_ngroups)) : 1;
  std::vector<int64_t> numels;
  std::vector<int> units;  // ZeRO-3: a bucket per unit, as the training state's
  std::vector<const ParamFact*> params;
  std::vector<bool> expert;
  for (size_t i = 0; i < f.params.size(); ++i) {
    if (!held.empty() && !held[i]) continue;
    const auto& p = f.params[i];
    int64_t n = 1;
    for (auto dim : local_shape(p, c.tp, c.ep)) n *= dim;
    numels.push_back(n);
    params.push_back(&p);
    if (c.zero_stage == 3) units.push_back(f.zero3_units[i]);
    st.elements += double(n);
    const bool is_expert = p.split.style == models::SplitStyle::Expert;
    expert.push_back(is_expert);
    if (is_expert) st.expert_elements += double(n);
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

// The optimizer's step as the plan shapes it. OptimizerEntry::cost says what
// each parameter's state and matrix work are; this lays them over the
// candidate: this rank's share of state, and for a whole-matrix optimizer
// (Muon) the owners of the stage's matrices, dealt out as MatrixExchange does
// (largest FLOPs first, each to the least-loaded member, ties to the lowest),
// and what its gather and scatter move. The stage's members are its tp x cp x
// dp ranks (one pipeline index); a matrix's holders are all of them (experts
// under ep: the tp x dp x cp / ep ranks holding that expert), each holding one
// of P = tp (split dims) x Z (ZeRO's shards) pieces, on average; the owner is
// one of its holders with probability q = holders / members.
struct OptimizerWork {
  double state_scale = 1;   // this rank's state per element over AdamW's two moments (Muon's matrices: 1/2)
  double matrix_share = 0;  // of this rank's parameter elements, those in whole-matrix work
  bool bf16 = false;        // the matrix work and the exchange in bf16 (else fp32)
  int members = 1;          // the stage's ranks
  int64_t matrices = 0;     // the stage's
  // Elements: the busiest owner's gather (what it lacks of its matrices) and
  // the mean a member sends into it; the busiest owner's scatter (its
  // matrices' update pieces to every other holder) and what one rank receives
  // back (its own pieces, less those of matrices it owns).
  double gather_recv = 0, gather_mean = 0, scatter_send = 0, scatter_recv = 0;
  double piece = 0;          // elements of this rank's pieces of the matrices
  double busiest_flops = 0;  // the most matrix FLOPs one member owns
  double owned = 0;          // the most elements one member owns (gathered whole)
  double workspace = 0;      // elements of the largest matrix's Newton-Schulz temporaries
  double wire() const { return bf16 ? 2.0 : 4.0; }
};

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
    if (!held.empty() && !held[i]) continue;
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

// ---- the terms ----------------------------------------------------------------
// What every term reads: the request, the candidate and what follows from
// them once (bytes per element, this rank's flat buffers, the batch's shape).
struct Setting {
  const PlanRequest& req;
  const config::TrainerArgs& a;
  const ModelFacts& f;
  const Candidate& c;
  PrecisionBytes pb;
  StateLayout st;
  double t, d, b, s, h, heads, kv, ffn, V, L, k;
  double micro_steps;  // micro-batches per rank per step
  double tokens;       // of one micro-batch on this rank: b x s / cp
  bool sp;             // sequence parallelism
  double rep;          // what tensor parallelism leaves whole is 1/tp of the sequence under SP
  double v_local;      // this rank's rows of the LM head
  double cp;           // context-parallel ranks
  double attn_flops;   // attention's FLOPs per token per layer (forward + backward), over the whole sequence
  // What this rank holds of the layers (under pp: its stages'): Lr layers, kr
  // of them recomputed, activations of `live` micro-batches at once, the
  // embedding (first) and the head (last).
  double Lr, kr, live = 1;
  bool first = true, last = true;
  double sends = 0;  // pipeline: boundary tensors held (sent ones until retired, received ones until used)
  double w_live = 0;  // pipeline: (stage, micro-batch)s between their I and W, as `live` counts them
  double split_layers = 0;  // pipeline, split backward: the layers of the rank's largest stage (0: no split)
  // Mixture-of-Experts (moe 0: dense): the share of layers that are MoE; per
  // MoE layer each token's topk assignments to experts of width eff (SwiGLU),
  // shared experts of total width shf, E routed experts; imb: the busiest
  // expert-parallel rank's tokens over the mean (1 at ep 1: every rank runs
  // every expert on its own tokens).
  double moe = 0, moe_layers = 0, topk = 0, eff = 0, shf = 0, E = 0, imb = 1;
  // The routed experts' training FLOPs per token over all MoE layers.
  double expert_flops = 0;
  OptimizerWork ow;  // the optimizer's state and step on this rank's parameters
};

// The rank's part of the model under pp; the whole model otherwise.
struct RankPart {
  std::vector<bool> held;  // per parameter (empty: all)
  double layers = 0, recomputed = 0, live = 1, sends = 0, w_live = 0, split_layers = 0;
  bool first = true, last = true;
};

// cost: the optimizer's (optimizer_cost), when the caller has it already.
Setting setting(const PlanRequest& req, const ModelFacts& f, const Candidate& c, const RankPart& part,
                const optim::StepCost* cost = nullptr) {
  const auto& a = *req.args;
  const auto pb = precision_bytes(a);
  Setting x{req, a, f, c, pb, state_layout(a, f, c, pb, part.held)};
  x.t = c.tp;
  x.d = c.dp;
  x.b = double(a.micro_batch_size);
  x.s = double(seq_len_of(a, f));
  x.h = double(f.dims.hidden);
  x.heads = double(f.dims.heads);
  x.kv = double(f.dims.kv_heads);
  x.ffn = double(f.dims.ffn);
  x.V = double(f.dims.vocab);
  x.L = double(f.layers);
  x.k = c.recompute_layers;
  x.micro_steps = std::max(1.0, std::floor(double(a.global_batch_size) / (x.b * x.d)));
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

// ZeRO: parameters, gradients and optimizer state each rank keeps between
// steps (flat elements, padding included; Sz this rank's shard).
// Expert parameters' buckets shard over their own (smaller) group, so Sz is
// the sum of every bucket's chunk; expert_bytes is their part.
void state_term(const Setting& x, PlanEstimate& e) {
  const auto& pb = x.pb;
  const double moments = pb.moments * x.ow.state_scale;  // the optimizer's state (AdamW's two moments)
  auto part = [&](double S, double Sz, double& param, double& grad, double& optim) {
    switch (x.c.zero_stage) {
      case 0:
        param = S * pb.param, grad = S * pb.grad, optim = S * (pb.master + moments);
        break;
      case 1:  // the full gradient buffer stays, plus the reduced chunk
        param = S * pb.param, grad = S * pb.grad + Sz * pb.grad, optim = Sz * (pb.master + moments);
        break;
      case 2:  // no full gradient buffer outlives backward
        param = S * pb.param, grad = Sz * pb.grad, optim = Sz * (pb.master + moments);
        break;
      default:  // 3: parameters sharded too, units gathered around their use
        param = Sz * pb.param, grad = Sz * pb.grad, optim = Sz * (pb.master + moments);
    }
  };
  part(x.st.padded, x.st.shard, e.param_bytes, e.grad_bytes, e.optim_bytes);
  double p = 0, g = 0, o = 0;
  if (x.c.ep > 1) part(x.st.expert_padded, x.st.expert_shard, p, g, o);
  else part(x.st.expert_elements, x.st.expert_elements / x.st.z, p, g, o);  // in the common buckets
  e.expert_bytes = p + g + o;
}

// What the optimizer updates, bytes per element: fp32 masters, else the parameters.
double update_bytes(const PrecisionBytes& pb) { return pb.master > 0 ? pb.master : pb.param; }

// Offload: the host's share of the optimizer state (st.host_elements, whole
// buckets) leaves the device; the host keeps its weights (fp32 masters, or
// a copy of the parameters), moments, a copy of its reduced gradient and a
// compute-dtype staging copy. Parameter offload moves ZeRO-3's chunks there too.
void offload_memory_term(const Setting& x, PlanEstimate& e) {
  const auto& pb = x.pb;
  const double H = x.st.host_elements;
  // The host's moments are the optimizer's state there: one slot for Muon's matrices (state_scale).
  e.optim_bytes -= H * (pb.master + pb.moments * x.ow.state_scale);
  e.host_bytes = H * (update_bytes(pb) + pb.moments * x.ow.state_scale + pb.grad + pb.param);
  if (x.c.offload_params) {
    e.host_bytes += e.param_bytes;
    e.param_bytes = 0;
  }
  // The NVMe tier: the weights, moments (and ZeRO-3's chunks) in files; the
  // host keeps the gradient copy and the bounded buffer the files stream through.
  if (x.c.offload_nvme) {
    e.nvme_bytes = e.host_bytes - H * (pb.grad + pb.param);
    e.host_bytes = H * pb.grad + x.a.compute_config.offload.nvme_buffer_mb * 1048576.0;
  }
}

// Activations of one micro-batch (micro-batches run one after another), in
// the compute dtype, counted as our models keep them for backward
// (models/gpt, models/llama; fused attention keeps q, k, v, its output and a
// per-row logsumexp, never the scores). Tensor and sequence parallelism
// divide them, recompute keeps only the first k layers' inputs.
struct Activations {
  double layer_full = 0;      // one layer's kept activations
  double layer_input = 0;     // a recomputed layer's input
  double scores = 0;          // unfused attention's scores and softmax, per layer
  double saved_layers = 0;    // every layer's, as recompute leaves them
  double head_saved = 0;      // around the final norm and the head
  double loss_peak = 0;       // the loss's own peak (loss_term)
  double block_grads = 0;     // one block's backward on top of the kept activations
  double tied_head_grad = 0;  // a tied embedding's head gradient waiting in autograd
  double sent = 0;            // pipeline: the boundary tensors held (Setting::sends)
  double sent_per_tensor = 0;  // one of them: a micro-batch's hidden states on this rank
  double pending_w = 0;       // pipeline: what the (stage, micro-batch)s between I and W keep
  double layer_w = 0;         // pipeline, split backward: what one layer's W needs of one micro-batch
};

// The loss: vocab-split logits under tp. Plain: fp32 logits/softmax kept for
// backward, and at backward's start its gradient and the incoming one, three
// [tokens, V] fp32 tensors. Chunked: per-token logsumexp kept; backward holds
// the hidden gradient, an fp32 weight gradient and a chunk's logits twice.
// Fused: from its last chunk into backward, the fp32 gradients of hidden and
// weight; during the last chunk also its fp32 logits (softmax and gradient in
// place), their compute-dtype copy, and (16-bit compute) the compute-dtype
// weight and its chunk's weight gradient; in backward, the gradients cast to
// the inputs' 16-bit dtype.
double loss_term(const Setting& x, bool fp32_compute) {
  const double ea = x.pb.act, tokens = x.tokens, h = x.h, v_local = x.v_local;
  const auto loss = config::resolved_loss(x.a.model, int64_t(tokens));
  if (loss == "fused") {
    const double chunk = std::min(double(std::max(1, x.a.model.loss_chunk_size)), tokens);
    const double half = fp32_compute ? 0 : ea;
    return (tokens + v_local) * h * 4 +
           std::max(chunk * v_local * (4 + half) + 2 * v_local * h * half, (tokens + v_local) * h * half);
  }
  if (loss == "chunked") {
    const double chunk = std::min(double(std::max(1, x.a.model.loss_chunk_size)), tokens);
    return tokens * 4 + tokens * h * ea + v_local * h * (4 + (fp32_compute ? 0 : ea)) +
           chunk * v_local * (2 * 4 + (fp32_compute ? 0 : ea));
  }
  // Then the head's backward: the logits' gradient, the hidden states' and the weight's.
  // (The vocab-parallel forward holds the compute-dtype logits beside its
  // three fp32 tensors; the one-rank loss has freed them by then.)
  const bool vocab_split = x.f.vocab_parallel_head && x.c.tp > 1;
  return std::max(tokens * v_local * (3 * 4 + (fp32_compute || !vocab_split ? 0 : ea)),
                  tokens * v_local * 4 + tokens * h * ea + v_local * h * ea);
}

// Context parallelism, one layer of one micro-batch: K and V (this rank's
// s / cp tokens, its key/value heads) travel round the ring (p2p: cp - 1 steps,
// each transfer hidden behind the block computing meanwhile, exposed only
// beyond it; backward sends the K/V with their fp32 gradients) or are gathered
// once (all_gather: the whole sequence's K/V, gathered in forward and again in
// backward, the gradients reduce-scattered, exposed in full). The bytes in
// flight are what the ring holds beside the layer's activations.
struct CpLayer {
  double forward_s = 0, backward_s = 0;  // exposed, with the contention below
  double forward_contention_s = 0, backward_contention_s = 0;  // the blocks slowed by the transfers they hide
  double kv_backward = 0;                // bytes in flight during a layer's backward
};

CpLayer cp_layer(const Setting& x) {
  CpLayer r;
  if (x.cp <= 1) return r;
  const auto& dev = x.req.device;
  const double bw = x.t * x.cp <= std::max(1, dev.ranks_per_node) ? dev.intra_node_bw : dev.inter_node_bw;
  const double alpha = dev.collective_latency_s;
  const double kv_heads_local = std::ceil(x.kv / x.t), head_dim = x.h / x.heads;
  const double kv = x.tokens * 2 * kv_heads_local * head_dim * x.pb.act;  // this rank's K and V
  const double dkv = kv / x.pb.act * 4;                                    // their fp32 gradients
  const double peak =
      peak_flops_for(dev, x.a.precision, x.a.compute_config.allow_tf32) * kAssumedEfficiency;
  // This rank's queries against the sequence, causal: half the blocks' pairs are masked.
  const double attn_forward = x.tokens * 0.5 * x.attn_flops / 3 / x.t / peak;
  if (x.c.cp_comm == "all_gather") {
    const double gather = alpha + (x.cp - 1) / x.cp * x.cp * kv / bw;
    r.forward_s = gather;
    r.backward_s = gather + alpha + (x.cp - 1) / x.cp * x.cp * dkv / bw;
    r.kv_backward = x.cp * (kv + dkv);
  } else {
    const double block = attn_forward / x.cp, steps = x.cp - 1;
    const double send_f = alpha + kv / bw, send_b = alpha + (kv + dkv) / bw;
    r.forward_contention_s = steps * kOverlapContention * std::min(send_f, block);
    r.backward_contention_s = steps * kOverlapContention * std::min(send_b, 2 * block);
    r.forward_s = steps * std::max(0.0, send_f - block) + r.forward_contention_s;
    r.backward_s = steps * std::max(0.0, send_b - 2 * block) + r.backward_contention_s;
    r.kv_backward = 2 * (kv + dkv);  // the block computing and the next one arriving
  }
  return r;
}

// The zero-bubble split (models/common/weight_grad.h): from a micro-batch's I
// until its W, every deferred linear of the rank's layers keeps its input X
// and output gradient dY in the compute dtype, a whole layer's worth per
// `live` unit (X shared by q/k/v or gate/up once; a sequence-parallel column
// linear keeps its local slice and gathers it again in W; a row-parallel
// linear's dY is whole); the plain LM head keeps its input and the logits'
// gradient. Per (stage, micro-batch) of `Lr` layers: divide as `live` does.
double layer_w_bytes(const Setting& x) {  // one layer, one micro-batch
  const double h = x.h, t = x.t, rep = x.rep, hkv = h * x.kv / x.heads, ffn = x.ffn;
  const double mlp_out = x.f.gated_mlp ? 2 * ffn : ffn;  // gate and up, or c_fc
  const double inputs = h * rep + h / t + h * rep + ffn / t;      // attention's, its out projection's, the MLP's, its down's
  const double grads = (h + 2 * hkv) / t + h + mlp_out / t + h;  // q/k/v, out, MLP up, MLP down
  return x.tokens * (inputs + grads) * x.pb.act;
}
double pending_w_bytes(const Setting& x) {
  double bytes = x.Lr * layer_w_bytes(x);
  if (x.last && config::resolved_loss(x.a.model, int64_t(x.tokens)) == "plain")
    bytes += x.tokens * (x.h * x.rep + x.v_local) * x.pb.act;
  return bytes;
}

Activations activation_term(const Setting& x) {
  const double ea = x.pb.act, tokens = x.tokens, h = x.h, t = x.t, rep = x.rep;
  const double hkv = h * x.kv / x.heads, ffn = x.ffn;
  const bool fp32_compute = ea >= 4;
  double layer_rep, layer_split, head_in, norm_extra, wide_grads;
  if (x.f.gated_mlp) {
    // Llama: each RMSNorm keeps its input in fp32 (the input itself at fp32,
    // else an fp32 copy, and then not the input), its normalised input and
    // (through the next linear) its output, twice per layer; attention keeps
    // rotated q, k, v (key/value heads repeated except under CUDA's native
    // GQA) and the output; SwiGLU keeps gate, silu(gate), up and their product.
    const bool native_gqa = !fp32_compute && x.req.device.name != "cpu";
    const double norm_in = fp32_compute ? h : h * 4 / ea;
    layer_rep = 2 * (norm_in + 2 * h);
    layer_split = (native_gqa ? 2 * h + 2 * hkv : 4 * h) + 4 * ffn;
    head_in = norm_in;
    norm_extra = h;        // the final norm's normalised input
    wide_grads = 2 * ffn;  // backward of gate * up: both gradients and the incoming one (the product freed)
  } else {
    // GPT: the block input (kept by ln_1), ln_1's output, the residual sum
    // and ln_2's output; q, k, v, attention output; the MLP's c_fc output and
    // its GELU.
    layer_rep = 4 * h;
    layer_split = 2 * h + 2 * hkv + 2 * ffn;
    head_in = h;
    norm_extra = 0;
    wide_grads = ffn;  // the GELU output's gradient while the output is still kept
  }
  if (x.moe > 0) {
    // An MoE layer keeps, in place of the dense MLP: the router's logits and
    // probabilities (fp32), its tokens' k rows sorted by expert, under ep the
    // rows received (imb x) and the rows returned, the experts' SwiGLU
    // (gate, silu(gate), up, product) per assignment, the shared experts'
    // (split over tp). Experts are whole on each tp rank: their rows are not
    // divided by tp (1/tp of the tokens under SP). Averaged over the layers.
    const double a2a_rows = x.c.ep > 1 ? x.imb * x.topk * h : 0.0;
    const double moe_rep = 2 * x.E * 4 / ea + 2 * x.topk * h + a2a_rows + x.imb * x.topk * 4 * x.eff;
    layer_rep += x.moe * moe_rep;
    layer_split += x.moe * (4 * x.shf - (x.f.gated_mlp ? 4 : 2) * ffn);
    wide_grads = std::max({x.moe < 1 ? wide_grads : 0.0, 2 * x.shf, 2 * x.imb * x.topk * x.eff * t * rep});
  }
  Activations act;
  act.layer_full = tokens * (layer_rep * rep + layer_split / t) * ea;
  act.layer_input = tokens * h * rep * ea;
  act.scores = x.req.fused_attention ? 0.0 : tokens * 2 * (x.heads / t) * x.s * ea;
  // Under pp the rank's stages' layers, for every micro-batch in flight.
  act.saved_layers = x.live * ((x.Lr - x.kr) * (act.layer_full + act.scores) + x.kr * act.layer_input);
  act.pending_w = x.w_live > 0 ? x.w_live * pending_w_bytes(x) : 0.0;
  act.layer_w = x.split_layers > 0 ? layer_w_bytes(x) : 0.0;
  act.saved_layers += act.pending_w;
  // The last block's output (what the final norm keeps of its input) and of
  // the norm, and its output; under SP the head gathers that output whole and keeps it.
  act.head_saved = x.last ? x.live * tokens * ((head_in + norm_extra) * rep + (x.sp ? h : h * rep)) * ea : 0.0;
  act.loss_peak = x.last ? loss_term(x, fp32_compute) : 0.0;
  // One block's backward: the gradient coming in, the widest gradients (the
  // MLP's), under SP the gathered gradient of the row-parallel output, and
  // autograd's gradient of the block's largest parameter before it is added
  // into its slot (its bucket under ZeRO-2, its unit under ZeRO-3).
  act.block_grads = tokens * (h * rep + (x.sp ? h : 0) + wide_grads / t) * ea + x.st.largest_block_param * x.pb.param +
                    cp_layer(x).kv_backward;
  // A tied embedding's gradient from the head waits in autograd until the
  // embedding's own part is added at the end of backward.
  act.tied_head_grad = x.f.dims.tied_embeddings && x.first && x.last ? x.v_local * h * x.pb.param : 0.0;
  // The pipeline's executor keeps a tensor it sends until a wait completes its
  // group (pipeline::retired_sends), and a received one from its group's post
  // until it is used: each one micro-batch's hidden states.
  act.sent_per_tensor = tokens * h * rep * ea;
  act.sent = x.sends * act.sent_per_tensor;
  return act;
}

// The step's peak: the largest of the moments backward passes through, each
// the activations still kept plus what the sharding holds only for a while.
// ZeRO-3's outer units (embedding, head) are gathered for the whole forward
// and backward. During the blocks' backward ZeRO-2/3 fill gradient buckets
// (ZeRO-3: one per unit) in layout order and launch each one's reduce-scatter
// when it is full, at most kBucketsInFlight = 2 at once (grad_reducer.h), each
// with its output chunk (bucket / N) and, over Gloo (CPU), the copy of its
// input Gloo reduces; one more bucket fills meanwhile; ZeRO-3 also holds the
// current block's unit and zero_prefetch more. By the time j buckets are
// launched, about j x (bucket / block) blocks have finished their backward and
// freed their activations, so each j is a moment of its own. Under pipeline
// parallelism ZeRO-3 gathers every unit of the rank's stages once per step and
// frees it after the step's last backward: the whole gathered parameters live
// through every phase (pipeline_runtime.h).
void peak_term(const Setting& x, const Activations& act, PlanEstimate& e) {
  const auto& st = x.st;
  const auto& pb = x.pb;
  const double L = x.Lr, k = x.kr;
  const bool z2 = x.c.zero_stage == 2, z3 = x.c.zero_stage == 3;  // at one rank too: the same buffers
  const bool z3_per_step = z3 && x.c.pp > 1;
  const double outer_units = z3_per_step ? st.padded * pb.param : z3 ? (st.embed_unit + st.head_unit) * pb.param : 0.0;
  struct Phase {
    double acts, transient;
  };
  std::vector<Phase> phases{{act.saved_layers + act.head_saved + act.loss_peak, outer_units}};  // backward starts at the loss
  double worst_block_transient = outer_units;
  const double per_layer = act.layer_full + act.scores;
  if (z2 || z3) {
    constexpr int kBucketsInFlight = 2;
    const double bucket = z3 ? st.largest_block : st.largest_bucket;  // elements, padded
    const double gloo_copy = x.req.device.name == "cpu" ? 1.0 : 0.0;
    const double per_flight = bucket * pb.grad * (1 + gloo_copy) + bucket / st.z * pb.grad;
    // Gathered: the block computing, zero_prefetch ahead, and (measured) one
    // more: the unit just done is freed only when its bucket launches.
    // Under parameter offload the gather in flight also reads a device copy of
    // its host chunk, freed once the gather is waited for.
    const double gathered = z3_per_step ? outer_units
                            : z3 ? outer_units + (2 + x.a.compute_config.zero_prefetch) * st.largest_block * pb.param +
                                       (x.c.offload_params ? st.largest_block / st.z * pb.param : 0.0)
                                 : 0.0;
    const double blocks_per_bucket = st.block_elements > 0 ? bucket / st.block_elements : double(L);
    const int flights = static_cast<int>(std::min<double>(kBucketsInFlight, std::max<double>(0, double(st.buckets) - 1)));
    for (int j = 0; j <= flights && L - k >= 1; ++j) {
      const double done = std::min(L - k, std::floor(j * blocks_per_bucket));
      const double trans = gathered + bucket * pb.grad + j * per_flight;
      phases.push_back({act.saved_layers - done * per_layer + act.block_grads + act.tied_head_grad, trans});
      worst_block_transient = std::max(worst_block_transient, trans);
    }
    if (L - k < 1) worst_block_transient = gathered + bucket * pb.grad + flights * per_flight;
  } else if (L - k >= 1) {
    phases.push_back({act.saved_layers + act.block_grads + act.tied_head_grad, 0.0});  // the last block's backward
  }
  // Every block recomputes: the last one rebuilt whole, its output held, then
  // its backward. Under a split backward the pairs waiting for W keep theirs,
  // the one in its I all but the block being rebuilt (the peak moment counts
  // it as waiting already).
  if (k >= 1 && k >= L)
    phases.push_back({x.live * k * act.layer_input + std::max(0.0, act.pending_w - act.layer_w) + act.layer_full -
                          act.layer_input +
                          x.tokens * x.h * x.rep * x.pb.act + act.block_grads + act.scores + act.tied_head_grad,
                      worst_block_transient});
  // A recomputed block's forward (nothing kept but its input) while a split
  // backward's W's are pending, as zero-bubble schedules run forwards: every
  // pair's holdings whole, and the block's widest moment, its MLP's
  // up-projection output and activation (SwiGLU: gate, up, silu(gate));
  // measured for GPT by bench/bench_pipeline_sends.py.
  if (k >= 1 && act.pending_w > 0)
    phases.push_back({act.saved_layers + act.head_saved +
                          x.tokens * ((x.f.gated_mlp ? 3 : 2) * x.ffn / x.t + x.h * x.rep) * x.pb.act,
                      outer_units});
  // The optimizer's step, after backward (activations freed): a whole-matrix
  // optimizer's exchange buffers (this rank's pieces out, its update pieces
  // back, the matrices it owns gathered) and the Newton-Schulz temporaries of
  // the largest matrix, in the exchange's dtype. AdamW's fused step has none.
  const auto& ow = x.ow;
  if (ow.matrices > 0)
    phases.push_back({0.0, (ow.owned + 2 * ow.piece + ow.workspace) * ow.wire()});
  for (auto& ph : phases) ph.acts += act.sent;  // held through every phase
  const auto peak_phase = *std::max_element(phases.begin(), phases.end(), [](const Phase& p, const Phase& q) {
    return p.acts + p.transient < q.acts + q.transient;
  });
  e.activation_bytes = peak_phase.acts;
  e.transient_bytes = peak_phase.transient;
  e.total_bytes = e.param_bytes + e.grad_bytes + e.optim_bytes + e.activation_bytes + e.transient_bytes;
}

// The FLOPs a training step runs per token: the model's count, whose
// attention term covers the whole s x s score matrix, less the masked half a
// causal kernel (flash, memory-efficient) skips.
// Routed experts run whole on every tensor-parallel rank, on all of its tokens
// (1/tp of them under SP), and the busiest expert-parallel rank runs imb x the
// mean: their FLOPs are scaled so that the terms' division by tp comes out so.
double work_per_token(const Setting& x) {
  return x.f.flops_per_token(static_cast<int64_t>(x.s)) - 0.5 * x.attn_flops * x.L +
         x.expert_flops * (x.t * x.rep * x.imb - 1);
}

// Compute: the training FLOPs per token (work_per_token), one more forward per
// recomputed layer, divided over tp, at kAssumedEfficiency of the peak.
struct Compute {
  double flops_token = 0, recompute_flops = 0;
};

Compute compute_term(const Setting& x, PlanEstimate& e) {
  const double peak =
      peak_flops_for(x.req.device, x.a.precision, x.a.compute_config.allow_tf32) * kAssumedEfficiency;
  Compute cm;
  cm.flops_token = work_per_token(x);
  const double layer_flops = std::max(0.0, cm.flops_token - 6 * x.V * x.h) / std::max(1.0, x.L);
  cm.recompute_flops = x.k * layer_flops / 3;  // one more forward (1/3 of fwd+bwd) per recomputed layer
  const double tokens_rank = x.micro_steps * x.tokens;  // cp ranks share a sequence's tokens
  e.compute_s = tokens_rank * (cm.flops_token + cm.recompute_flops) / x.t / peak;
  return cm;
}

// Expert parallelism, one MoE layer of one micro-batch (AllToAll). Each
// all-to-all: the busiest rank receives imb x the mean, from each other member
// of its ep group 1/ep of its tokens' k rows of h; rows from the members on
// its node over NVLink, the others' over its NIC, at once. The ep group: ep
// consecutive members of dp x cp (cp innermost), so it spans nodes once
// ep x tp x cp (with pp between dp members) outgrows a node. Not overlapped:
// the dispatcher waits for each before the experts (or attention) go on.
AllToAll a2a_layer(const Setting& x) {
  AllToAll r;
  if (x.c.ep <= 1 || x.moe <= 0) return r;
  const auto& dev = x.req.device;
  const int ep = x.c.ep, cp = std::max(1, x.c.cp), per_node = std::max(1, dev.ranks_per_node);
  auto member = [&](int e) { return int64_t(x.c.tp) * ((e % cp) + int64_t(cp) * x.c.pp * (e / cp)); };
  int on_node = 0;  // members of rank 0's group on rank 0's node
  for (int e = 0; e < ep; ++e) on_node += member(e) < per_node;
  r.cross_node = on_node < ep;
  const double rows = x.imb * x.tokens * x.rep * x.topk * x.h * x.pb.act;  // all it receives, itself included
  r.bytes = rows * (ep - 1) / ep;
  const double alpha = dev.collective_latency_s;
  const double one = alpha + std::max(rows * (on_node - 1) / ep / dev.intra_node_bw,
                                      rows * (ep - on_node) / ep / dev.inter_node_bw);
  r.forward_s = alpha + 2 * one;  // the counts exchange (a few bytes: its latency), dispatch, combine
  r.backward_s = 2 * one;
  return r;
}

// Every MoE layer's all-to-alls per micro-batch, once more in forward for
// each recomputed MoE layer (the first k layers hold k x moe of them).
void ep_comm_term(const Setting& x, PlanEstimate& e) {
  const auto r = a2a_layer(x);
  e.a2a_layer_s = r.forward_s + r.backward_s;
  e.a2a_cross_node = r.cross_node;
  e.moe_imbalance = x.moe > 0 ? moe_imbalance(x.req) : 0.0;  // the allowance (applied at ep > 1)
  e.ep_comm_s = x.micro_steps * (x.moe_layers * e.a2a_layer_s + x.k * x.moe * r.forward_s);
}

// Context parallelism: every layer's ring (or gather) per micro-batch, once
// more in forward for each recomputed layer.
void cp_comm_term(const Setting& x, PlanEstimate& e) {
  const auto r = cp_layer(x);
  e.cp_comm_s = x.micro_steps * (x.L * (r.forward_s + r.backward_s) + x.k * r.forward_s);
  e.contention_s += x.micro_steps * (x.L * (r.forward_contention_s + r.backward_contention_s) +
                                     x.k * r.forward_contention_s);
}

// The link a collective over `span` consecutive ranks uses: NVLink while they
// share a node.
double link_bw(const DeviceSpec& dev, double span) {
  return span <= std::max(1, dev.ranks_per_node) ? dev.intra_node_bw : dev.inter_node_bw;
}

// Tensor parallelism, per micro-batch: 4 all-reduces per layer (2 forward, 2
// backward), 2 more per recomputed layer, 2 for the vocab-parallel embedding
// and head; ring cost.
void tp_comm_term(const Setting& x, PlanEstimate& e) {
  if (x.c.tp <= 1) return;
  const auto& dev = x.req.device;
  const int per_node = std::max(1, dev.ranks_per_node);
  const double bw = x.c.tp <= per_node ? dev.intra_node_bw : dev.inter_node_bw;
  const double n = 4 * x.L + 2 * x.k + (x.f.vocab_parallel_head ? 2 : 0);
  e.tp_comm_s = x.micro_steps * n *
                (dev.collective_latency_s + 2 * (x.t - 1) / x.t * (x.tokens * x.h * x.pb.act) / bw);
  // Sequence parallelism with MoE layers: each tp rank ran its own tokens through the
  // same (whole) experts, so their gradients are all-reduced over tp in every
  // micro-batch's backward (as the norms' are; the norms' bytes are negligible).
  if (x.sp && x.moe > 0)
    e.tp_comm_s += x.micro_steps * (x.moe_layers * dev.collective_latency_s +
                                    2 * (x.t - 1) / x.t * x.st.expert_elements * x.pb.grad / bw);
}

// Data parallelism and ZeRO: what of the gradient reduction (and ZeRO's
// gathers) the backward does not hide.
void dp_comm_term(const Setting& x, const Compute& cm, PlanEstimate& e) {
  const double d = reduce_group(x.c);  // parameters are replicated over cp: reduced over dp x cp
  if (d <= 1) return;
  const auto& dev = x.req.device;
  // The dp group (ranks r, r + tp cp pp, ...) leaves the node once the world does.
  const double bw = link_bw(dev, double(x.c.tp) * x.c.cp * x.c.pp * x.c.dp);
  const double p_local = x.st.elements, z = x.st.z, micro_steps = x.micro_steps;
  const double grad_bytes = p_local * x.pb.grad;
  const double alpha = dev.collective_latency_s;
  const double cap = x.a.compute_config.reducer_bucket_cap_mb * 1024 * 1024;
  const double buckets = double(x.st.buckets);
  const double backward = e.compute_s / micro_steps * (2 * cm.flops_token / 3 + cm.recompute_flops) /
                          (cm.flops_token + cm.recompute_flops);
  const double forward = e.compute_s / micro_steps - backward;
  const double groups = d / z;
  // The reduced chunk's all-reduce across ZeRO groups (hybrid sharding).
  const double cross = groups > 1 ? 2 * (groups - 1) / groups * grad_bytes / z / bw : 0.0;
  if (x.c.zero_stage == 3 && z > 1) {
    // Per micro-batch: every unit gathered for forward and again for
    // backward, its gradient reduce-scattered as its backward ends; each
    // overlaps the compute it feeds except the first unit's gather and the
    // last unit's reduce-scatter.
    const double units = x.Lr + 2;
    const double gather = units * alpha + (z - 1) / z * p_local * x.pb.param / bw;
    const double scatter = units * alpha * (groups > 1 ? 2 : 1) + (z - 1) / z * grad_bytes / bw + cross;
    if (x.c.pp > 1) {
      // Under pp every unit is gathered once per step, issued at its start
      // (the first unit waited for, the rest behind the first forward); the
      // gradients reduce-scatter after each micro-batch's backward, the
      // shard's all-reduce across ZeRO groups once at the step's end.
      const double rs = scatter - cross;
      const double contention =
          kOverlapContention * (std::min(gather, forward) + micro_steps * std::min(rs, backward));
      e.dp_comm_s = gather / units + std::max(0.0, gather - forward) +
                    micro_steps * (rs / units + std::max(0.0, rs - backward)) + cross + contention;
      e.contention_s += contention;
      return;
    }
    const double per_micro = gather / units + std::max(0.0, gather - forward) +
                             std::max(0.0, gather + scatter - backward) + scatter / units;
    const double contention =
        micro_steps * kOverlapContention * (std::min(gather, forward) + std::min(gather + scatter, backward));
    e.dp_comm_s = micro_steps * per_micro + contention;
    e.contention_s += contention;
    return;
  }
  double overlappable;  // launched bucket by bucket during the last micro-batch's backward
  double after = 0;     // after the optimizer step
  // Expert parallelism: the expert buckets reduce (and shard) over the
  // dp x cp / ep ranks holding the same experts (st.ez under ZeRO), the rest
  // over dp x cp; the same links (the edp group spans dp x cp).
  const double ep = std::max(1, x.c.ep);
  const double p_expert = ep > 1 ? x.st.expert_elements : 0.0, p_dense = p_local - p_expert;
  const double de = d / ep, ez = x.st.ez;
  if (x.c.zero_stage) {
    // Reduce-scatter in the ZeRO group, all-reduce of the chunk across groups,
    // all-gather of the updated parameters.
    overlappable = buckets * alpha * (groups > 1 ? 2 : 1) + (z - 1) / z * p_dense * x.pb.grad / bw +
                   (ez - 1) / ez * p_expert * x.pb.grad / bw + cross;
    after = buckets * alpha + ((z - 1) / z * p_dense + (ez - 1) / ez * p_expert) * x.pb.param / bw;
  } else {
    overlappable = buckets * alpha + 2 * ((d - 1) / d * p_dense + (de - 1) / de * p_expert) * x.pb.grad / bw;
  }
  const double last_bucket = overlappable * std::min(1.0, cap / grad_bytes);
  // ZeRO-2 has no buffer to accumulate whole gradients in: it reduce-scatters every micro-batch.
  const double rounds = x.c.zero_stage == 2 ? micro_steps : 1;
  const double contention = rounds * kOverlapContention * std::min(overlappable - last_bucket, backward);
  e.dp_comm_s = rounds * (last_bucket + std::max(0.0, overlappable - last_bucket - backward)) + after + contention;
  e.contention_s += contention;
}

// Offload's time: the host step reads and writes weights and moments and
// reads the gradient; it waits for the global norm, so it is exposed in full.
void offload_time_term(const Setting& x, PlanEstimate& e) {
  const double H = x.st.host_elements;
  if (H <= 0 && !x.c.offload_params) return;
  const auto& pb = x.pb;
  const double link = x.req.device.host_link_bw, micro_steps = x.micro_steps;
  const double Sz = x.st.shard;
  e.host_step_s = H * (6 * update_bytes(pb) + pb.grad) / x.req.device.host_adam_bytes_per_s;
  const double d2h = H * pb.grad / link, h2d = H * pb.param / link;
  // ZeRO-3 parameter offload: every unit's chunk to the device per gather,
  // issued ahead with the gathers (hidden behind compute where it can be).
  const double unit_copies = x.c.offload_params ? micro_steps * 2 * Sz * pb.param / link : 0.0;
  e.copy_s = d2h + h2d + unit_copies;
  // Gradients leave bucket by bucket as they are reduced during the last
  // micro-batch's backward (with dp; at one rank without ZeRO-2/3 and under
  // HSDP after it); weights return while the next bucket steps, all but the last.
  const double backward = 2.0 / 3.0 * e.compute_s / micro_steps;
  const double last = H > 0 ? x.st.last_host_bucket / H : 0.0;
  const bool hsdp = x.c.zero_stage > 0 && reduce_group(x.c) / x.st.z > 1;
  const bool during_backward = (x.c.zero_stage >= 2 || x.c.dp > 1) && !hsdp;
  const double d2h_exposed = during_backward ? std::max(d2h * last, d2h - backward) : d2h;
  e.offload_s = e.host_step_s + d2h_exposed + h2d * last + std::max(0.0, unit_copies - e.compute_s);
  // Delayed update: the host step and the weights' return run during the next step's forward and backward.
  if (x.a.compute_config.offload.delayed_update && x.c.offload_ratio >= 1.0)
    e.offload_s = std::max(0.0, e.host_step_s + h2d - e.compute_s - e.comm_s) + d2h_exposed +
                  std::max(0.0, unit_copies - e.compute_s);
  // The NVMe tier: each step reads and writes the files once (ZeRO-3's
  // chunks: read per gather, written once), the node's ranks sharing the
  // disk; reads run ahead of the host step and writes behind it, so only
  // what the disk takes beyond the host step is exposed.
  if (x.c.offload_nvme) {
    const auto& d = x.req.device;
    const double ranks = std::max(1, std::min(x.req.world_size, d.ranks_per_node));
    const double reads = e.nvme_bytes + (x.c.offload_params ? (2 * micro_steps - 1) * Sz * pb.param : 0.0);
    // Rates unknown (no --probe-disk): the disk is not counted.
    e.nvme_s = d.disk_read_bw > 0 && d.disk_write_bw > 0 ? reads * ranks / d.disk_read_bw + e.nvme_bytes * ranks / d.disk_write_bw
                                                         : 0.0;
    e.offload_s += std::max(0.0, e.nvme_s - e.host_step_s);
  }
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
void optimizer_time_term(const Setting& x, PlanEstimate& e) {
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

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// Optimizer post-validation: the backup of what the speculative step changes,
// the optimizer's weights (masters, or the parameters) and moments, and under
// a loss scaler the reduced gradients (the step unscales them in place).
void post_validation_term(const Setting& x, PlanEstimate& e) {
  if (!x.a.compute_config.pipeline.post_validation) return;
  const double n = x.c.zero_stage ? x.st.shard : x.st.padded;
  e.optim_bytes += n * (update_bytes(x.pb) + x.pb.moments * x.ow.state_scale);
  if (optim::precision_setup(x.a.precision, x.a.compute_config.reduce_dtype).loss_scaling) e.grad_bytes += n * x.pb.grad;
}

// What a rank holds between steps and at the step's peak.
void memory_terms(const Setting& x, PlanEstimate& e) {
  state_term(x, e);
  offload_memory_term(x, e);
  post_validation_term(x, e);
  peak_term(x, activation_term(x), e);
}

}  // namespace

struct ScheduleCache::Impl {
  struct Shape {
    pipeline::Schedule schedule;
    // Per rank, the moments that may be its peak: (stage, micro-batch)
    // activations held, (stage, micro-batch)s between I and W (what the split
    // backward keeps for W), boundary tensors held (sent ones not yet
    // retired, and received ones not yet used), none of them below another
    // in all three.
    std::vector<std::vector<std::array<int, 3>>> moments;
  };
  using ShapeKey = std::tuple<std::string, int, int, int>;  // scheduler, ranks, stages, micros
  std::map<ShapeKey, Shape> shapes;
  using CostKey = std::pair<ShapeKey, std::vector<double>>;  // the shape and the costs
  std::map<CostKey, pipeline::Simulation> runs;
  std::map<CostKey, pipeline::SteadyState> steady_runs;
  static CostKey cost_key(const std::string& scheduler, int ranks, int stages, int micros, const pipeline::Costs& c) {
    std::vector<double> costs{c.f, c.i, c.w, c.comm};
    for (const auto& st : c.stage) costs.insert(costs.end(), {st.f, st.i, st.w});
    return {ShapeKey{scheduler, ranks, stages, micros}, std::move(costs)};
  }

  const Shape& shape(const std::string& scheduler, int ranks, int stages, int micros) {
    const ShapeKey key{scheduler, ranks, stages, micros};
    auto it = shapes.find(key);
    if (it != shapes.end()) return it->second;
    Shape sh;
    sh.schedule = pipeline::make_schedule(scheduler, ranks, stages, micros);
    // A micro-batch's activations live from its F until its B or I (I frees
    // the graph); from its I until its W it keeps only what W needs
    // (pending_w_bytes). The order alone decides it. In the lowered order
    // (what runs), a sent tensor is kept until the wait that retires it
    // (the executor's own pipeline::retired_sends; the rest to the step's
    // end), a sent activation also until its stage's B or I (it is the
    // stage's output, backward's root), a received activation from its
    // group's post until its F (then it is the stage's saved input), a
    // received gradient until the micro-batch's B or I.
    const auto lowered = pipeline::lower(sh.schedule);
    sh.moments.assign(ranks, {});
    for (int r = 0; r < ranks; ++r) {
      int live = 0, pending = 0, boundary = 0;
      std::set<std::tuple<bool, int, int>> received;  // (gradient, stage, micro)
      auto& front = sh.moments[r];
      const auto retire = pipeline::retired_sends(lowered, r);
      // Per Send: what still keeps its tensor (its retirement; an activation's
      // output too); each hold ends after the action that ends it.
      std::vector<int> holds(lowered.actions[r].size(), 0), ending;
      std::map<std::pair<int, int>, int> output_sent;  // (stage, micro) -> the Send of its output
      for (size_t k = 0; k < lowered.actions[r].size(); ++k) {
        const auto& act = lowered.actions[r][k];
        for (int i : ending) boundary -= --holds[i] == 0;
        ending = retire[k];
        const bool done = act.op == pipeline::Op::B || act.op == pipeline::Op::I;
        if (act.op == pipeline::Op::Send) {
          ++boundary;
          holds[k] = act.grad ? 1 : 2;
          if (!act.grad) output_sent[{act.stage - 1, act.micro}] = static_cast<int>(k);
        }
        if (const auto it = output_sent.find({act.stage, act.micro}); done && it != output_sent.end())
          ending.push_back(it->second);
        if (act.op == pipeline::Op::Recv && received.insert({act.grad, act.stage, act.micro}).second) ++boundary;
        if ((act.op == pipeline::Op::F && received.erase({false, act.stage, act.micro})) ||
            (done && received.erase({true, act.stage, act.micro})))
          --boundary;
        if (act.op == pipeline::Op::F) ++live;
        if (done) --live;
        if (act.op == pipeline::Op::I) ++pending;
        if (act.op == pipeline::Op::W) --pending;
        // Keep the moment unless one already kept holds as much of all three.
        const std::array<int, 3> now{live, pending, boundary};
        auto below = [](const std::array<int, 3>& u, const std::array<int, 3>& v) {
          return u[0] <= v[0] && u[1] <= v[1] && u[2] <= v[2];
        };
        if (std::any_of(front.begin(), front.end(), [&](const auto& m) { return below(now, m); })) continue;
        front.erase(std::remove_if(front.begin(), front.end(), [&](const auto& m) { return below(m, now); }),
                    front.end());
        front.push_back(now);
      }
    }
    return shapes.emplace(key, std::move(sh)).first->second;
  }
  const pipeline::Simulation& run(const std::string& scheduler, int ranks, int stages, int micros,
                                  const pipeline::Costs& c) {
    const auto key = cost_key(scheduler, ranks, stages, micros, c);
    auto it = runs.find(key);
    if (it != runs.end()) return it->second;
    return runs.emplace(key, pipeline::simulate(shape(scheduler, ranks, stages, micros).schedule, c)).first->second;
  }
  // Consecutive steps overlapping under optimizer post-validation.
  const pipeline::SteadyState& steady(const std::string& scheduler, int ranks, int stages, int micros,
                                      const pipeline::Costs& c) {
    const auto key = cost_key(scheduler, ranks, stages, micros, c);
    auto it = steady_runs.find(key);
    if (it != steady_runs.end()) return it->second;
    return steady_runs.emplace(key, pipeline::simulate_steady(shape(scheduler, ranks, stages, micros).schedule, c))
        .first->second;
  }
};

ScheduleCache::ScheduleCache() : impl(std::make_unique<Impl>()) {}
ScheduleCache::~ScheduleCache() = default;

namespace {

// The micro-batches of one pipeline flush: the step's, global batch / (micro x dp).
int pipeline_micros(const config::TrainerArgs& a, const Candidate& c) {
  return static_cast<int>(std::max<int64_t>(1, a.global_batch_size / (a.micro_batch_size * std::max(1, c.dp))));
}

// Micro-batches the pipeline simulator runs: beyond 4 x stages (a multiple of
// pp, as interleaving needs) the schedule is in its steady state, where every
// further micro-batch adds one F + B to every rank. The zero-bubble
// schedules are simulated in full (their W now waits a bounded time, but
// their steady state has not been checked against a cap).
int simulated_micros(const std::string& scheduler, int micros, int pp, int stages) {
  const int cap = std::max(4 * stages, 2 * pp);
  if (scheduler == "zb1p" || scheduler == "zbv" || micros <= cap) return micros;
  return cap - cap % pp;
}

// Pipeline parallelism. Memory: each pipeline rank holds its stages'
// parameters (the embedding on the first stage, the final norm and head on
// the last; a tied embedding on both) with their gradients and optimizer
// state (ZeRO over dp x cp), and the activations of the micro-batches in flight
// at its peak (pipeline::simulate's peak_live: p - r under 1F1B on rank r);
// the busiest rank is the estimate. Time: pipeline::simulate with each
// stage's own F, B (zero-bubble: I and W) times from the compute, tensor- and
// context-parallel terms, and the activation (or gradient) transfer between
// ranks; compute is the busiest rank's (the sum of the stages it holds),
// pp_bubble the schedule's idle fraction (a lighter rank's idle time counts),
// pp_comm_s what the transfers add to the makespan.
PlanEstimate pipeline_estimate(const PlanRequest& req, const ModelFacts& f, const Candidate& c, ScheduleCache* cache) {
  ScheduleCache local;
  auto& im = *(cache ? cache : &local)->impl;
  const auto& a = *req.args;
  const int S = c.stages, P = c.pp;
  const auto layers = c.stage_layers.empty() ? stage_split(req, f, c) : c.stage_layers;
  const int micros = pipeline_micros(a, c);
  const int m_sim = simulated_micros(c.scheduler, micros, P, S);
  const auto& shape = im.shape(c.scheduler, P, S, m_sim);
  const auto& stage_rank = shape.schedule.stage_rank;
  std::vector<int> first_layer(S + 1, 0);
  for (int st = 0; st < S; ++st) first_layer[st + 1] = first_layer[st] + layers[st];

  // Memory: every rank, the worst is the estimate.
  PlanEstimate e, slowest_optimizer;
  const auto optimizer = optimizer_cost(req, f);
  std::optional<Setting> worst;
  std::vector<double> rank_bytes;
  for (int r = 0; r < P; ++r) {
    RankPart part;
    part.layers = part.recomputed = 0;
    part.first = stage_rank[0] == r;
    part.last = stage_rank[S - 1] == r;
    std::vector<bool> in_layer(f.layers, false);
    int held_stages = 0;
    for (int st = 0; st < S; ++st) {
      if (stage_rank[st] != r) continue;
      ++held_stages;
      part.layers += layers[st];
      part.recomputed += std::min(c.recompute_layers, layers[st]);
      for (int l = first_layer[st]; l < first_layer[st + 1]; ++l) in_layer[l] = true;
    }
    part.held.assign(f.params.size(), false);
    for (size_t i = 0; i < f.params.size(); ++i) {
      const int u = f.params[i].unit;
      const bool before = u < 0 && f.zero3_units[i] == 0;
      part.held[i] = u >= 0 ? (u < f.layers && in_layer[u])
                            : before ? part.first || (part.last && f.dims.tied_embeddings) : part.last;
    }
    // The rank's peak moment: the most activations and boundary tensors held
    // at once, weighed by their sizes (a (stage, micro-batch)'s activations,
    // one micro-batch's hidden states). GPipe holds every micro-batch; the
    // other schedules' peak does not grow with more than the m_sim simulated.
    const double grow = c.scheduler == "gpipe" ? double(micros) / m_sim : 1.0;
    if (c.scheduler == "zb1p" || c.scheduler == "zbv")  // the split backward (models/common/weight_grad.h)
      for (int st = 0; st < S; ++st)
        if (stage_rank[st] == r) part.split_layers = std::max<double>(part.split_layers, layers[st]);
    const double stages_held = std::max(1, held_stages);
    part.live = 1.0 / stages_held;  // one (stage, micro-batch), to weigh it
    const auto one_setting = setting(req, f, c, part, &optimizer);
    const auto one = activation_term(one_setting);
    const double pair_bytes = one.saved_layers, boundary_bytes = one.sent_per_tensor;
    const double pending_bytes = pending_w_bytes(one_setting) / stages_held;
    double most = -1;
    for (const auto& [live, pending, boundary] : shape.moments[r]) {
      const double bytes = grow * (live * pair_bytes + pending * pending_bytes + boundary * boundary_bytes);
      if (bytes > most) {
        most = bytes;
        part.live = grow * live / stages_held;
        part.w_live = grow * pending / stages_held;
        part.sends = grow * boundary;
      }
    }
    auto x = setting(req, f, c, part, &optimizer);
    PlanEstimate er;
    memory_terms(x, er);
    rank_bytes.push_back(er.total_bytes);
    PlanEstimate ot;  // every pipeline index steps its own stages' optimizer at once: the slowest counts
    optimizer_time_term(x, ot);
    if (ot.optim_step_s > slowest_optimizer.optim_step_s) slowest_optimizer = ot;
    if (!worst || er.total_bytes > e.total_bytes) {
      e = er;
      worst.emplace(x);
    }
  }
  const Setting& x = *worst;
  e.pp_rank_bytes = rank_bytes;

  // Time: per-stage costs of one micro-batch.
  const auto& dev = req.device;
  const double peak = peak_flops_for(dev, a.precision, a.compute_config.allow_tf32) * kAssumedEfficiency;
  const double flops_token = work_per_token(x);
  const double head_flops = 6 * x.V * x.h;
  const double layer_flops = std::max(0.0, flops_token - head_flops) / std::max(1.0, x.L);
  const double tp_one = c.tp > 1 ? dev.collective_latency_s + 2 * (x.t - 1) / x.t * x.tokens * x.h * x.pb.act /
                                                                 link_bw(dev, x.t)
                                 : 0.0;
  const auto ring = cp_layer(x);
  const bool split_backward = c.scheduler == "zb1p" || c.scheduler == "zbv";
  struct StageCost {
    double f = 0, i = 0, w = 0, compute = 0, tp = 0, cp = 0, cp_contention = 0;
  };
  std::vector<StageCost> rank_cost(P);  // per micro-batch: the sum of the rank's stages
  pipeline::Costs costs{0, 0, 0, 0};
  costs.stage.resize(S);
  for (int st = 0; st < S; ++st) {
    const double n = layers[st], k = std::min<double>(c.recompute_layers, n);
    const bool head = st == S - 1, embed = st == 0;
    const double fwd = x.tokens * (n * layer_flops + (head ? head_flops : 0.0)) / 3 / x.t / peak;
    const double rec = x.tokens * k * layer_flops / 3 / x.t / peak;
    const double vocab = x.f.vocab_parallel_head && (head || embed) ? 1 : 0;
    const double tp_f = (2 * n + vocab) * tp_one, tp_b = (2 * n + 2 * k + vocab) * tp_one;
    const double cp_f = n * ring.forward_s, cp_b = n * ring.backward_s + k * ring.forward_s;
    StageCost sc;
    sc.f = fwd + tp_f + cp_f;
    // Backward is twice the forward: the input's gradient (I, with the
    // recompute and the collectives on its path) and the weights' (W).
    sc.i = (split_backward ? fwd : 2 * fwd) + rec + tp_b + cp_b;
    sc.w = split_backward ? fwd : 0.0;
    sc.compute = 3 * fwd + rec;
    sc.tp = tp_f + tp_b;
    sc.cp = cp_f + cp_b;
    sc.cp_contention = n * (ring.forward_contention_s + ring.backward_contention_s) + k * ring.forward_contention_s;
    costs.stage[st] = {sc.f, sc.i, sc.w};
    auto& rc = rank_cost[stage_rank[st]];
    rc.f += sc.f, rc.i += sc.i, rc.w += sc.w, rc.compute += sc.compute, rc.tp += sc.tp, rc.cp += sc.cp;
    rc.cp_contention += sc.cp_contention;
  }
  // The busiest rank bounds the steady state; its work is the step's compute.
  double mean_load = 0;
  const StageCost* busiest = &rank_cost[0];
  for (const auto& rc : rank_cost) {
    mean_load += (rc.f + rc.i + rc.w) / P;
    if (rc.f + rc.i + rc.w > busiest->f + busiest->i + busiest->w) busiest = &rc;
  }
  const double act_bytes = x.tokens * x.h * x.pb.act * (x.sp ? 1 / x.t : 1.0);  // each tp rank sends its share
  costs.comm = dev.collective_latency_s + act_bytes / link_bw(dev, x.t * x.cp * P);
  auto quiet = costs;
  quiet.comm = 0;
  const double beyond = double(micros - m_sim);  // micro-batches past the simulated ones
  const double extra = beyond * (busiest->f + busiest->i + busiest->w);
  double busy = 0, makespan0 = 0, makespan = 0;
  if (a.compute_config.pipeline.post_validation) {
    // Steps overlap: the step time is the steady state's period.
    const auto& with_comm = im.steady(c.scheduler, P, S, m_sim, costs);
    const auto& without = im.steady(c.scheduler, P, S, m_sim, quiet);
    for (double b : without.busy) busy += b;
    makespan0 = without.period + extra, makespan = with_comm.period + extra;
  } else {
    const auto& with_comm = im.run(c.scheduler, P, S, m_sim, costs);
    const auto& without = im.run(c.scheduler, P, S, m_sim, quiet);
    for (double b : without.busy) busy += b;
    makespan0 = without.makespan + extra, makespan = with_comm.makespan + extra;
  }
  busy = busy / double(P) + beyond * mean_load;
  e.pp_bubble = makespan0 > 0 ? 1 - busy / makespan0 : 0.0;
  e.pp_comm_s = std::max(0.0, makespan - makespan0);
  e.compute_s = micros * busiest->compute;
  e.tp_comm_s = micros * busiest->tp;
  e.cp_comm_s = micros * busiest->cp;
  e.contention_s = micros * busiest->cp_contention;
  PlanEstimate scratch;
  const auto cm = compute_term(x, scratch);  // the forward/backward shares dp_comm_term overlaps with
  dp_comm_term(x, cm, e);
  ep_comm_term(x, e);  // (ep > 1 is not run with pp yet: planner.cpp not_runnable)
  e.comm_s = e.tp_comm_s + e.cp_comm_s + e.dp_comm_s + e.pp_comm_s + e.ep_comm_s;
  offload_time_term(x, e);
  const auto& so = slowest_optimizer;
  e.optim_step_s = so.optim_step_s, e.optim_elementwise_s = so.optim_elementwise_s;
  e.optim_matrix_s = so.optim_matrix_s, e.optim_exchange_s = so.optim_exchange_s;
  e.optim_matrix_flops = so.optim_matrix_flops;
  e.optim_gather_bytes = so.optim_gather_bytes, e.optim_scatter_bytes = so.optim_scatter_bytes;
  e.step_s = makespan + e.dp_comm_s + e.ep_comm_s + e.offload_s + e.optim_step_s;
  return e;
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

int64_t seq_len_of(const config::TrainerArgs& a, const ModelFacts& f) {
  const int64_t s = a.dataset.train_args.seq_len;
  return s > 0 ? s : f.dims.max_seq;
}

std::string offload_text(const Candidate& c) {
  if (c.offload_ratio <= 0 && !c.offload_params) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", c.offload_ratio);
  return std::string(" offload=optimizer") + (c.offload_ratio < 1 ? ":" + std::string(buf) : "") +
         (c.offload_params ? "+params" : "") + (c.offload_nvme ? ":nvme" : "");
}

std::string split_text(const Candidate& c) {
  std::string out;
  if (c.cp > 1) out += " cp=" + std::to_string(c.cp) + ":" + c.cp_comm;
  if (c.pp > 1) out += " pp=" + std::to_string(c.pp) + ":" + c.scheduler + "/" + std::to_string(c.stages);
  if (c.ep > 1) out += " ep=" + std::to_string(c.ep);
  return out;
}

std::string candidate_text(const Candidate& c, int64_t layers) {
  // Under pp, recompute counts per stage: out of the largest stage's layers.
  int64_t of = layers;
  if (c.pp > 1 && !c.stage_layers.empty()) of = *std::max_element(c.stage_layers.begin(), c.stage_layers.end());
  return "tp=" + std::to_string(c.tp) + split_text(c) + " dp=" + std::to_string(c.dp) +
         " zero=" + std::to_string(c.zero_stage) + offload_text(c) + " recompute=" + std::to_string(c.recompute_layers) +
         "/" + std::to_string(of) + (c.pp > 1 ? " per stage" : "");
}

std::string format_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string format_bytes(double bytes) {
  const double a = std::fabs(bytes);
  if (a >= kGiB) return format_fixed(bytes / kGiB, 2) + " GiB";
  if (a >= 1024.0 * 1024) return format_fixed(bytes / (1024.0 * 1024), 1) + " MiB";
  if (a >= 1024.0) return format_fixed(bytes / 1024.0, 1) + " KiB";
  return format_fixed(bytes, 0) + " B";
}

std::vector<std::string> known_devices() {
  std::vector<std::string> names;
  for (const auto& d : table()) names.push_back(d.name);
  return names;
}

DeviceSpec device_spec(const std::string& name_or_auto) {
  const std::string n = lower(name_or_auto);
  if (n == "auto" || n == "cuda" || n.empty()) {
    if (torch::cuda::is_available()) return cuda_device_spec();
    if (n == "cuda") throw PlanError("device cuda requested but no CUDA device is available");
    return table_entry("cpu");
  }
  return table_entry(name_or_auto);
}

double peak_flops_for(const DeviceSpec& device, const std::string& precision, bool allow_tf32) {
  if (precision.rfind("32", 0) == 0) return allow_tf32 ? device.peak_flops_tf32 : device.peak_flops_fp32;
  return device.peak_flops;
}

double memory_budget(const PlanRequest& req) {
  if (req.memory_budget_bytes > 0) return req.memory_budget_bytes;
  if (req.device.memory_bytes > 0) return kDefaultMemoryFraction * req.device.memory_bytes;
  return std::numeric_limits<double>::infinity();
}

PlanEstimate estimate(const PlanRequest& req, const ModelFacts& f, const Candidate& c, ScheduleCache* cache) {
  if (c.pp > 1) return pipeline_estimate(req, f, c, cache);
  const auto x = setting(req, f, c, {});
  PlanEstimate e;
  memory_terms(x, e);
  const auto cm = compute_term(x, e);
  tp_comm_term(x, e);
  cp_comm_term(x, e);
  dp_comm_term(x, cm, e);
  ep_comm_term(x, e);
  e.comm_s = e.tp_comm_s + e.cp_comm_s + e.dp_comm_s + e.ep_comm_s;
  offload_time_term(x, e);
  optimizer_time_term(x, e);
  e.step_s = e.compute_s + e.comm_s + e.offload_s + e.optim_step_s;
  return e;
}

PlanEstimate estimate(const PlanRequest& req, const Candidate& c) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  return estimate(req, model_facts(*req.model), c);
}

optim::StepCost optimizer_cost(const PlanRequest& req, const ModelFacts& f) {
  const auto& o = req.args->optimizer;
  const auto& entry = optim::optimizer_entry(o.type);
  std::vector<optim::CostParam> params;
  for (const auto& p : f.params) params.push_back({p.name, p.shape, p.unit >= 0});
  auto cost = entry.cost ? entry.cost(o, params, req.device.name != "cpu") : optim::StepCost{};
  cost.state_tensors.resize(params.size(), 2);  // an entry without a cost hook: AdamW's shape
  cost.matrix_flops.resize(params.size(), 0.0);
  return cost;
}

double moe_imbalance(const PlanRequest& req) {
  const double v = req.moe_imbalance > 0 ? req.moe_imbalance : req.args ? req.args->compute_config.moe_imbalance : 1.25;
  return std::max(1.0, v);
}

AllToAll all_to_all_layer(const PlanRequest& req, const ModelFacts& f, const Candidate& c) {
  return a2a_layer(setting(req, f, c, {}));
}

std::vector<int> balanced_stage_split(int64_t layers, int stages, double first_extra, double last_extra) {
  if (stages < 1 || layers < stages)
    throw PlanError(std::to_string(layers) + " layers cannot fill " + std::to_string(stages) +
                    " pipeline stages (each needs at least one)");
  std::vector<double> extra(stages, 0.0);
  extra.front() += first_extra;
  extra.back() += last_extra;
  return deal_layers(layers, extra, std::vector<int>(stages, 1));
}

std::vector<int> stage_split(const PlanRequest& req, const ModelFacts& f, const Candidate& c) {
  const int stages = c.stages;
  const auto& given = req.args->compute_config.pipeline.layers;
  if (!given.empty() && static_cast<int>(given.size()) == stages) {
    int64_t sum = 0;
    for (int n : given) sum += n;
    if (sum != f.layers)
      throw PlanError("compute_config.pas_config.pipeline_layers sums to " + std::to_string(sum) + ", but the model has " +
                      std::to_string(f.layers) + " layers");
    return given;
  }
  const int64_t seq = seq_len_of(*req.args, f);
  const double attn = f.flops_per_token(seq) - f.flops_per_token(0);
  const double flops = f.flops_per_token(seq) - 0.5 * attn;  // causal: as work_per_token
  const double head = 6 * double(f.dims.vocab) * double(f.dims.hidden);
  const double layer = std::max(1.0, (flops - head) / std::max<double>(1, f.layers));
  // The embedding is a lookup (no matmul): its stage has no extra time.
  const auto balanced = balanced_stage_split(f.layers, stages, 0.0, head / layer);
  if (stages <= c.pp) return balanced;
  std::vector<double> extra(stages, 0.0);
  extra.back() = head / layer;
  return fastest_split(c.scheduler, c.pp, stages, pipeline_micros(*req.args, c), balanced, extra);
}

void check_tp_feasible(const models::CausalLM& model, int tp) {
  const auto f = model_facts(model);
  const auto fails = tp_failures(f, tp);
  if (!fails.empty()) throw PlanError("tensor parallel size " + std::to_string(tp) + " cannot split the model: " + join(fails, "; "));
}

}  // namespace nnstrain::parallel
