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
