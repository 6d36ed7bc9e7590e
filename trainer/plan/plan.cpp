#include "trainer/plan/plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <stdexcept>

#include "base/text.h"
#include "trainer/plan/planner.h"

namespace nnstrain::parallel {

void to_json(nlohmann::json& j, const Plan& p) {
  nlohmann::json params = nlohmann::json::array();
  for (const auto& pp : p.params)
    params.push_back({{"param", pp.param}, {"split", pp.split}, {"global_shape", pp.global_shape},
                      {"local_shape", pp.local_shape}});
  const auto& e = p.estimate;
  j = {{"policy", p.policy},
       {"world", p.world},
       {"tp", p.tp},
       {"dp", p.dp},
       {"zero", p.zero_stage},
       {"zero_ngroups", p.zero_ngroups},
       {"offload", {{"optimizer", p.offload_ratio > 0}, {"ratio", p.offload_ratio}, {"params", p.offload_params}}},
       {"recompute", p.recompute},
       {"units_before_blocks", p.units_before_blocks},
       {"units_after_blocks", p.units_after_blocks},
       {"params", params},
       {"estimate",
        {{"param_bytes", e.param_bytes},
         {"grad_bytes", e.grad_bytes},
         {"optim_bytes", e.optim_bytes},
         {"frozen_bytes", e.frozen_bytes},
         {"activation_bytes", e.activation_bytes},
         {"transient_bytes", e.transient_bytes},
         {"total_bytes", e.total_bytes},
         {"compute_s", e.compute_s},
         {"comm_s", e.comm_s},
         {"tp_comm_s", e.tp_comm_s},
         {"dp_comm_s", e.dp_comm_s},
         {"cp_comm_s", e.cp_comm_s},
         {"contention_s", e.contention_s},
         {"pp_comm_s", e.pp_comm_s},
         {"pp_bubble", e.pp_bubble},
         {"host_bytes", e.host_bytes},
         {"host_step_s", e.host_step_s},
         {"copy_s", e.copy_s},
         {"offload_s", e.offload_s},
         {"optim_step_s", e.optim_step_s},
         {"optim_elementwise_s", e.optim_elementwise_s},
         {"optim_matrix_s", e.optim_matrix_s},
         {"optim_exchange_s", e.optim_exchange_s},
         {"optim_matrix_flops", e.optim_matrix_flops},
         {"optim_gather_bytes", e.optim_gather_bytes},
         {"optim_scatter_bytes", e.optim_scatter_bytes},
         {"step_s", e.step_s}}},
       {"optimizer", {{"type", p.optimizer}, {"work", p.optimizer_work}}},
       {"frozen", p.frozen},
       {"memory_budget_bytes", p.memory_budget_bytes},
       {"device", p.device},
       {"micro_batch_size", p.micro_batch_size},
       {"seq_len", p.seq_len},
       {"grad_accumulation_steps", p.grad_accumulation_steps}};
  if (p.offload_nvme) {  // only then: plans of the host tier read as before
    j["offload"]["nvme"] = true;
    j["estimate"]["nvme_bytes"] = e.nvme_bytes;
    j["estimate"]["nvme_s"] = e.nvme_s;
  }
  // Only where used, so plans without them read as before.
  if (!e.pp_rank_bytes.empty()) j["estimate"]["pp_rank_bytes"] = e.pp_rank_bytes;
  if (p.ep > 1) j["ep"] = p.ep;
  if (e.moe_imbalance > 0)
    j["estimate"].update({{"expert_bytes", e.expert_bytes},
                          {"ep_comm_s", e.ep_comm_s},
                          {"a2a_layer_s", e.a2a_layer_s},
                          {"a2a_cross_node", e.a2a_cross_node},
                          {"moe_imbalance", e.moe_imbalance}});
  if (p.context.cp > 1)
    j["context"] = {{"cp", p.context.cp}, {"comm_type", p.context.comm_type}, {"load_balance", p.context.load_balance}};
  if (p.pipeline.pp > 1)
    j["pipeline"] = {{"pp", p.pipeline.pp},
                     {"stages", p.pipeline.stages},
                     {"scheduler", p.pipeline.scheduler},
                     {"nmicros", p.pipeline.nmicros},
                     {"stage_layers", p.pipeline.stage_layers},
                     {"post_validation", p.pipeline.post_validation}};
}

void from_json(const nlohmann::json& j, Plan& p) {
  try {
    p = Plan{};
    p.policy = j.at("policy").get<std::string>();
    p.world = j.at("world").get<int>();
    p.tp = j.at("tp").get<int>();
    p.dp = j.at("dp").get<int>();
    // Checkpoints before ZeRO stages saved a boolean (stage 1 or none).
    const auto& z = j.at("zero");
    p.zero_stage = z.is_boolean() ? (z.get<bool>() ? 1 : 0) : z.get<int>();
    p.zero_ngroups = j.value("zero_ngroups", 1);
    if (j.contains("offload")) {  // plans before offload have none
      const auto& o = j.at("offload");
      p.offload_ratio = o.value("optimizer", false) ? o.value("ratio", 1.0) : 0.0;
      p.offload_params = o.value("params", false);
      p.offload_nvme = o.value("nvme", false);
    }
    p.recompute = j.at("recompute").get<std::vector<bool>>();
    p.units_before_blocks = j.value("units_before_blocks", std::vector<std::string>{});
    p.units_after_blocks = j.value("units_after_blocks", std::vector<std::string>{});
    for (const auto& pj : j.at("params")) {
      ParamPlan pp;
      pp.param = pj.at("param").get<std::string>();
      pp.split = pj.at("split").get<std::string>();
      pp.global_shape = pj.at("global_shape").get<std::vector<int64_t>>();
      pp.local_shape = pj.at("local_shape").get<std::vector<int64_t>>();
      p.params.push_back(std::move(pp));
    }
    // Estimates are informative: a plan without them (hand-written) still loads.
    if (j.contains("estimate")) {
      const auto& ej = j.at("estimate");
      auto& e = p.estimate;
      e.param_bytes = ej.value("param_bytes", 0.0);
      e.grad_bytes = ej.value("grad_bytes", 0.0);
      e.optim_bytes = ej.value("optim_bytes", 0.0);
      e.frozen_bytes = ej.value("frozen_bytes", 0.0);
      e.activation_bytes = ej.value("activation_bytes", 0.0);
      e.transient_bytes = ej.value("transient_bytes", 0.0);
      e.total_bytes = ej.value("total_bytes", 0.0);
      e.compute_s = ej.value("compute_s", 0.0);
      e.comm_s = ej.value("comm_s", 0.0);
      e.tp_comm_s = ej.value("tp_comm_s", 0.0);
      e.dp_comm_s = ej.value("dp_comm_s", 0.0);
      e.cp_comm_s = ej.value("cp_comm_s", 0.0);
      e.contention_s = ej.value("contention_s", 0.0);
      e.pp_comm_s = ej.value("pp_comm_s", 0.0);
      e.pp_bubble = ej.value("pp_bubble", 0.0);
      e.pp_rank_bytes = ej.value("pp_rank_bytes", std::vector<double>{});
      e.host_bytes = ej.value("host_bytes", 0.0);
      e.host_step_s = ej.value("host_step_s", 0.0);
      e.copy_s = ej.value("copy_s", 0.0);
      e.offload_s = ej.value("offload_s", 0.0);
      e.nvme_bytes = ej.value("nvme_bytes", 0.0);
      e.nvme_s = ej.value("nvme_s", 0.0);
      e.step_s = ej.value("step_s", 0.0);
      e.optim_step_s = ej.value("optim_step_s", 0.0);
      e.optim_elementwise_s = ej.value("optim_elementwise_s", 0.0);
      e.optim_matrix_s = ej.value("optim_matrix_s", 0.0);
      e.optim_exchange_s = ej.value("optim_exchange_s", 0.0);
      e.optim_matrix_flops = ej.value("optim_matrix_flops", 0.0);
      e.optim_gather_bytes = ej.value("optim_gather_bytes", 0.0);
      e.optim_scatter_bytes = ej.value("optim_scatter_bytes", 0.0);
      e.expert_bytes = ej.value("expert_bytes", 0.0);
      e.ep_comm_s = ej.value("ep_comm_s", 0.0);
      e.a2a_layer_s = ej.value("a2a_layer_s", 0.0);
      e.a2a_cross_node = ej.value("a2a_cross_node", false);
      e.moe_imbalance = ej.value("moe_imbalance", 0.0);
    }
    if (j.contains("optimizer")) {  // plans before the optimizer registry have none (AdamW)
      p.optimizer = j.at("optimizer").value("type", std::string("adamw"));
      p.optimizer_work = j.at("optimizer").value("work", std::string());
    }
    p.frozen = j.value("frozen", std::string());
    p.memory_budget_bytes = j.value("memory_budget_bytes", 0.0);
    p.device = j.value("device", std::string());
    p.micro_batch_size = j.value("micro_batch_size", int64_t{1});
    p.seq_len = j.value("seq_len", int64_t{0});
    p.grad_accumulation_steps = j.value("grad_accumulation_steps", int64_t{1});
    p.ep = j.value("ep", 1);
    if (j.contains("context")) {
      const auto& c = j.at("context");
      p.context.cp = c.at("cp").get<int>();
      p.context.comm_type = c.at("comm_type").get<std::string>();
      p.context.load_balance = c.at("load_balance").get<std::string>();
    }
    if (j.contains("pipeline")) {
      const auto& q = j.at("pipeline");
      p.pipeline.pp = q.at("pp").get<int>();
      p.pipeline.stages = q.at("stages").get<int>();
      p.pipeline.scheduler = q.at("scheduler").get<std::string>();
      p.pipeline.nmicros = q.at("nmicros").get<int64_t>();
      p.pipeline.stage_layers = q.at("stage_layers").get<std::vector<int>>();
      p.pipeline.post_validation = q.value("post_validation", false);
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("invalid plan JSON: ") + e.what());
  }
  const int cp = p.context.cp, pp = p.pipeline.pp;
  if (p.tp < 1 || p.dp < 1 || cp < 1 || pp < 1 || p.world != p.tp * cp * pp * p.dp)
    throw std::runtime_error("invalid plan JSON: world " + std::to_string(p.world) + " != tp " +
                             std::to_string(p.tp) + " x cp " + std::to_string(cp) + " x pp " + std::to_string(pp) +
                             " x dp " + std::to_string(p.dp));
}

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// "h.11.attn.c_attn.weight" -> "h.*.attn.c_attn.weight": numeric path components
// become "*" so identical layers fold into one line.
std::string fold_layers(const std::string& name) {
  std::string out, part;
  std::istringstream in(name);
  bool first = true;
  while (std::getline(in, part, '.')) {
    const bool numeric = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    out += (first ? "" : ".") + (numeric ? std::string("*") : part);
    first = false;
  }
  return out;
}

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

// "none", "all 12", or the layer ranges: "0-3 (4 of 12)".
std::string recompute_text(const std::vector<bool>& r) {
  int n = 0;
  for (bool b : r) n += b;
  if (n == 0) return "none (0 of " + std::to_string(r.size()) + " layers)";
  std::string ranges;
  for (size_t i = 0; i < r.size();) {
    if (!r[i]) { ++i; continue; }
    size_t k = i;
    while (k + 1 < r.size() && r[k + 1]) ++k;
    ranges += (ranges.empty() ? "" : ",") + std::to_string(i) + (k > i ? "-" + std::to_string(k) : "");
    i = k + 1;
  }
  return "layers " + ranges + " (" + std::to_string(n) + " of " + std::to_string(r.size()) + " layers)";
}

}  // namespace

