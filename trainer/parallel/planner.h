// The built-in planner: a pure function from (config, model declaration, world
// size, device) to a Plan. It enumerates candidates (tensor-parallel degree,
// ZeRO stage 0-3, activation recompute of the first k layers) and estimates
// each one's per-rank memory and step time with the cost model documented in
// docs/parallelism.md. For each (tp, recompute) it takes the least ZeRO stage
// that fits the memory budget; at the smallest tp without recompute that is
// the plan, else the fastest of them. Deterministic: ties go to the smaller
// tp, then less recompute. Offload (optimizer, then also parameters) adds
// terms to the same cost model; autodist considers it only when no candidate
// without it fits.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "base/config/trainer_args.h"
#include "trainer/parallel/plan.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::parallel {

// A plan that cannot be made: an infeasible split, a policy that does not fit
// the world, or a budget no candidate fits (min_bytes: the least memory any
// candidate needs per rank; 0 when memory is not the reason).
class PlanError : public std::runtime_error {
 public:
  explicit PlanError(const std::string& what, double min_bytes = 0)
      : std::runtime_error(what), min_bytes(min_bytes) {}
  double min_bytes;
};

// What the cost model knows about an accelerator. FLOP/s are dense peaks;
// bandwidths are the bus bandwidth one rank gets in a ring collective, bytes/s.
struct DeviceSpec {
  std::string name;
  double memory_bytes = 0;
  double peak_flops = 0;        // bf16/fp16 tensor cores
  double peak_flops_tf32 = 0;   // fp32 matmuls on tensor cores (compute_config.allow_tf32)
  double peak_flops_fp32 = 0;   // fp32 without tensor cores
  double intra_node_bw = 0;
  double inter_node_bw = 0;
  int ranks_per_node = 8;
  double collective_latency_s = 20e-6;  // fixed cost of one collective (the alpha of alpha-beta)
  // Offload: bytes/s each way between a rank's device and host memory (PCIe;
  // on cpu a memory copy), and what the host's fused AdamW gets through per
  // rank (bytes of weights, moments and gradient read and written per second).
  double host_link_bw = 25e9;
  double host_adam_bytes_per_s = 10e9;
};

// H100, H200, A100-80G, A100-40G, cpu (case-insensitive), or auto / cuda: CUDA
// device 0 if present (matched by name, memory as reported), else cpu.
// Throws PlanError naming the known devices for anything else.
DeviceSpec device_spec(const std::string& name_or_auto);
std::vector<std::string> known_devices();

// The FLOP/s the cost model uses for `precision` on `device`.
double peak_flops_for(const DeviceSpec& device, const std::string& precision, bool allow_tf32);

struct PlanRequest {
  const config::TrainerArgs* args = nullptr;
  const models::CausalLM* model = nullptr;  // only its declarations and parameter shapes are read
  int world_size = 1;
  DeviceSpec device;
  double memory_budget_bytes = 0;  // 0: kDefaultMemoryFraction of device memory
  // Attention via a fused kernel (SDPA: flash / memory-efficient) keeps no
  // [heads, s, s] scores, so Megatron's 5as/h activation term is dropped.
  bool fused_attention = true;
};

constexpr double kDefaultMemoryFraction = 0.9;
constexpr double kAssumedEfficiency = 0.5;  // achieved / peak FLOP/s

// One point of the search space.
struct Candidate {
  int tp = 1, dp = 1;
  int zero_stage = 0;
  int recompute_layers = 0;  // the first k layers recompute their activations
  double offload_ratio = 0;  // the optimizer's share on the host (compute_config.offload, docs/parallelism.md)
  bool offload_params = false;
};

// A candidate the planner did not take, and why.
struct Rejected {
  std::string candidate;  // e.g. "tp=2 dp=4 zero=0 recompute=3/12"
  std::string reason;     // with the numbers
  // Structured for tests and --json: kind is infeasible | memory (over the
  // budget) | sharding (fits, but a lower ZeRO stage fits at the same tp and
  // recompute) | order (fits, but the plan needed neither more tp nor more
  // recompute) | slower (fits, but the plan is faster).
  std::string kind;
  Candidate cand;
  double memory_bytes = 0, step_s = 0;  // its estimate (0 when infeasible)
};

// The budget a request resolves to, bytes per rank.
double memory_budget(const PlanRequest& req);

// The cost model for one candidate (no feasibility checks beyond arithmetic).
PlanEstimate estimate(const PlanRequest& req, const Candidate& c);

// The plan for req. Throws PlanError with the numbers. rejected, if given,
// receives every candidate that was considered and not chosen, in search order.
Plan make_plan(const PlanRequest& req, std::vector<Rejected>* rejected = nullptr);

// Refuses, with the numbers, a tp the model's split declaration cannot take:
// heads, kv heads, ffn, vocabulary or hidden not divisible by tp, and every
// declared column/row/vocab split whose dimension (or fused part) is not a
// multiple of tp x unit. Throws PlanError listing every failure.
void check_tp_feasible(const models::CausalLM& model, int tp);

// Rejected candidates, consecutive recompute counts with the same verdict
// folded into one line. One line per entry, ending in a newline.
std::string describe_rejected(const std::vector<Rejected>& rejected, int layers);

// "12.3 GiB", "512.0 MiB": bytes in binary units for messages.
std::string format_bytes(double bytes);

}  // namespace nnstrain::parallel
