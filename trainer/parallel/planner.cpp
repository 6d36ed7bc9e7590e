#include "trainer/parallel/planner.h"

#include "trainer/optim/precision.h"
#include "trainer/parallel/training_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include <unistd.h>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

#include "models/model.h"

namespace nnstrain::parallel {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The table. Memory as the driver reports it (GiB); dense peaks from the data
// sheets (SXM parts); bandwidth: NVLink per direction for ranks of one node,
// one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU between nodes.
const std::vector<DeviceSpec>& table() {
  static const std::vector<DeviceSpec> t = {
      {"H100", 80 * kGiB, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6},
      {"H200", 141e9, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6},
      {"A100-80G", 80 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6},
      {"A100-40G", 40 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6},
      // A CPU rank: memory is filled in from the machine; the rates are a
      // rough server-socket figure, for relative choices only.
      {"cpu", 0, 1e12, 1e12, 1e12, 10e9, 1.25e9, 8, 100e-6},
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

// ---- the model as the cost model sees it ------------------------------------

struct ParamFact {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  models::ParamSplit split;  // style Replicate when not declared
};

struct ModelFacts {
  models::ModelDims dims;
  int64_t layers = 0;
  std::vector<ParamFact> params;
  bool vocab_parallel_head = false;  // some Vocab split is declared
};

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
    f.params.push_back(std::move(pf));
  }
  return f;
}

const char* style_name(models::SplitStyle s) {
  switch (s) {
    case models::SplitStyle::Column: return "column";
    case models::SplitStyle::Row: return "row";
    case models::SplitStyle::Vocab: return "vocab";
    default: return "replicate";
  }
}

// The split dimension of a declared style (Row on a 1-D tensor: its only dim).
int split_dim(const ParamFact& p) {
  if (p.split.style == models::SplitStyle::Row && p.shape.size() >= 2) return 1;
  return 0;
}

std::vector<int64_t> local_shape(const ParamFact& p, int tp) {
  auto s = p.shape;
  // Rounded up: a padded vocabulary's first ranks hold ceil(V / tp) rows.
  if (tp > 1 && p.split.style != models::SplitStyle::Replicate && !s.empty())
    s[split_dim(p)] = (s[split_dim(p)] + tp - 1) / tp;
  return s;
}

// Bytes per element: parameters (the copy compute reads), gradients (the
// reduction buffer), optimizer state (fp32 masters under *-mixed plus AdamW's
// two moments), activations. The first three are what TrainingState allocates
// (parallel::state_bytes, the same function the trainer's start-up line checks).
struct PrecisionBytes {
  double param, grad, optim, act;
};

PrecisionBytes precision_bytes(const config::TrainerArgs& a) {
  const auto p = optim::precision_setup(a.precision, a.compute_config.reduce_dtype);
  const auto b = state_bytes(p.param, p.grad, p.master_weights);
  return {b.param, b.grad, b.master + b.moments, b.param};
}

int64_t seq_len_of(const config::TrainerArgs& a, const ModelFacts& f) {
  const int64_t s = a.dataset.train_args.seq_len;
  return s > 0 ? s : f.dims.max_seq;
}

std::string candidate_text(const Candidate& c, int64_t layers) {
  return "tp=" + std::to_string(c.tp) + " dp=" + std::to_string(c.dp) + " zero=" + std::to_string(c.zero_stage) +
         " recompute=" + std::to_string(c.recompute_layers) + "/" + std::to_string(layers);
}

PlanEstimate estimate_facts(const PlanRequest& req, const ModelFacts& f, const Candidate& c) {
  const auto& a = *req.args;
  const auto pb = precision_bytes(a);
  const double t = c.tp, d = c.dp;
  const double b = double(a.micro_batch_size), s = double(seq_len_of(a, f));
  const double h = double(f.dims.hidden), heads = double(f.dims.heads), kv = double(f.dims.kv_heads);
  const double ffn = double(f.dims.ffn), V = double(f.dims.vocab), L = double(f.layers);
  const double k = c.recompute_layers;
  const double micro_steps = std::max(1.0, std::floor(double(a.global_batch_size) / (b * d)));

  PlanEstimate e;
  // ---- memory --------------------------------------------------------------
  double p_local = 0;
  for (const auto& p : f.params) {
    double n = 1;
    for (auto dim : local_shape(p, c.tp)) n *= double(dim);
    p_local += n;
  }
  const double cap = a.compute_config.reducer_bucket_cap_mb * 1024 * 1024;
  const double zgroups = std::max(1, a.compute_config.zero_ngroups);
  const double z = c.zero_stage ? std::max(1.0, d / zgroups) : 1.0;  // ZeRO shard group size
  const double buckets = std::ceil(p_local * pb.grad / cap);
  const double padded = p_local + (c.zero_stage ? buckets * (z - 1) : 0.0);  // each bucket padded to a multiple of z
  e.param_bytes = p_local * pb.param;
  // Full gradient buffer (ZeRO-1 keeps it), plus ZeRO's reduced chunk.
  e.grad_bytes = p_local * pb.grad + (c.zero_stage ? padded / z * pb.grad : 0.0);
  e.optim_bytes = (c.zero_stage ? padded / z : p_local) * pb.optim;

  // Activations of one micro-batch (Korthikanti et al. 2022, bytes at 16 bit):
  // per layer s*b*(10h + (attention 4h(1 + kv/a) + MLP 4 ffn)/t + 5 a s/t),
  // which is s*b*h*(10 + 24/t + 5as/(ht)) for a GPT; the 5as/t score term is
  // not stored by fused attention.
  const double scale = pb.act / 2.0;
  const double layer_full =
      s * b * (10 * h + (4 * h * (1 + kv / heads) + 4 * ffn) / t + (req.fused_attention ? 0.0 : 5 * heads * s / t)) *
      scale;
  const double layer_input = s * b * h * pb.act;
  // Recomputing the first k layers keeps only their inputs; backward reaches
  // them after the other layers' activations are freed, and rebuilds one layer
  // at a time: peak k inputs + max(L - k, 1) full layers (k > 0).
  double acts = k * layer_input + (k > 0 ? std::max(L - k, 1.0) : L) * layer_full;
  // Embedding output, final norm input and head input, then fp32 logits and
  // their softmax gradient (vocab-split under tensor parallelism, per chunk
  // with the chunked loss).
  const double v_local = (f.vocab_parallel_head && c.tp > 1) ? V / t : V;
  const double logit_rows = a.model.loss == "chunked" ? std::min(double(a.model.loss_chunk_size), b * s) : b * s;
  acts += 3 * s * b * h * pb.act + logit_rows * v_local * 4 * 2;
  e.activation_bytes = acts;

  // Transient: two gradient buckets in flight, ZeRO's gathered-parameter bucket.
  double transient = 0;
  if (c.dp > 1) transient += 2 * std::min(cap, p_local * pb.grad);
  if (c.zero_stage && c.dp > 1) transient += std::min(cap, p_local * pb.param);
  e.transient_bytes = transient;
  e.total_bytes = e.param_bytes + e.grad_bytes + e.optim_bytes + e.activation_bytes + e.transient_bytes;

  // ---- time ----------------------------------------------------------------
  const double peak = peak_flops_for(req.device, a.precision, a.compute_config.allow_tf32) * kAssumedEfficiency;
  const double flops_token = req.model->flops_per_token(static_cast<int64_t>(s));
  const double layer_flops = std::max(0.0, flops_token - 6 * V * h) / std::max(1.0, L);
  const double recompute_flops = k * layer_flops / 3;  // one more forward (1/3 of fwd+bwd) per recomputed layer
  const double tokens_rank = micro_steps * b * s;
  e.compute_s = tokens_rank * (flops_token + recompute_flops) / t / peak;

  const int per_node = std::max(1, req.device.ranks_per_node);
  if (c.tp > 1) {
    // Per micro-batch: 4 all-reduces per layer (2 forward, 2 backward), 2 more per
    // recomputed layer, 2 for the vocab-parallel embedding and head; ring cost.
    const double bw = c.tp <= per_node ? req.device.intra_node_bw : req.device.inter_node_bw;
    const double n = 4 * L + 2 * k + (f.vocab_parallel_head ? 2 : 0);
    e.tp_comm_s = micro_steps * n * (req.device.collective_latency_s + 2 * (t - 1) / t * (b * s * h * pb.act) / bw);
  }
  if (c.dp > 1) {
    // The dp group (ranks r, r+tp, ...) leaves the node once the world does.
    const double bw = c.tp * c.dp <= per_node ? req.device.intra_node_bw : req.device.inter_node_bw;
    const double grad_bytes = p_local * pb.grad;
    const double alpha = req.device.collective_latency_s;
    double overlappable;  // launched bucket by bucket during the last micro-batch's backward
    double after = 0;     // after the optimizer step
    if (c.zero_stage) {
      // Reduce-scatter in the ZeRO group, all-reduce of the chunk across groups,
      // all-gather of the updated parameters.
      const double groups = d / z;
      overlappable = buckets * alpha * (groups > 1 ? 2 : 1) + (z - 1) / z * grad_bytes / bw +
                     2 * (groups - 1) / groups * grad_bytes / z / bw;
      after = buckets * alpha + (z - 1) / z * p_local * pb.param / bw;
    } else {
      overlappable = buckets * alpha + 2 * (d - 1) / d * grad_bytes / bw;
    }
    const double last_bucket = overlappable * std::min(1.0, cap / grad_bytes);
    const double backward = e.compute_s / micro_steps * (2 * flops_token / 3 + recompute_flops) /
                            (flops_token + recompute_flops);
    e.dp_comm_s = last_bucket + std::max(0.0, overlappable - last_bucket - backward) + after;
  }
  e.comm_s = e.tp_comm_s + e.dp_comm_s;
  e.step_s = e.compute_s + e.comm_s;
  return e;
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
        p.shape.empty())
      continue;
    const int dim = split_dim(p);
    const int64_t unit = std::max<int64_t>(1, p.split.unit);
    std::vector<int64_t> parts = p.split.fused_parts;
    if (p.split.style != models::SplitStyle::Column || parts.empty()) parts = {p.shape[dim]};
    for (auto part : parts)
      if (part % unit != 0 || part / unit < tp) {
        out.push_back(p.name + " (" + style_name(p.split.style) + " split of dim " + std::to_string(dim) +
                      (parts.size() > 1 ? ", fused part of " : ", size ") + std::to_string(part) + ") " +
                      (part % unit ? "is not a whole number of units of " + std::to_string(unit)
                                   : "has " + std::to_string(part / unit) + " units of " + std::to_string(unit) +
                                         ", fewer than tp " + t));
        break;
      }
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

}  // namespace