std::string plan_summary(const Plan& p) {
  const auto& cx = p.context;
  const auto& q = p.pipeline;
  std::ostringstream o;
  o << "world " << p.world << " = tp " << p.tp << (cx.cp > 1 ? " x cp " + std::to_string(cx.cp) : std::string())
    << (q.pp > 1 ? " x pp " + std::to_string(q.pp) : std::string()) << " x dp " << p.dp << ", zero "
    << p.zero_stage;
  if (cx.cp > 1) o << ", cp " << cx.comm_type << " " << cx.load_balance;
  if (p.ep > 1) o << ", experts over ep " << p.ep << " (of dp x cp " << p.dp * cx.cp << ")";
  if (q.pp > 1) {
    std::string layers;
    for (int n : q.stage_layers) layers += (layers.empty() ? "" : "+") + std::to_string(n);
    o << ", pipeline " << q.scheduler << " " << q.stages << " stages (layers " << layers << ")";
  }
  o << ", recompute " << std::count(p.recompute.begin(), p.recompute.end(), true) << " of " << p.recompute.size()
    << " layers" << (p.offload_ratio > 0 ? ", offload " + util::fixed(100 * p.offload_ratio, 0) + "%" : std::string())
    << "; global batch " << p.micro_batch_size * p.grad_accumulation_steps * p.dp << " = micro "
    << p.micro_batch_size << " x accumulation " << p.grad_accumulation_steps << " x dp " << p.dp
    << (q.pp > 1 ? " (" + std::to_string(q.nmicros) + " micro-batches per pipeline flush)" : std::string())
    << "; estimate " << util::fixed(p.estimate.total_bytes / 1048576.0, 1) << " MiB per rank, "
    << util::fixed(p.estimate.step_s, 4) << " s per step";
  return o.str();
}

