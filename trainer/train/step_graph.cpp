#include "trainer/train/step_graph.h"

#include <torch/torch.h>

#include <stdexcept>

#include "trainer/train/metrics.h"

#ifdef NNSTRAIN_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nnstrain::train {

struct StepGraph::Impl {
  Body body;
  int warmup = 3;
  int calls = 0;
  std::vector<data::Batch> inputs;  // what the graph reads
  int64_t capture_peak = -1, pool = -1;
#ifdef NNSTRAIN_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

void use_capture_stream(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, device.index()));
#else
  (void)device;
#endif
}

bool graphs_built() {
#ifdef NNSTRAIN_CUDA
  return true;
#else
  return false;
#endif
}

std::string graph_blocker(const GraphFacts& f) {
  if (!f.built_with_cuda) return "needs an nnstrain built with its CUDA code (NNSTRAIN_WITH_CUDA)";
  if (!f.cuda) return "needs a CUDA device";
  if (f.world > 1 && f.backend.empty()) return "cannot tell which backend the ranks' collectives use";
  // Gloo's collectives run on the host (and their CUDA copies on streams of its own).
  if (!f.backend.empty() && f.backend != "nccl")
    return "cannot capture " + f.backend + "'s host collectives (compute_config.backend; nccl can be captured)";
  if (f.tp > 1)
    return "is not supported with tensor parallelism yet (compute_config.plan_ngpus: its sharded regions swap the "
           "dropout generator's state on the host, which a replay would not)";
  if (f.zero_stage >= 2)
    return "is not supported with ZeRO stage " + std::to_string(f.zero_stage) + " (compute_config.use_zero) yet";
  if (f.recompute) return "is not supported with activation recompute yet";
  if (f.optimizer_impl != "fused") return "needs optimizer.args.impl fused (or auto), not " + f.optimizer_impl;
  if (f.offload) return "cannot capture offload's host step (compute_config.offload)";
  if (f.cp > 1) return "cannot capture context parallelism's ring (compute_config.context_parallel_size)";
  if (f.pp > 1) return "cannot capture the pipeline's transfers (compute_config.pas_config.pp_size)";
  if (f.moe) return "cannot route tokens to experts (the MoE dispatch reads each expert's token count on the host)";
  if (f.document_mask) return "cannot read per-token document masks (dataset.*_args.document_mask)";
  return "";
}

StepGraph::StepGraph(Body body, int warmup) : impl_(std::make_unique<Impl>()) {
#ifndef NNSTRAIN_CUDA
  throw std::runtime_error("compute_config.cuda_graphs: this nnstrain was built without CUDA");
#endif
  impl_->body = std::move(body);
  impl_->warmup = warmup;
}

StepGraph::~StepGraph() = default;

int64_t StepGraph::capture_peak_bytes() const { return impl_->capture_peak; }
int64_t StepGraph::pool_bytes() const { return impl_->pool; }

bool StepGraph::captured() const {
#ifdef NNSTRAIN_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

void StepGraph::run(const std::vector<data::Batch>& batches) {
#ifdef NNSTRAIN_CUDA
  auto& m = *impl_;
  if (m.graph) {
    for (size_t i = 0; i < batches.size(); ++i) {
      m.inputs[i].x.copy_(batches[i].x, /*non_blocking=*/true);
      m.inputs[i].y.copy_(batches[i].y, /*non_blocking=*/true);
    }
    m.graph->replay();
    return;
  }
  if (m.calls < m.warmup) {
    m.body(batches);
  } else {
    for (const auto& b : batches) m.inputs.push_back({b.x.clone(), b.y.clone()});
    // The warm-up's cached blocks go back to the device, so the graph's private
    // pool can take that memory instead of doubling the footprint.
    c10::cuda::CUDACachingAllocator::emptyCache();
    const auto device = batches.front().x.device();
    reset_step_peak(device);
    const int64_t reserved = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).reserved_bytes[0].current;
    m.graph = std::make_unique<at::cuda::CUDAGraph>();
    // Thread-local capture: the prefetch thread keeps pinning host memory meanwhile.
    m.graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    m.body(m.inputs);
    m.graph->capture_end();
    m.capture_peak = step_peak_bytes(device);
    m.pool = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).reserved_bytes[0].current - reserved;
    m.graph->replay();  // capturing recorded the step without running it
  }
  ++m.calls;
#else
  (void)batches;
#endif
}

}  // namespace nnstrain::train
