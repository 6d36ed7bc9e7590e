#include "trainer/cli/plan_command.h"

#include "trainer/optim/precision.h"
#include "trainer/state/training_state.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "data/indexed/config_check.h"
#include "models/model.h"
#include "models/common/sharding.h"
#include "models/registry.h"
#include "trainer/optim/registry.h"
#include "base/text.h"
#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "trainer/pipeline/config_check.h"
#include "trainer/offload/nvme_store.h"
#include "trainer/plan/plan.h"
#include "trainer/pipeline/schedule.h"
#include "trainer/plan/planner.h"
#include "trainer/lora/converter.h"

namespace nnstrain::cli {

namespace {

constexpr const char* kPlanUsage =
    R"(nnstrain plan --config FILE [--runtime-ngpus N] [--device NAME] [--memory-budget-gb X]
              [--host-memory-gb X] [--probe-disk PATH] [--explain] [--json] [--key.path value ...]

Prints the plan for the config: tensor-, context-, pipeline- and data-parallel
sizes, ZeRO, activation recompute per layer, the pipeline's stages, schedule
and bubble, each parameter's split, per-rank memory and the estimated step
time. Under autodist it may choose context and pipeline parallelism, as the
trainer does for the same config and world size (a context_parallel_size or
pas_config.pp_size the config names stays). Nothing is trained and no weights
are allocated.

  --runtime-ngpus N       total ranks (default: compute_config.runtime_ngpus, else 1)
  --device NAME           H100 | H200 | A100-80G | A100-40G | cpu | auto
                          (default: compute_config.device; auto = CUDA device 0, else cpu)
  --memory-budget-gb X    per-rank budget in GiB (default: compute_config.memory_budget_gb,
                          else 90% of the device memory)
  --host-memory-gb X      host memory per node in GiB: plans whose ranks keep more there do not fit
                          (default: not checked)
  --probe-disk PATH       measure the sequential write and read rates of the disk holding PATH
                          (a folder; 1 GiB written and read back, as the NVMe tier does it) and
                          let autodist offload to NVMe (ZeRO-Infinity) when nothing else fits
  --explain               also list every rejected candidate and why
  --json                  print {"plan": ..., "rejected": [...]} as JSON instead
)";

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;


std::string count_text(double n) {
  if (n >= 1e9) return util::fixed(n / 1e9, 2) + "B";
  if (n >= 1e6) return util::fixed(n / 1e6, 2) + "M";
  if (n >= 1e3) return util::fixed(n / 1e3, 1) + "K";
  return util::fixed(n, 0);
}

// The schedule's action grid (stage.micro per rank), each row cut at a
// terminal's width once the micro-batches repeat the steady state.
std::string pipeline_grid(const parallel::PipelinePlan& q) {
  const auto s = parallel::pipeline::make_schedule(q.scheduler, q.pp, q.stages, static_cast<int>(q.nmicros));
  std::string out = "\nschedule " + q.scheduler + ": " + std::to_string(q.pp) + " ranks, " + std::to_string(q.stages) +
                    " stages, " + std::to_string(q.nmicros) + " micro-batches (F forward, B backward, I/W its " +
                    "input/weight halves; STAGE.MICRO):\n";
  constexpr size_t kWidth = 160;
  std::istringstream rows(parallel::pipeline::grid(s));
  for (std::string row; std::getline(rows, row);)
    out += (row.size() > kWidth ? row.substr(0, row.rfind(' ', kWidth)) + " ..." : row) + "\n";
  return out;
}

}  // namespace

std::shared_ptr<models::CausalLM> build_model_for_planning(const config::TrainerArgs& args) {
  const auto* entry = models::find_model(args.model.type);
  if (!entry) throw config::ConfigError("model.type: unknown model type '" + args.model.type + "'");
  if (!args.model.args) throw config::ConfigError("model.args: not parsed (no model catalog given to the loader)");
  // On meta: shapes only, planning a 1.3B model allocates nothing.
  models::common::ShardingContext meta;
  meta.options = meta.options.device(c10::kMeta);
  return entry->build_sharded(*args.model.args, meta);
}

int plan_main(const std::vector<std::string>& args) { return plan_main(args, std::cout, std::cerr); }

