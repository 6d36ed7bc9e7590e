// The planner's cost model: what one candidate split costs per rank, in bytes
// at the step's peak and in seconds per step. It knows the device (a table of
// accelerators), the model (its declared splits and dimensions) and the
// config; it chooses nothing (the search, planner.h, does). Each parallel
// dimension is a term of its own, listed once in cost_model.cpp's table
// (cost::cost_terms) and written in trainer/plan/cost/, a file per family:
// the state under ZeRO, offload's memory, post-validation's backup, the
// step's peak (activations under tensor/sequence parallelism and recompute,
// the loss, the sharding's transients), compute, tensor-, context-, data- and
// expert-parallel communication, the pipeline's bubble (the schedule
// simulation), offload's time, the optimizer's step as its registry entry
// prices it. A new dimension adds a term (a row and its file), not a branch.
// docs/parallelism.md derives each term; trainer/plan/README.md maps the files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/config/trainer_args.h"
#include "models/common/sharding.h"
#include "models/model_dims.h"
#include "trainer/optim/step_cost.h"
#include "trainer/plan/plan.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::parallel {

// A plan that cannot be made: an infeasible split, a policy that does not fit
// the world, or a budget no candidate fits (min_bytes: the least memory any
// candidate needs per rank; 0 when memory is not the reason). config: the
// config's own keys are the error (no split of the world fits its batch
// arithmetic), so the trainer exits 2 as for any config error.
class PlanError : public std::runtime_error {
 public:
  explicit PlanError(const std::string& what, double min_bytes = 0, bool config = false)
      : std::runtime_error(what), min_bytes(min_bytes), config(config) {}
  double min_bytes;
  bool config;
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
  // The device memory's bandwidth, bytes/s: what an element-wise optimizer
  // step (reading and writing weights and state, reading the gradient) runs at.
  double memory_bw = 2e12;
  // The NVMe tier, per node (its ranks share them): host memory (0: not
  // checked) and the disk's sequential read and write rates (0: no NVMe
  // tier), as `nnstrain plan --probe-disk PATH --host-memory-gb X` measures and sets them.
  double host_memory_bytes = 0, disk_read_bw = 0, disk_write_bw = 0;
};

// H100, H200, A100-80G, A100-40G, cpu (case-insensitive), or auto / cuda: CUDA
// device 0 if present (matched by name, memory as reported), else cpu.
// Throws PlanError naming the known devices for anything else.
DeviceSpec device_spec(const std::string& name_or_auto);
std::vector<std::string> known_devices();

// The FLOP/s the cost model uses for `precision` on `device`.
double peak_flops_for(const DeviceSpec& device, const std::string& precision, bool allow_tf32);

struct ModelFacts;

struct PlanRequest {
  const config::TrainerArgs* args = nullptr;
  const models::CausalLM* model = nullptr;  // only its declarations and parameter shapes are read
  int world_size = 1;
  DeviceSpec device;
  double memory_budget_bytes = 0;  // 0: kDefaultMemoryFraction of device memory
  // Attention via a fused kernel (SDPA: flash / memory-efficient) keeps no
  // [heads, s, s] scores, so Megatron's 5as/h activation term is dropped.
  bool fused_attention = true;
  // Whether autodist may choose pipeline (pp > 1) and context (cp > 1)
  // parallelism itself. `nnstrain plan` and the trainer set both (a size the
  // config names is planned either way); off, the search keeps pp = cp = 1.
  bool search_pipeline = false, search_context = false;
  // Mixture-of-Experts: the busiest expert-parallel rank receives this many
  // times the mean tokens (0: compute_config.moe_imbalance, default 1.25).
  double moe_imbalance = 0;
  // A model converter's say in the facts (LoRA: trainer/lora/converter.h
  // lora_plan_facts marks the frozen base and adds the adapters), applied to
  // model_facts(*model) before any estimate. Empty: the model as built.
  std::function<void(ModelFacts&)> adjust_facts;
};