std::string describe(const Plan& p, bool explain) {
  std::ostringstream o;
  const auto& cx = p.context;
  const auto& q = p.pipeline;
  o << "plan: policy " << p.policy << ", world " << p.world << " = tp " << p.tp
    << (cx.cp > 1 ? " x cp " + std::to_string(cx.cp) : std::string())
    << (q.pp > 1 ? " x pp " + std::to_string(q.pp) : std::string()) << " x dp " << p.dp
    << ", zero " << (p.zero_stage ? "stage " + std::to_string(p.zero_stage) : std::string("off"));
  if (p.zero_stage && p.zero_ngroups > 1) o << " (" << p.zero_ngroups << " groups)";
  if (p.offload_ratio > 0 || p.offload_params)
    o << ", offload: optimizer " << (p.offload_ratio > 0 ? util::fixed(100 * p.offload_ratio, 0) + "%" : std::string("off"))
      << (p.offload_params ? ", params" : "") << (p.offload_nvme ? " (on NVMe)" : "");
  o << "\n  recompute: " << recompute_text(p.recompute) << "\n";
  const auto& e = p.estimate;
  if (e.moe_imbalance > 0) {
    o << "  experts: ";
    if (p.ep > 1)
      o << "each MoE layer's over ep " << p.ep << " ranks of dp x cp = " << p.dp * cx.cp << " (expert state reduced and "
        << "sharded over the " << p.dp * cx.cp / p.ep << " holding the same), tokens by all-to-all "
        << (e.a2a_cross_node ? "across nodes" : "within a node") << ": " << util::fixed(1e3 * e.a2a_layer_s, 3)
        << " ms per MoE layer per micro-batch (forward + backward), the busiest rank receiving " << util::fixed(e.moe_imbalance, 2)
        << " x the mean tokens";
    else
      o << "every rank holds every expert (ep 1: no all-to-all; the imbalance allowance " << util::fixed(e.moe_imbalance, 2)
        << " applies at ep > 1)";
    o << "; expert state " << format_bytes(e.expert_bytes) << " per rank\n";
  }
  if (cx.cp > 1)
    o << "  context parallel: each sequence over " << cx.cp << " ranks (" << cx.comm_type << " ring, "
      << (cx.load_balance == "zigzag" ? "zigzag chunks" : "contiguous chunks") << "); gradients reduced over dp x cp = "
      << p.dp * cx.cp << " ranks\n";
  if (q.pp > 1) {
    std::string split;
    for (size_t st = 0, first = 0; st < q.stage_layers.size(); ++st) {
      const size_t n = static_cast<size_t>(q.stage_layers[st]);
      split += (st ? ", " : "") + std::to_string(first) + (n > 1 ? "-" + std::to_string(first + n - 1) : "");
      first += n;
    }
    o << "  pipeline: " << q.stages << " stages over " << q.pp << " ranks"
      << (q.stages > q.pp ? " (" + std::to_string(q.stages / q.pp) + " per rank)" : std::string()) << ", schedule "
      << q.scheduler << ", " << q.nmicros << " micro-batches per step; predicted bubble "
      << util::fixed(100 * p.estimate.pp_bubble, 1) << "%"
      << (q.post_validation ? " (optimizer post-validation: consecutive steps overlapping, in steady state)"
                            : std::string())
      << "\n"
      << "  stage layers: " << split << " (embedding on stage 0, final norm and head on stage " << q.stages - 1
      << ")\n";
  }
  if (!p.frozen.empty()) o << "  trains: " << p.frozen << "\n";
  if (p.zero_stage == 3) {
    auto names = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& n : v) s += (s.empty() ? "" : ", ") + n;
      return s.empty() ? std::string("none") : s;
    };
    o << "  ZeRO-3 units: each block one; outside the blocks, before them: " << names(p.units_before_blocks)
      << "; after them: " << names(p.units_after_blocks) << "\n";
  }
  if (p.seq_len > 0)
    o << "  batch per rank: " << p.grad_accumulation_steps << " micro-batch"
      << (p.grad_accumulation_steps == 1 ? "" : "es") << " of " << p.micro_batch_size << " x " << p.seq_len
      << " tokens per step (global batch " << p.micro_batch_size * p.dp * p.grad_accumulation_steps
      << " sequences)\n";
  if (!p.device.empty()) o << "  device: " << p.device << "\n";

  // Parameters: identical layers folded, in first-appearance order.
  struct Group { std::string name, split; std::vector<int64_t> global, local; int count = 0; };
  std::vector<Group> groups;
  std::map<std::string, size_t> index;
  for (const auto& pp : p.params) {
    const std::string key = fold_layers(pp.param) + "|" + pp.split + "|" + shape_text(pp.global_shape) + "|" +
                            shape_text(pp.local_shape);
    auto it = index.find(key);
    if (it == index.end()) {
      index.emplace(key, groups.size());
      groups.push_back({fold_layers(pp.param), pp.split, pp.global_shape, pp.local_shape, 1});
    } else {
      ++groups[it->second].count;
    }
  }
  size_t width = 0;
  for (const auto& g : groups) width = std::max(width, g.name.size() + (g.count > 1 ? 6 : 0));
  o << "\nparameters (global -> on one tensor-parallel rank):\n";
  for (const auto& g : groups) {
    std::string name = g.name + (g.count > 1 ? " (x" + std::to_string(g.count) + ")" : "");
    o << "  " << pad(name, width + 1) << " " << pad(g.split, 9) << " " << shape_text(g.global);
    if (g.local != g.global) o << " -> " << shape_text(g.local);
    o << "\n";
  }

  o << "\nmemory per rank (estimated), device:\n";
  auto row = [&](const char* what, double bytes) { o << "  " << pad(what, 12) << format_bytes(bytes) << "\n"; };
  if (e.frozen_bytes > 0) row("frozen base", e.frozen_bytes);
  row("params", e.param_bytes);
  row("grads", e.grad_bytes);
  row("optimizer", e.optim_bytes);
  row("activations", e.activation_bytes);
  row("transient", e.transient_bytes);
  o << "  " << pad("total", 12) << format_bytes(e.total_bytes);
  if (p.memory_budget_bytes > 0)
    o << " of budget " << format_bytes(p.memory_budget_bytes) << " ("
      << util::fixed(100.0 * e.total_bytes / p.memory_budget_bytes, 1) << "%)";
  o << "\n  " << pad("host", 12) << format_bytes(e.host_bytes)
    << (p.offload_nvme         ? " (gradient copy and the NVMe tier's buffer)"
        : e.host_bytes > 0 ? " (offloaded weights, moments, gradient copy, staging)"
                           : " (no offload)") << "\n";
  if (p.offload_nvme)
    o << "  " << pad("nvme", 12) << format_bytes(e.nvme_bytes) << " (files: weights, moments"
      << (p.offload_params ? ", parameter chunks" : "") << ")\n";

  o << "\nstep time (estimated):\n";
  o << "  " << pad("compute", 12) << util::fixed(e.compute_s, 4) << " s\n";
  o << "  " << pad("comm", 12) << util::fixed(e.comm_s, 4) << " s (tensor parallel " << util::fixed(e.tp_comm_s, 4)
    << " s, data parallel exposed " << util::fixed(e.dp_comm_s, 4) << " s"
    << (cx.cp > 1 ? ", context parallel exposed " + util::fixed(e.cp_comm_s, 4) + " s" : std::string())
    << (q.pp > 1 ? ", pipeline transfers " + util::fixed(e.pp_comm_s, 4) + " s" : std::string())
    << (p.ep > 1 && e.moe_imbalance > 0 ? ", expert all-to-all " + util::fixed(e.ep_comm_s, 4) + " s" : std::string()) << ")\n";
  if (e.contention_s > 0)
    o << "  " << pad("", 12) << "of which contention " << util::fixed(e.contention_s, 4)
      << " s (compute slowed by the collectives it overlaps)\n";
  if (q.pp > 1) {
    // The busiest rank's idle (the step waits for it); lighter ranks idle more,
    // which the mean over ranks counts. max: rounding leaves -0.0000.
    const double bubble_s = std::max(0.0, e.step_s - e.compute_s - e.comm_s - e.offload_s - e.optim_step_s);
    o << "  " << pad("bubble", 12) << util::fixed(bubble_s, 4) << " s (the busiest rank's idle; "
      << util::fixed(100 * e.pp_bubble, 1) << "% of the pipeline idle on average over ranks, simulated)\n";
  }
  if (p.offload_ratio > 0 || p.offload_params)
    o << "  " << pad("offload", 12) << util::fixed(e.offload_s, 4) << " s exposed (host step " << util::fixed(e.host_step_s, 4)
      << " s, copies " << util::fixed(e.copy_s, 4) << " s"
      << (p.offload_nvme ? ", disk " + util::fixed(e.nvme_s, 4) + " s beside the host step" : std::string()) << ")\n";
  // The optimizer's share: its element-wise update, and a whole-matrix
  // optimizer's work on the busiest owner and its gather and scatter.
  o << "  " << pad("optimizer", 12) << util::fixed(e.optim_step_s, 4) << " s (" << p.optimizer << ", "
    << util::fixed(e.step_s > 0 ? 100 * e.optim_step_s / e.step_s : 0.0, 1) << "% of the step): ";
  if (e.optim_matrix_flops > 0 || e.optim_exchange_s > 0)
    o << (p.optimizer_work.empty() ? std::string("matrix work") : p.optimizer_work) << " " << util::fixed(e.optim_matrix_s, 4)
      << " s on the busiest owner ("
      << (e.optim_matrix_flops >= 1e9 ? util::fixed(e.optim_matrix_flops / 1e9, 2) + " GFLOP"
                                      : util::fixed(e.optim_matrix_flops / 1e6, 2) + " MFLOP")
      << "), gather and scatter "
      << util::fixed(e.optim_exchange_s, 4) << " s (" << format_bytes(e.optim_gather_bytes) << " + "
      << format_bytes(e.optim_scatter_bytes) << "), ";
  o << "element-wise " << util::fixed(e.optim_elementwise_s, 4) << " s"
    << (e.host_step_s > 0 ? " (the host's share is offload's)" : "") << "\n";
  o << "  " << pad("total", 12) << util::fixed(e.step_s, 4) << " s";
  if (e.step_s > 0 && p.seq_len > 0) {
    const double tokens = double(p.micro_batch_size) * p.seq_len * p.grad_accumulation_steps * p.dp;
    o << " (" << util::fixed(tokens / e.step_s, 0) << " tokens/s over all ranks)";
  }
  o << "\n";

  if (explain) {
    o << "\ncost model (docs/parallelism.md):\n"
      << "  compute = FLOPs per token (less causal attention's masked half) x tokens per rank / tp / (peak\n"
      << "    FLOP/s x " << util::fixed(kAssumedEfficiency, 2) << "), +1/3 of a layer's FLOPs per recomputed layer\n"
      << "  tensor parallel: 4 all-reduces of b x s x h per layer per micro-batch (2 more per recomputed\n"
      << "    layer, 2 for the vocab-parallel embedding and head), 2(t-1)/t x bytes / bandwidth, not overlapped\n"
      << "  data parallel: 2(d-1)/d x gradient bytes / bandwidth on the last micro-batch, overlapped with its\n"
      << "    backward except the last bucket; ZeRO-1/2 add the parameter all-gather after the optimizer step\n"
      << "    (ZeRO-2 reduce-scatters every micro-batch); ZeRO-3 gathers every unit for forward and again for\n"
      << "    backward, overlapped except the first gather and the last reduce-scatter\n"
      << "  contention: compute beside a collective (data parallel, ZeRO, the context-parallel ring) is\n"
      << "    slowed by " << util::fixed(100 * kOverlapContention, 1) << "% of the time they overlap (arXiv 2507.03114)\n"
      << "  memory: state by ZeRO stage + activations at the step's peak (backward's start or the last block's\n"
      << "    backward) + what lives only around it (a parameter's gradient, ZeRO-2 buckets, ZeRO-3 units)\n"
      << "  optimizer: element-wise, the state's elements x (weight, state tensors read and written, the\n"
      << "    gradient read) / device memory bandwidth; Muon adds per matrix ns_steps x (4 m^2 n + 2 m^3)\n"
      << "    FLOPs (m, n its short and long side) on its owner, owners dealt out largest first to the least\n"
      << "    loaded of the stage's tp x cp x dp ranks, and two all-to-alls over them (each matrix's pieces\n"
      << "    its owner lacks; its update back to every other holder), in ns_dtype, not overlapped\n"
      << "  offload: host step = optimizer bytes / host AdamW rate, exposed in full; gradients to the host\n"
      << "    overlap backward, weights back overlap the host step but its last bucket; parameter offload\n"
      << "    copies each unit's chunk to the device with its gather\n"
      << "  context parallel: tokens per rank / cp; K/V round a ring (p2p, exposed beyond each block's\n"
      << "    attention) or gathered (all_gather, exposed); gradients reduced over dp x cp\n"
      << "  pipeline: the schedule simulated with per-stage F, B (I, W) times; memory of the busiest rank:\n"
      << "    its stages' state and the activations of the micro-batches it holds at its peak\n"
      << "  choice: per split and recompute the least ZeRO stage that fits; the smallest tp without cp, pp or\n"
      << "    recompute if any stage fits there, else the fastest; cp only when nothing fits without it,\n"
      << "    offload only when no plan without it fits\n";
    if (e.moe_imbalance > 0)
      o << "  experts (MoE): compute counts the active experts (top-k and shared); expert parameters are E / ep\n"
        << "    per rank, whole on every tp rank, ZeRO-sharded over dp x cp / ep; per MoE layer per micro-batch\n"
        << "    a counts exchange and 2 all-to-alls forward, 2 backward, each of tokens x top-k x h x (ep-1)/ep\n"
        << "    bytes (NVLink within a node, the NIC for members on other nodes), not overlapped; the busiest ep\n"
        << "    rank gets " << util::fixed(e.moe_imbalance, 2)
        << " x the mean tokens (compute_config.moe_imbalance) in its expert compute, activations\n"
        << "    and all-to-all; ep is chosen by speed among the sizes dividing dp x cp and the experts\n";
  }
  return o.str();
}

}  // namespace nnstrain::parallel
