// The training state of one rank: the parameters it holds, in flat buffers, in
// the precision's dtypes, with the ShardSpecs checkpoints need and the segments
// the optimizer updates. Communication is elsewhere (grad_reducer.h); the
// gradient norm and clipping are functions over this state (clip.h).
//
// Layout: parameters lie in reverse registration order (the order backward
// produces gradients), cut into buckets of reducer_bucket_cap_mb (under ZeRO-3:
// one bucket per unit, see below); under ZeRO each bucket is padded to a
// multiple of the ZeRO group size and every rank owns one chunk of every bucket.
// Every parameter, bucket and chunk starts at a multiple of 16 elements (16-byte
// aligned views in every dtype, as CUDA's vectorised kernels require).
//
// ZeRO stages (docs/parallelism.md): 1 keeps whole parameters and a whole
// gradient buffer and shards the optimizer (masters, moments); 2 also drops the
// whole gradient buffer: gradients go, bucket by bucket, into buffers that live
// only until their reduce-scatter is done, and each rank keeps only its reduced
// chunk; 3 also shards the parameters: each unit (the parameters before the
// blocks, each block, those after) is a flat buffer whose storage exists only
// while the unit is gathered (ParameterUnits, param_units.h), and what persists
// is this rank's chunk of it.
//
// Precision lives here, not in the model (DESIGN.md idea 7). The parameters the
// model computes with are views of flat_param in the compute dtype. Under
// *-mixed the optimizer updates fp32 masters (the whole buffer, or only this
// rank's ZeRO chunks), and the compute copy is refreshed from them after each
// step. Gradients live in flat_grad in the reduction dtype: when that is the
// compute dtype, param.grad is a view of it; otherwise (fp32 reduction of
// bf16/fp16 compute) each parameter's gradient is added into its fp32 slot as
// soon as autograd has accumulated it (accumulate_into_slot) and then dropped,
// so accumulation over micro-steps is in fp32 too (Megatron's main_grad).
//
// Offload (compute_config.offload, docs/parallelism.md "Offload"): the
// optimizer's coordinates (this rank's ZeRO chunks bucket after bucket, or the
// flat layout without ZeRO) start with the buckets backward finishes first; a
// prefix of whole buckets (offload_ratio of the elements) keeps its weights
// (fp32 masters, or under *-true a copy of the parameters), AdamW's moments and
// a copy of its reduced gradient in host memory (offload.h). Their optimizer
// segments point there, so the norm, clipping and AdamW (on the CPU) read and
// update host tensors; each bucket's gradient leaves for the host as soon as
// it is reduced (gradient_final), and the compute copy is refreshed from the
// host bucket by bucket (refresh_bucket). offload_params (ZeRO-3) keeps the
// compute-dtype chunks on the host too; a unit's chunk is copied to the device
// to be gathered (gather_input).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "trainer/sharding/state_tensor.h"
#include "trainer/sharding/shard_spec.h"
#include "trainer/optim/adamw.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::parallel {

class HostCopier;
class NvmeTier;

// A parameter as this rank holds it: the local tensor and which piece of the
// global parameter it is (replica_ranks: the ranks holding the same piece).
struct ParamShard {
  std::string name;
  at::Tensor tensor;
  sharding::ShardSpec spec;
  // Share of this piece in the global gradient norm: 1 for a piece only this
  // rank's tensor-parallel group position holds, 1/tp for one every TP rank replicates.
  double norm_weight = 1.0;
  // An MoE layer's experts (SplitStyle::Expert): replicated over the ranks that
  // hold the same experts (Runtime::edp), not over dp x cp, so reduced and
  // ZeRO-sharded there, in buckets of their own.
  bool expert = false;
};

// Bytes a rank holds per parameter element, by part, for a precision setup:
// what TrainingState allocates (params, gradients, fp32 masters) plus AdamW's
// two moments, before ZeRO partitioning. The planner's memory model uses the same numbers.
struct StateBytes {
  double param = 4, grad = 4, master = 0, moments = 8;
  double total() const { return param + grad + master + moments; }
};
StateBytes state_bytes(c10::ScalarType param_dtype, c10::ScalarType grad_dtype, bool master_weights);