constexpr double kDefaultMemoryFraction = 0.9;
constexpr double kAssumedEfficiency = 0.5;  // achieved / peak FLOP/s
// Compute running beside a collective is slower than alone: the collective's
// kernels hold SMs (on cpu, Gloo's threads hold cores) and share memory
// bandwidth. Overlapped communication is charged this fraction of the time it
// overlaps (the compute slowdown Lee et al. measured, arXiv 2507.03114: 18.9%
// on average over H100, A100, MI250 and MI210). Copies to and from the host
// run on copy engines and are not charged.
constexpr double kOverlapContention = 0.189;

// The budget a request resolves to, bytes per rank.
double memory_budget(const PlanRequest& req);

// The imbalance allowance a request resolves to (>= 1).
double moe_imbalance(const PlanRequest& req);

// One point of the search space. Ranks are laid out TP innermost, then CP,
// PP, DP: world = tp x cp x pp x dp. Expert parallelism carves ep ranks out of
// dp x cp (consecutive members, cp innermost).
struct Candidate {
  int tp = 1, dp = 1;
  int zero_stage = 0;
  int recompute_layers = 0;  // the first k layers recompute (under pp: the first k of every stage)
  double offload_ratio = 0;  // the optimizer's share on the host (compute_config.offload, docs/parallelism.md)
  bool offload_params = false;
  bool offload_nvme = false;  // the offloaded state in files (compute_config.offload: nvme), not host memory
  // Context parallelism: ranks splitting one sequence, and how K/V travel.
  int cp = 1;
  std::string cp_comm = "p2p";         // p2p | all_gather
  std::string cp_balance = "zigzag";  // zigzag | none
  // Pipeline parallelism: pp ranks running `stages` stages (more: virtual
  // stages) in `scheduler`'s order; stage_layers[s] model layers in stage s.
  // The micro-batches in flight are the step's: global batch / (micro x dp).
  int pp = 1, stages = 1;
  std::string scheduler = "1f1b";
  std::vector<int> stage_layers;
  // Expert parallelism: each MoE layer's experts over ep ranks of dp x cp;
  // expert state reduced and ZeRO-sharded over the dp x cp / ep holding the same.
  int ep = 1;
};

// "tp=2 dp=4 zero=0 recompute=3/12" (cp, pp and offload named when used).
std::string candidate_text(const Candidate& c, int64_t layers);
std::string split_text(const Candidate& c);  // " cp=2:p2p pp=4:1f1b/4 ep=8", or empty
std::string offload_text(const Candidate& c);  // " offload=optimizer:0.5+params", or empty

// ---- the model as the cost model sees it -----------------------------------

struct ParamFact {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  models::ParamSplit split;  // style Replicate when not declared
  int unit = -1;             // the block it belongs to (CausalLM::block_of); -1 outside blocks
  // A frozen weight (LoRA's base, trainer/lora): held as a buffer at this many
  // bytes per element (the compute dtype, or NF4's codes and scales), outside
  // the training state: no gradient, master, optimizer state or ZeRO sharding.
  // 0: a trained parameter.
  double frozen_bytes = 0;
  bool frozen() const { return frozen_bytes > 0; }
};

struct ModelFacts {
  models::ModelDims dims;
  int64_t layers = 0;
  std::vector<ParamFact> params;
  bool vocab_parallel_head = false;  // some Vocab split is declared
  bool gated_mlp = false;            // Llama-style blocks (RMSNorm, SwiGLU: a gate_proj), else GPT-style
  std::vector<int> zero3_units;      // per parameter, as the training state's (parameter_units)
  int zero3_head_unit = 0;           // the unit after the blocks
  // The model's training FLOPs per token at a sequence length (CausalLM::
  // flops_per_token; for an MoE model it counts the active experts: top-k of
  // the routed ones and the shared ones).
  std::function<double(int64_t)> flops_per_token;
  int64_t experts = 0;  // routed experts per MoE layer (0: dense), from the dims or the Expert splits
  // LoRA (PlanRequest::adjust_facts): per token, the weight-gradient FLOPs the
  // frozen base's matmuls skip, and the adapters' own training FLOPs.
  double frozen_weight_grad_flops = 0, adapter_flops = 0;
  std::string frozen_what;  // one line for `nnstrain plan`: what is frozen and what trains (empty: nothing frozen)
};