std::string format_bytes(double bytes) {
  const double a = std::fabs(bytes);
  if (a >= kGiB) return fixed(bytes / kGiB, 2) + " GiB";
  if (a >= 1024.0 * 1024) return fixed(bytes / (1024.0 * 1024), 1) + " MiB";
  if (a >= 1024.0) return fixed(bytes / 1024.0, 1) + " KiB";
  return fixed(bytes, 0) + " B";
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

PlanEstimate estimate(const PlanRequest& req, const Candidate& c) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  return estimate_facts(req, model_facts(*req.model), c);
}

void check_tp_feasible(const models::CausalLM& model, int tp) {
  const auto f = model_facts(model);
  const auto fails = tp_failures(f, tp);
  if (!fails.empty()) throw PlanError("tensor parallel size " + std::to_string(tp) + " cannot split the model: " + join(fails, "; "));
}

Plan make_plan(const PlanRequest& req, std::vector<Rejected>* rejected) {
  if (!req.args || !req.model) throw PlanError("plan request without config or model");
  const auto& a = *req.args;
  const auto& cc = a.compute_config;
  const int world = req.world_size, plan_ngpus = cc.plan_ngpus;
  if (world < 1) throw PlanError("world size must be >= 1, got " + std::to_string(world));
  const auto f = model_facts(*req.model);
  const int L = static_cast<int>(f.layers);
  const double budget = memory_budget(req);
  const std::string& policy = a.pas_policy;

  // Tensor-parallel degrees the policy allows.
  std::vector<int> tps;
  if (policy == "dp") {
    tps = {1};
  } else if (policy == "tp" || policy == "hybrid") {
    if (policy == "tp" && world != plan_ngpus)
      throw PlanError("pas_policy tp puts every rank in one tensor-parallel group, so runtime_ngpus " +
                      std::to_string(world) + " must equal compute_config.plan_ngpus " + std::to_string(plan_ngpus) +
                      " (pas_policy hybrid runs tp x dp)");
    if (world % plan_ngpus != 0)
      throw PlanError("runtime_ngpus " + std::to_string(world) + " is not a multiple of compute_config.plan_ngpus " +
                      std::to_string(plan_ngpus));
    check_tp_feasible(*req.model, plan_ngpus);
    tps = {plan_ngpus};
  } else if (policy == "autodist") {
    for (int t = 1; t <= plan_ngpus; ++t)
      if (plan_ngpus % t == 0 && world % t == 0) tps.push_back(t);
  } else {
    throw PlanError("unknown pas_policy '" + policy + "' (dp, tp, hybrid, autodist)");
  }

  // Every candidate in search order (tp up, ZeRO off first, recompute up):
  // infeasible ones with their reason, the rest with their estimate.
  struct Entry {
    Candidate c;
    std::string infeasible;  // empty: evaluated
    PlanEstimate e;
  };
  std::vector<Entry> entries;
  for (int t : tps) {
    const int dp = world / t;
    const auto fails = tp_failures(f, t);
    if (!fails.empty()) {
      entries.push_back({{t, dp, 0, 0}, join(fails, "; "), {}});
      continue;
    }
    if (a.global_batch_size % (a.micro_batch_size * dp) != 0) {
      entries.push_back({{t, dp, false, 0},
                         "global batch " + std::to_string(a.global_batch_size) +
                             " is not a multiple of micro_batch_size " + std::to_string(a.micro_batch_size) +
                             " x dp " + std::to_string(dp),
                         {}});
      continue;
    }
    std::vector<int> zeros;
    if (policy != "autodist" || cc.use_zero) zeros = {cc.use_zero};
    else zeros = dp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0};
    for (int zero : zeros) {
      if (zero && dp % cc.zero_ngroups != 0) {
        entries.push_back({{t, dp, zero, 0},
                           "compute_config.zero_ngroups " + std::to_string(cc.zero_ngroups) +
                               " does not divide dp " + std::to_string(dp),
                           {}});
        continue;
      }
      for (int k = a.model.activation_checkpointing ? L : 0; k <= L; ++k) {
        Candidate c{t, dp, zero, k};
        entries.push_back({c, "", estimate_facts(req, f, c)});
      }
    }
  }

  // The fastest that fits; strict < keeps the first in search order on ties.
  const Entry* best = nullptr;
  const Entry* least_memory = nullptr;
  for (const auto& en : entries) {
    if (!en.infeasible.empty()) continue;
    if (!least_memory || en.e.total_bytes < least_memory->e.total_bytes) least_memory = &en;
    if (en.e.total_bytes <= budget && (!best || en.e.step_s < best->e.step_s)) best = &en;
  }
  if (!best) {
    if (!least_memory) {
      std::string why;
      for (const auto& en : entries) why += "\n  " + candidate_text(en.c, L) + ": " + en.infeasible;
      throw PlanError("no feasible plan for pas_policy " + policy + " on " + std::to_string(world) + " ranks:" + why);
    }
    const auto& m = *least_memory;
    throw PlanError("no plan fits the memory budget of " + format_bytes(budget) + " per rank (pas_policy " + policy +
                        ", " + std::to_string(world) + (world == 1 ? " rank" : " ranks") + ", plan_ngpus " + std::to_string(plan_ngpus) +
                        "): the least any candidate needs is " + format_bytes(m.e.total_bytes) + " (" +
                        candidate_text(m.c, L) + "); raise compute_config.memory_budget_gb to at least " +
                        fixed(std::ceil(m.e.total_bytes / kGiB * 100) / 100, 2) +
                        ", use more ranks or a larger plan_ngpus, or shrink micro_batch_size",
                    m.e.total_bytes);
  }

  if (rejected) {
    rejected->clear();
    for (const auto& en : entries) {
      if (&en == best) continue;
      Rejected r{candidate_text(en.c, L), "", "", en.c, en.e.total_bytes, en.e.step_s};
      if (!en.infeasible.empty()) {
        r.kind = "infeasible";
        r.reason = en.infeasible;
        r.memory_bytes = r.step_s = 0;
      } else if (en.e.total_bytes > budget) {
        r.kind = "memory";
        r.reason = "needs " + format_bytes(en.e.total_bytes) + ", over the budget " + format_bytes(budget) +
                   " by " + format_bytes(en.e.total_bytes - budget);
      } else {
        r.kind = "slower";
        r.reason = "fits (" + format_bytes(en.e.total_bytes) + ") but slower: " + fixed(en.e.step_s, 4) +
                   " s vs " + fixed(best->e.step_s, 4) + " s" +
                   (en.e.step_s == best->e.step_s ? " (tie: search order)" : "");
      }
      rejected->push_back(std::move(r));
    }
  }

  Plan p;
  p.policy = policy;
  p.world = world;
  p.tp = best->c.tp;
  p.dp = best->c.dp;
  p.zero_stage = best->c.zero_stage;
  p.zero_ngroups = cc.zero_ngroups;
  p.recompute.assign(L, false);
  for (int i = 0; i < best->c.recompute_layers && i < L; ++i) p.recompute[i] = true;
  for (const auto& pf : f.params) {
    ParamPlan pp;
    pp.param = pf.name;
    pp.split = p.tp > 1 ? style_name(pf.split.style) : "replicate";
    pp.global_shape = pf.shape;
    pp.local_shape = local_shape(pf, p.tp);
    p.params.push_back(std::move(pp));
  }
  p.estimate = best->e;
  p.memory_budget_bytes = std::isfinite(budget) ? budget : 0.0;
  p.device = req.device.name;
  p.micro_batch_size = a.micro_batch_size;
  p.seq_len = seq_len_of(a, f);
  p.grad_accumulation_steps = a.global_batch_size / (a.micro_batch_size * p.dp);
  return p;
}