// Where each parameter and bucket lies in the flat buffers; pure arithmetic.
struct FlatLayout {
  struct Bucket {
    int64_t begin = 0, end = 0;  // [begin, end) in the flat buffers, padding included
    std::vector<size_t> params;  // indices, in layout order
    // Its ZeRO group's size and this rank's place in it: an expert bucket's
    // group is the ranks holding the same experts (Runtime::edp), else the ZeRO group.
    int zsize = 1, zrank = 0;
    bool expert = false;
  };
  std::vector<int64_t> offset;    // per parameter
  std::vector<size_t> bucket_of;  // per parameter
  std::vector<Bucket> buckets;
  int64_t size = 0;               // elements, padding included
  int zsize = 1, zrank = 0;       // ZeRO group size and this rank's place in it (1, 0: no ZeRO)
  std::vector<int64_t> shard_offset;  // each bucket's chunk in the shard buffer (ZeRO)
  int64_t shard_size = 0;

  // numels: per parameter, in registration order. cap: elements per bucket.
  // units (optional, per parameter): a bucket never holds two units (ZeRO-3
  // passes no cap: a bucket per unit). expert (optional, per parameter): nor
  // experts and other parameters; expert buckets are cut for the group
  // (ezsize, ezrank) that shards them.
  static FlatLayout make(const std::vector<int64_t>& numels, int64_t cap, int zsize, int zrank,
                         const std::vector<int>& units = {}, const std::vector<bool>& expert = {}, int ezsize = 1,
                         int ezrank = 0);
  int64_t chunk_size(const Bucket& b) const { return (b.end - b.begin) / b.zsize; }
  int64_t chunk_begin(const Bucket& b) const { return b.begin + b.zrank * chunk_size(b); }
};

struct TrainingStateOptions {
  double bucket_cap_mb = 25.0;
  int zero_stage = 0;                  // 0: none; 1, 2, 3 (above)
  int zero_size = 1, zero_rank = 0;    // the ZeRO group (zero_stage > 0)
  std::vector<int> zero_replicas{0};   // ranks holding the same ZeRO chunks (checkpoint replicas)
  // Expert parallelism: which parameters are experts (registration order;
  // empty: none) and the group that shards them under ZeRO (Runtime::edp).
  std::vector<bool> expert;
  int expert_zero_size = 1, expert_zero_rank = 0;
  std::vector<int> expert_zero_replicas{0};
  double weight_decay = 0.0;           // for tensors of two or more dims
  c10::ScalarType param_dtype = c10::ScalarType::Float;  // what the model computes with
  c10::ScalarType grad_dtype = c10::ScalarType::Float;   // gradient buffer and reduction dtype
  bool master_weights = false;                           // fp32 masters in the optimizer (*-mixed)
  // ZeRO-3: each parameter's unit, in registration order: 0 for those before
  // the blocks, 1 + i for block i's, blocks + 1 for those after. A unit's
  // parameters must be consecutive. ZeRO-2 (under pipeline parallelism: each
  // stage's parameters, a tied one alone): groups no bucket spans.
  std::vector<int> units;
  // ZeRO-3: this rank's chunks of the initial (fp32) values, taken from each
  // parameter as it was materialised (move_into_chunks); the parameters' own
  // storage is then never read. Undefined: the state reads the parameters.
  at::Tensor initial_chunks;
  // Offload: the share of the optimizer's elements on the host (0: none; whole
  // buckets, so at least this share), and (ZeRO-3, with offload_ratio 1) the parameter chunks.
  double offload_ratio = 0;
  bool offload_params = false;
  // Delayed update (DPU): gradients land in a buffer of their own, so the next
  // step's can arrive while the host still steps with this one's.
  bool offload_delayed = false;
  // The NVMe tier (nvme_tier.h): the offloaded buckets' weights and moments
  // (and, with nvme_params, ZeRO-3's parameter chunks) in files under
  // nvme_path instead of host memory; nvme_path empty: the host tier.
  std::string nvme_path, nvme_io = "auto";
  int nvme_rank = 0;
  int64_t nvme_buffer_bytes = 256 << 20;
  bool nvme_params = false;
  // Parameters whose optimizer keeps one state tensor, not AdamW's two (Muon's
  // matrices: its momentum; optim::StepCost::state_tensors): offloaded, their
  // host moments have no second slot.
  std::set<std::string> one_state;
  bool zero() const { return zero_stage > 0; }
};

// Each parameter's unit (TrainingStateOptions::units), in registration order:
// 0 before the blocks, 1 + i for block i's (CausalLM::block_of), blocks + 1 after.
// Defined in param_units.cpp; declared here so the planner needs no runtime header.
std::vector<int> parameter_units(const models::CausalLM& model);

class TrainingState {
 public:
  // Parameters become views of the flat buffer; their values as built (fp32
  // under *-mixed) start the masters exactly.
  TrainingState(std::vector<ParamShard> params, const TrainingStateOptions& opts);
  ~TrainingState();