// Read once per plan: the model's dimensions, parameters and declared splits.
ModelFacts model_facts(const models::CausalLM& model);
// The request's model's facts, with its adjust_facts applied.
ModelFacts model_facts(const PlanRequest& req);

// What the optimizer (optimizer.type's registry entry, OptimizerEntry::cost)
// says its step costs per parameter of f; the cost model lays it over a plan.
optim::StepCost optimizer_cost(const PlanRequest& req, const ModelFacts& f);

// This rank's shape of a parameter at tp (rank 0's, the largest piece). Expert
// weights are whole on every tp rank: E / ep of them at expert parallelism ep.
std::vector<int64_t> local_shape(const ParamFact& p, int tp, int ep = 1);
const char* split_style_name(models::SplitStyle s);  // column | row | vocab | expert | replicate

// Why tp cannot split this model, one message per failure (empty: it can).
std::vector<std::string> tp_failures(const ModelFacts& f, int tp);

// Refuses, with the numbers, a tp the model's split declaration cannot take:
// heads, kv heads, ffn, vocabulary or hidden not divisible by tp, and every
// declared column/row/vocab split whose dimension (or fused part) is not a
// multiple of tp x unit. Throws PlanError listing every failure.
void check_tp_feasible(const models::CausalLM& model, int tp);

// The sequence length the cost model assumes: the dataset's, else the model's maximum.
int64_t seq_len_of(const config::TrainerArgs& a, const ModelFacts& f);

// Pipeline stages: `layers` model layers over `stages` stages, at least one
// each, so that the most expensive stage costs the least, counting a layer as
// 1 and the extra work of the first stage (the embedding) and of the last (the
// final norm, the head and the loss) in layers. Ties go to the earlier stage.
// The counts sum to `layers`; throws PlanError when stages > layers.
std::vector<int> balanced_stage_split(int64_t layers, int stages, double first_extra, double last_extra);

// The split the cost model uses for a candidate's c.stages stages: the
// config's pipeline_layers when given, else balanced_stage_split with the
// head's FLOPs (and the embedding's, none) in layers; when a rank holds several
// stages (1f1b_interleaved, zbv), the split among that one and its per-rank
// balanced neighbours whose c.scheduler step simulates shortest
// (pipeline_stages.h fastest_split), at the candidate's micro-batches.
std::vector<int> stage_split(const PlanRequest& req, const ModelFacts& f, const Candidate& c);

// Pipeline schedules already generated and simulated, shared by the
// estimates of one search (the same schedule recurs with every tp, ZeRO stage
// and recompute count). Not thread-safe: one per search.
class ScheduleCache {
 public:
  ScheduleCache();
  ~ScheduleCache();
  struct Impl;
  std::unique_ptr<Impl> impl;
};

// The cost model for one candidate (no feasibility checks beyond arithmetic).
PlanEstimate estimate(const PlanRequest& req, const ModelFacts& f, const Candidate& c, ScheduleCache* cache = nullptr);
PlanEstimate estimate(const PlanRequest& req, const Candidate& c);  // reads the model's facts first

// Expert parallelism, one MoE layer of one micro-batch on a rank: the
// all-to-all's time (forward: the counts exchange and two all-to-alls;
// backward: two), the bytes each all-to-all sends from the busiest rank, and
// whether the ep group spans nodes. Zero at ep 1 or for a dense model.
struct AllToAll {
  double forward_s = 0, backward_s = 0;
  double bytes = 0;
  bool cross_node = false;
};
AllToAll all_to_all_layer(const PlanRequest& req, const ModelFacts& f, const Candidate& c);

// "12.3 GiB", "512.0 MiB": bytes in binary units for messages.
std::string format_bytes(double bytes);
std::string format_fixed(double v, int digits);  // printf's "%.*f"
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace nnstrain::parallel
