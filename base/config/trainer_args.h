// TrainerArgs: the whole run configuration as typed, validated structs.
// Filled once by load_trainer_args() (config/load.h); nothing downstream reads YAML.
// Key names follow nnScaler's TrainerArgs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/config/eval_args.h"
#include "base/config/fault_tolerance_args.h"
#include "base/config/alignment_args.h"
#include "base/config/lora_args.h"

namespace nnstrain::config {

// Opaque, model-specific arguments (e.g. GptConfig); parsed by the model registry.
struct ModelConfig {
  virtual ~ModelConfig() = default;
  // The model.args key of attention-probability dropout and its value ("", 0:
  // none). Context-parallel attention has no dropout, so cp > 1 refuses it.
  virtual std::pair<std::string, double> attention_dropout() const { return {"", 0.0}; }
  // Mixture-of-Experts layers (their routers and experts take whole sequences,
  // so they refuse sequence parallelism).
  virtual bool mixture_of_experts() const { return false; }
  // A model.args key whose setting context-parallel attention cannot run, and
  // why ("": none; a sliding window), so cp > 1 refuses it naming the key.
  virtual std::pair<std::string, std::string> context_parallel_refusal() const { return {"", ""}; }
};

// Offload to host memory (DeepSpeed's offload_optimizer / offload_param):
// docs/config.md, docs/parallelism.md "Offload".
struct OffloadArgs {
  bool optimizer = false;  // fp32 masters (or the weights), moments and gradients of this rank's shard on the host; the step on the CPU
  bool params = false;     // ZeRO-3: each unit's chunk on the host between uses, copied to the device to be gathered
  double ratio = 1.0;      // share of the optimizer state offloaded (whole buckets, in backward's order); the rest steps on the device
  // DeepSpeed's delayed parameter update (DPU): the host step of step t runs
  // during step t + 1's forward and backward, whose gradients are then taken
  // at weights one update behind.
  bool delayed_update = false;
  // The NVMe tier (optimizer / params: nvme; docs/parallelism.md "Offload to
  // NVMe"): what the host tier keeps in host memory lives in files under
  // nvme_path/rank<R>, streamed through nvme_buffer_mb of host slots.
  bool optimizer_nvme = false, params_nvme = false;
  std::string nvme_path;
  double nvme_buffer_mb = 256;
  std::string nvme_io = "auto";  // auto, io_uring, threads (the pread/pwrite pool)
};

// Pipeline parallelism (issue 21), nnScaler's compute_config.pas_config keys:
// the layers split into `nstages` stages over `pp_size` ranks (more stages than
// ranks: virtual stages, `nstages / pp_size` per rank), `nmicros` micro-batches
// per step in one pipeline flush, run in the order `scheduler` gives.
struct PipelineArgs {
  int pp_size = 1;
  int nstages = 0;                 // 0: auto (the planner's choice; pp_size unless the scheduler needs more)
  int nmicros = 0;                 // 0: the step's micro-batches (grad_accumulation_steps)
  std::string scheduler = "1f1b";  // gpipe | 1f1b | 1f1b_interleaved | zb1p | zbv
  std::vector<int> layers;         // model layers per stage, given by the user; empty: balanced by the cost model
  // Optimizer post-validation (docs/parallelism.md): step t + 1's leading
  // forwards run before step t's global gradient norm is known, on a
  // speculative optimizer step rolled back when clipping or a non-finite step
  // says otherwise.
  bool post_validation = false;
  // Whether the config names pp_size / pipeline_scheduler: under autodist a
  // named one is kept, an unnamed one is the planner's to choose.
  bool pp_size_given = false, scheduler_given = false;
};

struct ComputeConfig {
  int plan_ngpus = 1;           // ranks one model replica spans (tensor parallel degree)
  int runtime_ngpus = 0;        // total ranks; 0 = take WORLD_SIZE from the launcher
  int use_zero = 0;             // ZeRO stage 0-3 (true = 1): 1 optimizer states, 2 + gradients, 3 + parameters sharded over dp
  int zero_ngroups = 1;         // ZeRO partitions within groups of dp/zero_ngroups ranks
  int zero_prefetch = 1;        // ZeRO-3: block units whose gathers are issued ahead of the one running
  double reducer_bucket_cap_mb = 25.0;
  double collective_timeout_s = 600.0;
  // Megatron's sequence parallelism alongside tensor parallelism (only at tp > 1).
  bool sequence_parallel = true;
  std::string backend = "auto"; // auto | nccl | gloo
  std::string device = "auto";  // auto | cpu | cuda
  double memory_budget_gb = 0;  // per-rank budget for the planner; 0 = fraction of device memory
  bool allow_tf32 = false;
  // auto: captured wherever graph_blocker() (trainer/train/step_graph.h) finds
  // nothing in the way (one GPU, ...), else eager, saying why; true: captured or
  // refused; false: eager.
  std::string cuda_graphs = "auto";
  // Gradient buffer and reduction dtype: auto = fp32 under *-mixed, the
  // parameters' dtype under *-true. fp32 | bf16 | fp16 otherwise.
  std::string reduce_dtype = "auto";
  OffloadArgs offload;
  // Context parallelism (issue 22): one sequence split over this many ranks,
  // attention by a ring of K/V blocks (p2p) or one all-gather, the tokens dealt
  // in 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r (zigzag) or
  // contiguously (none). Ranks: TP innermost, then CP, then DP.
  int context_parallel_size = 1;
  std::string cp_comm_type = "p2p";     // p2p | all_gather
  std::string cp_load_balance = "zigzag";  // zigzag | none
  bool context_parallel_given = false;     // named in the config: autodist keeps it (else it may choose cp)
  // Expert parallelism (MoE models): each MoE layer's experts split over this
  // many ranks carved out of dp x cp; tokens reach them by all-to-all.
  int expert_parallel_size = 1;
  bool expert_parallel_given = false;  // named in the config: autodist keeps it (else it may choose ep)
  // The planner's allowance for uneven routing: the busiest expert-parallel
  // rank receives this many times the mean tokens (>= 1; metrics' measured
  // max/mean tokens per expert, to re-plan with; docs/parallelism.md).
  double moe_imbalance = 1.25;
  PipelineArgs pipeline;                   // compute_config.pas_config
};

struct ModelArgs {
  std::string type;                           // registered model name
  std::shared_ptr<const ModelConfig> args;    // parsed by the registry for `type`
  std::string init_from;                      // optional Hugging Face directory
  bool activation_checkpointing = false;
  std::string loss = "auto";                  // auto | plain | chunked | fused (resolved_loss)
  int loss_chunk_size = 4096;                 // tokens per chunk for the chunked and fused losses
  // Under tensor parallelism the vocabulary is padded to a multiple of this x tp
  // (Megatron's make_vocab_size_divisible_by); padding rows are never allocated.
  int make_vocab_size_divisible_by = 1;
};

// model.loss as it runs for `tokens` per micro-batch (what the LM head sees,
// the whole sequence under sequence parallelism). `auto`: fused once the
// tokens make two chunks or more, plain below that. The fused loss does the
// plain loss's three head matmuls (the chunked one four) and holds one chunk's
// logits instead of three [tokens x vocab] fp32 tensors (measured peaks:
// bench/results/fused_loss_cpu_*.md; CPU step times there were within the
// shared machine's noise of plain's); with one chunk it saves nothing, so small
// runs keep the plain composite.
inline std::string resolved_loss(const ModelArgs& m, int64_t tokens) {
  if (m.loss != "auto") return m.loss;
  return tokens > m.loss_chunk_size ? "fused" : "plain";
}

// Opaque, optimizer-specific arguments (e.g. MuonConfig); parsed by the
// optimizer registry (trainer/optim/registry.h), as ModelConfig by the models'.
struct OptimizerConfig {
  virtual ~OptimizerConfig() = default;
};

// optimizer.type picks a registered optimizer. The fields below are AdamW's:
// optimizer.args under type adamw; under another type (Muon) they are its
// element-wise partner's for the parameters it does not take (optimizer.adamw_args).
struct OptimizerArgs {
  std::string type = "adamw";
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  std::string impl = "auto";      // auto | fused | foreach | loop
  double clip_gnorm = 0.0;        // 0 = no clipping
  std::shared_ptr<const OptimizerConfig> args;  // the type's own (null for adamw)
};

struct LrSchedulerArgs {
  std::string type = "constant";  // constant | linear | cosine (warmup then cosine, nanoGPT) | wsd
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;        // 0 = max_train_steps (wsd: the decay phase's length)
  double decay_ratio = 0.0;       // wsd: the decay phase as a share of the run (instead of decay_steps)
  std::string decay_type = "linear";  // wsd: linear | cosine | 1-sqrt
  double min_lr = 0.0;
  std::string interval = "step";  // step | epoch
};

struct TokenBinArgs {
  std::string path;               // nanoGPT-format token file
  std::string dtype = "uint16";   // uint16 | uint32
  int64_t seq_len = 0;            // tokens per sample (targets are shifted by one)
};

// dataset.type: indexed (Megatron .bin/.idx with nnstrain's manifest; docs/data.md).
struct IndexedSource {
  std::string path;               // PREFIX or PREFIX.manifest.json
  double weight = 1.0;            // blending weight (> 0; normalised over the list)
  bool allow_other_chat_template = false;  // chat data prepared with another template than model.init_from's
};
struct IndexedArgs {
  std::vector<IndexedSource> datasets;
  int64_t seq_len = 0;            // tokens per sample (targets are shifted by one)
  std::string join = "eos";       // eos (after each document) | bos (before each) | none
  bool document_mask = false;     // attention within documents only, positions restart per document
  bool mask_prompt = false;       // instruction data: prompt tokens' targets are -100 (not learned)
};

// dataset.type: preference (`prepare corpus --format preference`; docs/alignment.md):
// each pair's chosen and rejected completions after its prompt, one row each.
struct PreferenceArgs {
  std::string path;               // PREFIX or PREFIX.manifest.json
  int64_t seq_len = 0;            // tokens per row: TRL's max_length (longer rows keep their start)
  bool shuffle = true;            // pairs in a seeded order per epoch, else in the file's order
  // One row per pair: chosen then rejected as two documents (attention within each,
  // positions restarting), each cut to seq_len / 2 from its start; else two rows of seq_len.
  bool pack = false;
};

struct DatasetArgs {
  std::string type = "token_bin";  // token_bin | indexed | preference
  TokenBinArgs train_args;         // token_bin
  std::optional<TokenBinArgs> val_args;
  IndexedArgs indexed_train;       // indexed
  std::optional<IndexedArgs> indexed_val;
  PreferenceArgs preference_train;  // preference
  std::optional<PreferenceArgs> preference_val;
  int64_t seq_len() const {
    return type == "indexed" ? indexed_train.seq_len : type == "preference" ? preference_train.seq_len : train_args.seq_len;
  }
  bool has_val() const {
    return type == "indexed" ? indexed_val.has_value() : type == "preference" ? preference_val.has_value() : val_args.has_value();
  }
  bool document_mask() const { return type == "indexed" && indexed_train.document_mask; }
};

struct DataloaderArgs {
  int prefetch = 2;               // batches prepared ahead by the loader thread
  bool pin_memory = true;
};

struct CheckpointArgs {
  std::string save_dir;           // empty = no checkpoints
  std::string save_type = "sharded";  // sharded | deduped
  int64_t every_n_train_steps = 0;    // 0 = only at the end
  int keep_last_n_checkpoints = 0;    // 0 = keep all
  std::string resume_from;            // a checkpoint folder, or "last"
  bool save_on_end = true;
  bool async_save = true;              // snapshot to host memory, write in the background
};

// Dynamic loss scaling for the fp16 precisions (16-mixed, 16-true), as
// torch.amp.GradScaler: the loss is multiplied by `scale`; a step whose
// gradients are non-finite on any rank is skipped and the scale multiplied by
// backoff_factor; after growth_interval good steps in a row it grows.
struct LossScalerArgs {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

struct LogSink {
  std::string type;               // console | jsonl | tensorboard
  std::string path;               // jsonl: the file; tensorboard: the folder of event files
};

// profile: record steps [from, to] (1-based, inclusive) with LibTorch's profiler.
struct ProfileArgs {
  int64_t from = 0, to = 0;       // to == 0: no profiling
  std::string dir;                // one Chrome trace per rank; default <run_dir>/profile
  bool record_shapes = false;
  bool with_stack = false;
  bool enabled() const { return to > 0; }
};

struct TrainerArgs {
  std::string config_file;
  std::string run_dir;            // the run folder: config, plan, metrics, events, logs (docs/observability.md)
  ComputeConfig compute_config;
  std::string pas_policy = "autodist";  // dp | tp | hybrid | autodist
  ModelArgs model;
  OptimizerArgs optimizer;
  LrSchedulerArgs lr_scheduler;
  DatasetArgs dataset;
  DataloaderArgs dataloader;
  CheckpointArgs checkpoint;
  std::string precision = "32-true";  // 32-true | 16-true | bf16-true | 16-mixed | bf16-mixed
  LossScalerArgs loss_scaler;         // used by the fp16 precisions only
  int64_t micro_batch_size = 1;
  int64_t grad_accumulation_steps = 1;
  int64_t global_batch_size = 0;      // 0 = micro x dp x accumulation
  // Under autodist dp is the plan's, so the step's accumulation is derived
  // after planning (global / (micro x dp)); true when the config names both
  // global_batch_size and grad_accumulation_steps, so the plan must match it.
  bool accumulation_fixed = false;
  int64_t max_train_steps = 0;        // 0 = from max_epochs
  int64_t max_epochs = 0;
  int64_t val_every_n_train_steps = 0;
  int64_t max_val_steps = 0;
  int64_t log_progress_every_n_train_steps = 10;
  uint64_t seed = 0;
  std::vector<LogSink> log;
  ProfileArgs profile;
  bool memory_snapshot = false;       // CUDA allocator history and snapshots
  int64_t memory_snapshot_step = 0;   // dump after this step; 0 = the run's first step
  FaultToleranceArgs fault_tolerance;
  LoraArgs lora;                      // absent: every weight trains
  EvalArgs eval;                      // absent: no downstream tasks in the loop
  AlignmentArgs alignment;            // absent: the LM loss (dataset.type preference needs it)

  std::string resolved_yaml;          // the resolved configuration, as YAML
};

}  // namespace nnstrain::config