  // The layout a state with `opts` gives parameters of these sizes (registration order).
  static FlatLayout layout_for(const std::vector<int64_t>& numels, const TrainingStateOptions& opts);
  // ZeRO-3's streamed start: the parts of parameter k's value (its local
  // shape) that fall in this rank's chunks, into `chunks` (fp32, shard_size);
  // then the value's storage is freed.
  static void move_into_chunks(const FlatLayout& layout, size_t k, at::Tensor& value, at::Tensor& chunks);

  const std::vector<ParamShard>& params() const { return params_; }
  const FlatLayout& layout() const { return layout_; }
  const TrainingStateOptions& options() const { return opts_; }

  // Gradients. flat_grad (stages 0, 1): every parameter's slot; shard_grad
  // (ZeRO): this rank's reduced chunks, bucket after bucket. reduced_grads:
  // what the optimizer and the norm read, whichever of the two that is.
  at::Tensor& flat_param() { return flat_param_; }
  at::Tensor& flat_grad() { return flat_grad_; }
  at::Tensor& shard_grad() { return shard_grad_; }
  at::Tensor& reduced_grads() { return opts_.zero() ? shard_grad_ : flat_grad_; }
  // Stages 2, 3: bucket b's gradient buffer for this backward (zeros when
  // first asked for), and its release once reduced. Released buffers are
  // reused by later buckets of the same size class (the reducer's bucket cap
  // under ZeRO-2, the exact size of a ZeRO-3 unit), so a backward cycles
  // through a few buffers rather than allocating one per bucket: on CUDA a
  // freed buffer stays counted until the GPU has passed its collective, which
  // the host may be a whole backward ahead of. drop_bucket_buffers frees them
  // all (after backward).
  at::Tensor& bucket_grad(size_t b);
  void release_bucket_grad(size_t b);
  void drop_bucket_buffers() { free_buffers_.clear(); }
  // Stage 3: unit (bucket) b's whole parameters, the flat buffer its
  // parameters view; allocate_unit gives it storage (to gather into),
  // free_unit takes it away. shard_param: this rank's chunks of every unit.
  at::Tensor& unit_param(size_t b) { return unit_param_[b]; }
  void allocate_unit(size_t b);
  void free_unit(size_t b);
  bool unit_allocated(size_t b) const;
  at::Tensor shard_chunk(size_t b) const;
  // Stage 3: the buckets holding unit u's parameters, consecutive (none: the
  // unit has none; several: under expert parallelism a block's experts are a bucket apart).
  std::vector<size_t> unit_buckets(int u) const {
    return u < static_cast<int>(unit_buckets_.size()) ? unit_buckets_[u] : std::vector<size_t>{};
  }
  bool grads_via_hook() const { return grads_via_hook_; }
  // After autograd accumulated parameter k's gradient (grads_via_hook): into its slot, then dropped.
  void accumulate_into_slot(size_t k);
  void zero_grad();
  void scale_gradients(const at::Tensor& coef);

  // What the optimizer updates: whole parameters (or masters), or this rank's ZeRO chunks.
  const std::vector<optim::Segment>& optimizer_segments() const { return segments_; }
  // Per segment, on the device: its share in the global norm (ParamShard::norm_weight).
  const at::Tensor& norm_weights() const { return norm_weights_; }
  // The ShardSpec of each optimizer segment (state named prefix + param name).
  std::vector<sharding::ShardSpec> segment_specs(const std::string& prefix) const;
  // The weights checkpoints store: fp32 masters under *-mixed (this rank's ZeRO
  // chunks only, as flat pieces), else the parameters. Named "model/<name>".
  std::vector<sharding::StateTensor> weight_state() const;
  // After the optimizer (or a checkpoint load) changed the masters: the compute
  // copy of what this rank updates (its chunks under ZeRO: the reducer gathers the rest).
  void refresh_compute_copy();
  // Bytes of parameters, gradients and masters this rank holds on its device
  // (moments: 0, the optimizer holds them); host_held_bytes: in host memory
  // under offload (weights under master, the gradient copy under grad, the
  // moments' buffers under moments, the compute-dtype staging and ZeRO-3 chunks under param).
  StateBytes held_bytes() const;
  StateBytes host_held_bytes() const;

