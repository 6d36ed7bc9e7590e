// Data parallelism over the dp group: parameters and gradients live in flat
// buffers laid out in reverse registration order (the order backward produces
// gradients) and cut into buckets of reducer_bucket_cap_mb. Each bucket's
// reduction is launched from an autograd hook the moment its last gradient is
// accumulated, so communication overlaps the rest of backward, and only on the
// final micro-step of gradient accumulation.
//
// Without ZeRO a bucket is all-reduced in place. With ZeRO-1 a bucket is
// reduce-scattered over the ZeRO group, each rank updates only its chunk of
// every bucket (its optimizer state is 1/Z of the whole, plus padding), and the
// updated parameters are all-gathered back.
//
// Precision lives here, not in the model (DESIGN.md idea 7). The parameters the
// model computes with are views of flat_param_ in the compute dtype. Under
// *-mixed the optimizer updates fp32 master weights (flat_master_: the whole
// buffer, or only this rank's ZeRO chunks), and the compute copy is refreshed
// from them after each step (under ZeRO: own chunks cast, then all-gathered in
// the compute dtype). Gradients live in flat_grad_ in the reduction dtype: when
// that is the compute dtype, param.grad is a view of it; otherwise (fp32
// reduction of bf16/fp16 compute) each parameter's gradient is added into its
// fp32 slot as soon as autograd has accumulated it and then dropped, so
// accumulation over micro-steps is in fp32 too (Megatron's main_grad).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <string>
#include <vector>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/shard_spec.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/adamw.h"

namespace torch::autograd {
struct Node;
}

namespace nnstrain::parallel {

// A parameter as this rank holds it: the local tensor and which piece of the
// global parameter it is (replica_ranks: the ranks holding the same piece).
struct ParamShard {
  std::string name;
  at::Tensor tensor;
  checkpoint::ShardSpec spec;
  // Share of this piece in the global gradient norm: 1 for a piece only this
  // rank's tensor-parallel group position holds, 1/tp for one every TP rank replicates.
  double norm_weight = 1.0;
};

struct DataParallelOptions {
  double bucket_cap_mb = 25.0;
  bool zero = false;
  double weight_decay = 0.0;   // for tensors of two or more dims
  c10::ScalarType param_dtype = c10::ScalarType::Float;  // what the model computes with
  c10::ScalarType grad_dtype = c10::ScalarType::Float;   // gradient buffer and reduction dtype
  bool master_weights = false;                           // fp32 masters in the optimizer (*-mixed)
};

// Bytes a rank holds per parameter element, by part, for a precision setup:
// what DataParallel allocates (params, gradients, fp32 masters) plus AdamW's two
// moments, before ZeRO partitioning. The planner's memory model uses the same numbers.
struct StateBytes {
  double param = 4, grad = 4, master = 0, moments = 8;
  double total() const { return param + grad + master + moments; }
};
StateBytes state_bytes(c10::ScalarType param_dtype, c10::ScalarType grad_dtype, bool master_weights);

class DataParallel {
 public:
  // rt may be null (one process). Parameters become views of the flat buffer.
  DataParallel(std::vector<ParamShard> params, dist::Runtime* rt, const DataParallelOptions& opts);
  ~DataParallel();

  // The model's parameters (views of the compute-dtype buffer).
  const std::vector<ParamShard>& params() const { return params_; }
  // The weights checkpoints store: fp32 masters under *-mixed (this rank's ZeRO
  // chunks only, as flat pieces), else the parameters. Named "model/<name>".
  std::vector<checkpoint::StateTensor> weight_state() const;
  bool has_master_weights() const { return opts_.master_weights; }

  void zero_grad();
  // Before each micro-step's backward: reduce gradients this time or not.
  void begin_micro_step(bool sync);
  // After the last backward: waits for every bucket; gradients are then averaged
  // over dp (ZeRO: this rank's chunk of them).
  void finish_gradients();
  // Global L2 norm of the (averaged) gradients, on the device, no host sync.
  at::Tensor grad_norm();
  void scale_gradients(const at::Tensor& coef);
  // What the optimizer updates: whole parameters, or this rank's ZeRO chunks.
  std::vector<optim::Segment> optimizer_segments() const;
  // The ShardSpec of each optimizer segment (state named prefix + param name).
  std::vector<checkpoint::ShardSpec> segment_specs(const std::string& prefix) const;
  // After the optimizer (or a checkpoint load) changed what it updates: the
  // compute copy refreshed from the masters, ZeRO chunks all-gathered.
  void after_optimizer_step();
  // Bytes of parameters, gradients and masters this rank holds (moments: 0, the optimizer holds them).
  StateBytes held_bytes() const;

  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }
  // Bytes each step sends into reductions (buffer bytes per collective).
  int64_t reduced_bytes_per_step() const;

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;          // in the flat buffers (end includes padding)
    std::vector<size_t> params;          // indices into params_
    int pending = 0;
    bool ready = false, launched = false;
    c10::intrusive_ptr<c10d::Work> work;
  };
  void on_grad_ready(size_t param_index);
  std::vector<optim::Segment> make_segments() const;
  void launch_ready_in_order();
  void launch(Bucket& b);
  int64_t chunk_begin(const Bucket& b) const;  // this rank's chunk of a bucket
  int64_t chunk_size(const Bucket& b) const;

  std::vector<ParamShard> params_;
  std::vector<int64_t> offset_;   // each param's start in the flat buffers
  std::vector<size_t> bucket_of_;
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;
  dist::Runtime* rt_;
  DataParallelOptions opts_;
  int dp_ = 1, zsize_ = 1, zrank_ = 0;
  bool sync_ = true;
  at::Tensor flat_param_, flat_grad_;
  at::Tensor flat_master_;                 // *-mixed: fp32 masters (whole, or this rank's ZeRO chunks)
  bool grads_via_hook_ = false;            // gradient dtype differs from the compute dtype
  std::vector<at::Tensor> grad_views_;     // each param's gradient slot in flat_grad_
  std::vector<optim::Segment> segments_;   // fixed at construction
  at::Tensor norm_weights_;                // per segment, on the device (TP replicas count once)
  at::Tensor shard_grad_;                  // ZeRO: this rank's reduced chunks, bucket after bucket
  std::vector<int64_t> shard_offset_;      // each bucket's chunk start in shard_grad_
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep hooks alive
};

}  // namespace nnstrain::parallel
