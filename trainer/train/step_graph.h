// CUDA graphs for the training step (compute_config.cuda_graphs): the whole step
// (forward and backward of every micro-batch, gradient finish, norm, unscale,
// clip, AdamW, loss scaler) is recorded once and replayed, so a step costs one
// graph launch instead of hundreds of kernel launches. Its inputs are static: the
// batches are copied into buffers the graph reads, the learning rate into a
// device scalar; everything else the step touches lives in tensors that persist
// across steps. The whole run works on one non-default stream
// (use_capture_stream(), called before the model's gradient hooks exist: autograd
// runs each AccumulateGrad node on the stream current when it was created, and
// the legacy default stream cannot take part in a capture). The first `warmup`
// steps run eagerly (lazy initialisation, cuBLAS workspaces, autograd's device
// threads), the next is captured and replayed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "data/token_bin.h"

namespace nnstrain::train {

// Makes a pool stream of `device` current for this thread, for the rest of the run.
void use_capture_stream(const c10::Device& device);

// What a run is, as far as capturing its step goes.
struct GraphFacts {
  bool built_with_cuda = false;  // graphs_built()
  bool cuda = false;
  int world = 1;
  // The collectives' backend (Runtime::backend_name(): nccl | gloo), "" when the
  // run has none (one rank below ZeRO-2).
  std::string backend;
  int tp = 1;
  int zero_stage = 0;
  bool recompute = false;
  std::string optimizer_impl;  // fused | foreach | ...
  bool offload = false;
  int cp = 1, pp = 1;
  bool document_mask = false;
  bool moe = false;  // Mixture-of-Experts layers: their dispatch reads token counts on the host
};

// What keeps the step from being captured, as the rest of a sentence after
// "compute_config.cuda_graphs" ("" when nothing does): host collectives (Gloo),
// tensor parallelism's sharded-region dropout generator (swapped on the host),
// ZeRO-2/3's per-bucket buffers, recompute's RNG save and restore, a non-fused
// optimizer's host loop, offload's host step, the pipeline and ring's
// point-to-point transfers, per-token document masks. Data parallelism over
// NCCL (ZeRO 0 and 1, HSDP) is captured, its collectives recorded into the
// graph (docs/parallelism.md, "CUDA graphs with several ranks"). The same list
// refuses `cuda_graphs: true` and turns `auto` eager.
std::string graph_blocker(const GraphFacts& f);
bool graphs_built();  // this nnstrain was compiled with its CUDA code

class StepGraph {
 public:
  using Body = std::function<void(const std::vector<data::Batch>& batches)>;
  // Throws when this nnstrain was built without CUDA.
  StepGraph(Body body, int warmup);
  ~StepGraph();
  // One step on these batches (device tensors of the same shapes every step).
  void run(const std::vector<data::Batch>& batches);
  bool captured() const;
  // Memory of a replayed step, which never calls the caching allocator (its
  // tensors live in the graph's private pool): the most tensor bytes allocated
  // at once while the step was captured (a replay reuses those very blocks),
  // and the bytes the pool reserves. -1 before capture.
  int64_t capture_peak_bytes() const;
  int64_t pool_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nnstrain::train