std::string describe_rejected(const std::vector<Rejected>& rejected, int layers) {
  std::ostringstream o;
  // Fold runs of the same (tp, zero, kind) over consecutive recompute counts.
  for (size_t i = 0; i < rejected.size();) {
    const auto& r = rejected[i];
    size_t j = i;
    while (j + 1 < rejected.size() && rejected[j + 1].kind == r.kind && r.kind != "infeasible" &&
           rejected[j + 1].cand.tp == r.cand.tp && rejected[j + 1].cand.zero_stage == r.cand.zero_stage &&
           rejected[j + 1].cand.recompute_layers == rejected[j].cand.recompute_layers + 1)
      ++j;
    const auto& last = rejected[j];
    std::string head = "tp=" + std::to_string(r.cand.tp) + " dp=" + std::to_string(r.cand.dp) +
                       " zero=" + std::to_string(r.cand.zero_stage);
    if (r.kind == "infeasible") {
      o << "  " << head << ": infeasible: " << r.reason << "\n";
    } else if (i == j) {
      o << "  " << r.candidate << ": " << (r.kind == "memory" ? "over budget: " : "") << r.reason << "\n";
    } else {
      o << "  " << head << " recompute=" << r.cand.recompute_layers << ".." << last.cand.recompute_layers << "/"
        << layers << ": ";
      // The run's least-memory / fastest end says the most.
      if (r.kind == "memory")
        o << "over budget: at recompute=" << last.cand.recompute_layers << " still " << last.reason;
      else
        {
        const auto vs = r.reason.rfind(" vs ");
        o << "fit but slower: " << fixed(r.step_s, 4) << " s .. " << fixed(last.step_s, 4) << " s"
          << (vs == std::string::npos ? "" : r.reason.substr(vs));
      }
      o << "\n";
    }
    i = j + 1;
  }
  return o.str();
}

}  // namespace nnstrain::parallel
