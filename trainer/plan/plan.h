// Plan: how one run is split over its ranks. Produced by the planner
// (planner.h) from the config, the model's split declaration and a cost model;
// applied by trainer/state, trainer/pipeline and the loop; printed by `nnstrain plan`; saved in checkpoints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nnstrain::parallel {

struct ParamPlan {
  std::string param;       // parameter name
  std::string split;       // replicate | column | row | vocab
  std::vector<int64_t> global_shape;
  std::vector<int64_t> local_shape;  // on one tensor-parallel rank
};

// Per-rank estimates, bytes and seconds.
struct PlanEstimate {
  double param_bytes = 0, grad_bytes = 0, optim_bytes = 0, activation_bytes = 0, transient_bytes = 0;
  double frozen_bytes = 0;  // a frozen base's weights (LoRA), outside the training state
  double total_bytes = 0;
  double compute_s = 0, comm_s = 0, step_s = 0;
  double tp_comm_s = 0, dp_comm_s = 0;  // comm_s = tp_comm_s + dp_comm_s (exposed part of DP/ZeRO)
                                        //   + cp_comm_s + pp_comm_s + ep_comm_s
  double cp_comm_s = 0;                 // context parallel: the ring's exposed transfers
  // Of dp_comm_s and cp_comm_s: the compute slowed by the collectives it
  // overlaps (kOverlapContention of their overlapped time).
  double contention_s = 0;
  double pp_comm_s = 0;                 // pipeline: activation and gradient transfers between stages
  double pp_bubble = 0;                 // pipeline: the schedule's idle fraction (simulated)
  // Pipeline: each pipeline rank's total_bytes (the figures above are the
  // largest's), to set beside metrics' peak_tensor_mb_per_pp_rank.
  std::vector<double> pp_rank_bytes;
  // Offload: host memory per rank (not in total_bytes, which is the device's),
  // the CPU step and the copies per step, and what of them is exposed (in step_s).
  double host_bytes = 0;
  double host_step_s = 0, copy_s = 0, offload_s = 0;
  // The NVMe tier: bytes of files per rank and its disk I/O per step (overlapping the host step).
  double nvme_bytes = 0, nvme_s = 0;
  // Mixture-of-Experts (zero for a dense model): the expert parameters'
  // state on this rank (params, grads, optimizer; in the figures above too),
  // the all-to-all's exposed time per step (in comm_s) and per MoE layer per
  // micro-batch (forward + backward), and the imbalance allowance assumed.
  double expert_bytes = 0;
  double ep_comm_s = 0, a2a_layer_s = 0;
  bool a2a_cross_node = false;
  double moe_imbalance = 0;
  // The optimizer's step on the device (optim_step_s, in step_s; under pp the
  // slowest pipeline rank's): the element-wise update of this rank's state and,
  // for a whole-matrix optimizer (Muon), the busiest owner's matrix work
  // (optim_matrix_flops of it) and the stage's two all-to-alls, gather and
  // scatter (their bytes: the most any rank of the stage sends or receives in each).
  // Its transient buffers (exchange, Newton-Schulz) are a peak moment of their own.
  double optim_step_s = 0, optim_elementwise_s = 0, optim_matrix_s = 0, optim_exchange_s = 0;
  double optim_matrix_flops = 0, optim_gather_bytes = 0, optim_scatter_bytes = 0;
};

// Context parallelism: ranks splitting one sequence (compute_config.context_parallel_size).
struct ContextPlan {
  int cp = 1;
  std::string comm_type = "p2p";      // p2p | all_gather
  std::string load_balance = "zigzag";  // zigzag | none
};

// Pipeline parallelism: layers split into stages over pp ranks
// (compute_config.pas_config.pipeline_*).
struct PipelinePlan {
  int pp = 1;                       // pipeline ranks
  int stages = 1;                   // pipeline stages (> pp: virtual stages per rank)
  std::string scheduler = "1f1b";   // gpipe | 1f1b | 1f1b_interleaved | zb1p | zbv
  int64_t nmicros = 1;              // micro-batches in flight per step (one pipeline flush)
  std::vector<int> stage_layers;    // model layers per stage (sums to the layer count)
  bool post_validation = false;     // pas_config.pipeline_post_validation: steps overlap (the estimate's steady state)
};

struct Plan {
  std::string policy;            // the pas_policy that produced it
  // world = tp x cp x pp x dp; ranks laid out TP innermost, then CP, PP, DP.
  int world = 1, tp = 1, dp = 1;
  ContextPlan context;
  PipelinePlan pipeline;
  int zero_stage = 0;            // ZeRO: 0 off, 1 optimizer, 2 + gradients, 3 + parameters
  int zero_ngroups = 1;
  int ep = 1;                    // expert parallelism: MoE experts split over ep ranks of dp x cp
  // Offload to host memory (compute_config.offload, or chosen by autodist):
  // the optimizer's share on the host (0: none) and ZeRO-3's parameter chunks.
  double offload_ratio = 0;
  bool offload_params = false;
  bool offload_nvme = false;  // the offloaded state on NVMe (ZeRO-Infinity), not in host memory
  std::vector<bool> recompute;   // per model layer
  // ZeRO-3: the parameters outside the blocks, in the units before and after them
  // (each block is a unit of its own).
  std::vector<std::string> units_before_blocks, units_after_blocks;
  std::vector<ParamPlan> params;
  PlanEstimate estimate;
  double memory_budget_bytes = 0;
  // What the estimate assumed: the device table entry, the per-rank batch.
  std::string device;
  // The optimizer (optimizer.type) and its matrix work, if any
  // (OptimizerEntry::cost: "Newton-Schulz (5 steps, bf16)").
  std::string optimizer = "adamw", optimizer_work;
  std::string frozen;  // a frozen base (LoRA: ModelFacts::frozen_what); empty: every weight trains
  int64_t micro_batch_size = 1, seq_len = 0;
  int64_t grad_accumulation_steps = 1;  // per rank per step: global batch / (micro x dp)
};

void to_json(nlohmann::json& j, const Plan& p);
void from_json(const nlohmann::json& j, Plan& p);

// Human-readable: the plan, each parameter's split (identical layers folded,
// e.g. "h.*.attn.c_attn.weight"), per-rank memory and step time; explain adds
// the cost model's assumptions. Deterministic.
std::string describe(const Plan& p, bool explain = false);

// One line for the run's log: the split, ZeRO, the pipeline and context
// choices, and the batch arithmetic derived from the plan (global batch =
// micro x accumulation x dp).
std::string plan_summary(const Plan& p);

}  // namespace nnstrain::parallel