  // Offload. The buckets 0 .. host_buckets() - 1 (layout order) are offloaded.
  size_t host_buckets() const { return host_buckets_; }
  int64_t host_elements() const { return host_size_; }
  int64_t optimizer_elements() const { return opts_.zero() ? layout_.shard_size : layout_.size; }
  bool offloaded() const { return host_buckets_ > 0 || opts_.offload_params; }
  // The optimizer segments of bucket b (indices into optimizer_segments()), and those stepping on the device.
  const std::vector<size_t>& bucket_segments(size_t b) const { return bucket_segments_[b]; }
  std::vector<size_t> device_segments() const;
  bool segment_on_host(size_t i) const;
  // Segment i belongs to an expert bucket (FlatLayout::Bucket::expert).
  bool segment_expert(size_t i) const { return layout_.buckets[segment_bucket_[i]].expert; }
  // Bucket b's reduced gradient is final on the device: an offloaded bucket's
  // copy leaves for the host now. The reducer calls it as each bucket
  // completes, or after backward.
  void gradient_final(size_t b);
  bool gradient_sent(size_t b) const { return b < sent_.size() && sent_[b]; }
  // Every offloaded bucket's gradient on the host (the host waits for the copies).
  void wait_host_grads();
  // Delayed update: the landed gradients become what the optimizer segments
  // read (once the previous host step is done with those).
  void promote_host_grads();
  // What reduced_grads() holds outside the offloaded prefix (the device's share).
  at::Tensor device_reduced_grads();
  // Bucket b's compute copy from the weights the optimizer updated (from the
  // host for an offloaded bucket, on the copy stream); finish_refresh makes the
  // current stream wait for those copies.
  void refresh_bucket(size_t b);
  void finish_refresh();
  // After a checkpoint loaded the parameters themselves (*-true below ZeRO-3):
  // the host weights from them.
  void pull_host_weights();
  // ZeRO-3: unit b's chunk as its all-gather reads it: on the device (copied
  // there under offload_params, kept alive by the caller until the gather is done).
  at::Tensor gather_input(size_t b) const;
  // The NVMe tier (null: none). Around an offloaded bucket's host step:
  // nvme_acquire reads it into its slot (and the next one ahead), nvme_release
  // writes it back (dirty) after refresh_bucket; nvme_finish ends the step's I/O.
  NvmeTier* nvme() const { return nvme_.get(); }
  void nvme_acquire(size_t b);
  void nvme_release(size_t b, bool dirty);
  void nvme_finish();

 private:
  std::vector<optim::Segment> make_segments(std::vector<size_t>* bucket_of_segment) const;

  std::vector<ParamShard> params_;
  TrainingStateOptions opts_;
  FlatLayout layout_;
  bool grads_via_hook_ = false;
  at::Tensor flat_param_, flat_grad_, shard_grad_;
  at::Tensor shard_param_;                // stage 3: this rank's chunks, compute dtype
  std::vector<at::Tensor> unit_param_;    // stage 3: per bucket, storage only while gathered
  std::vector<at::Tensor> bucket_grad_;   // stages 2, 3: per bucket, only during backward
  std::vector<at::Tensor> bucket_base_;   // the pooled buffer each bucket_grad_ is a view of
  std::map<int64_t, std::vector<at::Tensor>> free_buffers_;  // by size class
  int64_t bucket_class(size_t b) const;
  int64_t pooled_class_ = 0;  // stage 2: the size every bucket within the cap is pooled at
  std::vector<std::vector<size_t>> unit_buckets_;
  at::Tensor flat_master_;              // *-mixed: fp32 masters (whole, or this rank's ZeRO chunks)
  std::vector<at::Tensor> grad_views_;  // each param's gradient slot in flat_grad_
  std::vector<optim::Segment> segments_;
  at::Tensor norm_weights_;
  // Offload (see the top): the prefix of the optimizer's coordinates on the host.
  int64_t opt_begin(size_t b) const;
  int64_t opt_len(size_t b) const;
  size_t host_buckets_ = 0;
  int64_t host_size_ = 0;
  // host_moments_: every host element's first moment, then the second moments
  // of those whose optimizer keeps two (opts_.one_state), packed.
  int64_t host_second_moments() const;
  at::Tensor host_weights_, host_grad_, host_moments_, host_stage_;
  at::Tensor host_landing_;  // delayed update: where gradients arrive (else host_grad_ itself)
  std::unique_ptr<HostCopier> copier_;
  std::unique_ptr<NvmeTier> nvme_;
  std::vector<bool> sent_;
  std::vector<std::vector<size_t>> bucket_segments_;
  std::vector<size_t> segment_bucket_;
};

}  // namespace nnstrain::parallel