int plan_main(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  std::string config_file, device_name;
  int runtime_ngpus = 0;
  double budget_gb = -1;
  double host_gb = 0;
  std::string probe_path;
  bool explain = false, json = false;
  std::vector<std::string> rest;
  auto value = [&](size_t& i, const std::string& flag, std::string& into) {
    const auto& a = argv[i];
    if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) {
      into = a.substr(flag.size() + 1);
      return true;
    }
    if (a != flag) return false;
    if (i + 1 >= argv.size()) throw config::ConfigError(flag + " needs a value");
    into = argv[++i];
    return true;
  };
  auto number = [](const std::string& flag, const std::string& text) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != text.size() || text.empty() || !std::isfinite(v))
      throw config::ConfigError(flag + ": expected a number, got '" + text + "'");
    return v;
  };

  config::TrainerArgs targs;
  try {
    for (size_t i = 0; i < argv.size(); ++i) {
      std::string v;
      if (argv[i] == "-h" || argv[i] == "--help") {
        out << kPlanUsage;
        return 0;
      } else if (argv[i] == "--explain") {
        explain = true;
      } else if (argv[i] == "--json") {
        json = true;
      } else if (value(i, "--config", v)) {
        config_file = v;
      } else if (value(i, "--device", v)) {
        device_name = v;
      } else if (value(i, "--runtime-ngpus", v)) {
        const double n = number("--runtime-ngpus", v);
        if (n < 1 || n != std::floor(n) || n > (1 << 20))
          throw config::ConfigError("--runtime-ngpus: expected a positive integer, got '" + v + "'");
        runtime_ngpus = static_cast<int>(n);
      } else if (value(i, "--host-memory-gb", v)) {
        host_gb = number("--host-memory-gb", v);
        if (host_gb <= 0) throw config::ConfigError("--host-memory-gb: must be > 0, got '" + v + "'");
      } else if (value(i, "--probe-disk", v)) {
        probe_path = v;
      } else if (value(i, "--memory-budget-gb", v)) {
        budget_gb = number("--memory-budget-gb", v);
        if (budget_gb <= 0) throw config::ConfigError("--memory-budget-gb: must be > 0, got '" + v + "'");
      } else {
        rest.push_back(argv[i]);
      }
    }
    if (config_file.empty()) {
      err << "nnstrain plan: missing --config FILE\n\n" << kPlanUsage;
      return 2;
    }
    config::LoadOptions lo;
    lo.overrides = config::parse_overrides(rest);
    if (runtime_ngpus > 0) lo.overrides.push_back({"compute_config.runtime_ngpus", std::to_string(runtime_ngpus)});
    lo.models = models::model_catalog();
    lo.optimizers = optim::optimizer_catalog();
    lo.checks = {parallel::pipeline::check_config_schedule, indexed::check_config_datasets};
    lo.world_size = runtime_ngpus > 0 ? runtime_ngpus : 1;
    lo.check_files = false;            // planning reads no data
    lo.reject_unimplemented = false;   // plan setups the trainer cannot run yet
    targs = config::load_trainer_args(config_file, lo);
  } catch (const config::ConfigError& e) {
    err << "nnstrain plan: config error: " << e.what() << "\n";
    return 2;
  }

  try {
    const auto& cc = targs.compute_config;
    parallel::PlanRequest req;
    req.args = &targs;
    req.world_size = cc.runtime_ngpus;
    req.device = parallel::device_spec(device_name.empty() ? cc.device : device_name);
    req.device.host_memory_bytes = host_gb * kGiB;
    parallel::DiskProbe disk;
    if (!probe_path.empty()) {
      try {
        disk = parallel::probe_disk(probe_path, int64_t(1) << 30);
      } catch (const parallel::NvmeError& e) {
        err << "nnstrain plan: " << e.what() << "\n";
        return 2;
      }
      req.device.disk_read_bw = disk.read_bytes_per_s;
      req.device.disk_write_bw = disk.write_bytes_per_s;
    }
    const double gb = budget_gb > 0 ? budget_gb : cc.memory_budget_gb;
    req.memory_budget_bytes = gb * kGiB;
    // Autodist may choose every dimension, as in the trainer (train/startup.cpp decide_plan).
    req.search_pipeline = req.search_context = true;
    const auto model = build_model_for_planning(targs);
    req.model = model.get();
    if (targs.lora.enabled) {  // as the trainer plans it (train/startup.cpp decide_plan)
      const auto base = optim::precision_setup(targs.precision, cc.reduce_dtype).param;
      req.adjust_facts = [&targs, &model, base](parallel::ModelFacts& f) {
        lora::lora_plan_facts(*model, targs.lora, base, f);
      };
    }

    std::vector<parallel::Rejected> rejected;
    const auto plan = parallel::make_plan(req, &rejected);
    const auto dims = model->dims();
    double numel = 0;
    for (const auto& p : model->named_parameters()) numel += double(p.value().numel());

    if (json) {
      nlohmann::json j;
      j["plan"] = plan;
      if (explain) {
        nlohmann::json rj = nlohmann::json::array();
        for (const auto& r : rejected)
          rj.push_back({{"candidate", r.candidate},
                        {"kind", r.kind},
                        {"reason", r.reason},
                        {"tp", r.cand.tp},
                        {"dp", r.cand.dp},
                        {"zero", r.cand.zero_stage},
                        {"recompute_layers", r.cand.recompute_layers},
                        {"cp", r.cand.cp},
                        {"cp_comm_type", r.cand.cp_comm},
                        {"pp", r.cand.pp},
                        {"stages", r.cand.stages},
                        {"scheduler", r.cand.scheduler},
                        {"ep", r.cand.ep},
                        {"memory_bytes", r.memory_bytes},
                        {"step_s", r.step_s}});
        j["rejected"] = rj;
      }
      {
        const auto ps = optim::precision_setup(targs.precision, cc.reduce_dtype);
        const auto sb = parallel::state_bytes(ps.param, ps.grad, ps.master_weights);
        j["state_bytes_per_param"] = {{"total", sb.total()}, {"param", sb.param}, {"grad", sb.grad},
                                      {"master", sb.master}, {"moments", sb.moments}};
      }
      out << j.dump(2) << "\n";
      return 0;
    }

    const auto& d = req.device;
    const double peak = parallel::peak_flops_for(d, targs.precision, cc.allow_tf32);
    out << "config: " << config_file << "\n";
    out << "model: " << targs.model.type << ", " << count_text(numel) << " parameters (" << dims.layers
        << " layers, hidden " << dims.hidden << ", " << dims.heads << " heads";
    if (dims.kv_heads != dims.heads) out << " / " << dims.kv_heads << " kv";
    out << ", ffn " << dims.ffn << ", vocab " << dims.vocab << ")\n";
    out << "run: " << cc.runtime_ngpus << " rank" << (cc.runtime_ngpus == 1 ? "" : "s") << ", plan_ngpus "
        << cc.plan_ngpus << ", precision " << targs.precision << ", micro_batch_size " << targs.micro_batch_size
        << ", seq_len " << plan.seq_len << ", global batch " << targs.global_batch_size << "\n";
    {
      const auto ps = optim::precision_setup(targs.precision, cc.reduce_dtype);
      const auto sb = parallel::state_bytes(ps.param, ps.grad, ps.master_weights);
      out << "state bytes/param (" << targs.precision << ", before ZeRO): " << util::fixed(sb.total(), 2) << " (param "
          << util::fixed(sb.param, 2) << ", grad " << util::fixed(sb.grad, 2) << ", master " << util::fixed(sb.master, 2)
          << ", moments " << util::fixed(sb.moments, 2) << ")";
      // The header's moments are AdamW's two; another optimizer's state is in the estimate below.
      if (targs.optimizer.type != "adamw")
        out << "; moments as AdamW's, the memory estimate counts optimizer " << targs.optimizer.type << "'s state";
      out << "\n";
    }
    out << "device: " << d.name << ": " << parallel::format_bytes(d.memory_bytes) << ", " << util::fixed(peak / 1e12, 1)
        << " TFLOP/s peak for " << targs.precision << (targs.precision.rfind("32", 0) == 0 && cc.allow_tf32 ? " (tf32)" : "")
        << ", " << util::fixed(d.intra_node_bw / 1e9, 0) << " GB/s within a node, " << util::fixed(d.inter_node_bw / 1e9, 2)
        << " GB/s between nodes, " << d.ranks_per_node << " ranks per node\n";
    if (d.host_memory_bytes > 0) out << "host: " << parallel::format_bytes(d.host_memory_bytes) << " per node\n";
    if (!probe_path.empty())
      out << "disk: " << probe_path << ": write " << util::fixed(disk.write_bytes_per_s / 1e9, 2) << " GB/s, read "
          << util::fixed(disk.read_bytes_per_s / 1e9, 2) << " GB/s per node (" << parallel::format_bytes(double(disk.bytes))
          << " probed, " << disk.engine << (disk.direct_io ? ", O_DIRECT" : ", buffered") << ")\n";
    out << "\n";
    out << parallel::describe(plan, explain);
    if (plan.pipeline.pp > 1) out << pipeline_grid(plan.pipeline);
    if (explain) {
      out << "\nrejected candidates (" << rejected.size() << "):\n";
      out << parallel::describe_rejected(rejected, static_cast<int>(plan.recompute.size()));
    }
    return 0;
  } catch (const parallel::PlanError& e) {
    err << "nnstrain plan: " << (e.config ? "config error: " : "") << e.what() << "\n";
    return e.config ? 2 : 1;
  } catch (const config::ConfigError& e) {
    err << "nnstrain plan: config error: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace nnstrain::cli
