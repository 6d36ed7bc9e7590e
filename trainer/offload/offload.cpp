#include "trainer/offload/offload.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#ifdef NNSTRAIN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace nnstrain::parallel {

namespace {

std::atomic<int64_t> g_in_use{0}, g_peak{0};

struct HostBlock {
  void* ptr;
  int64_t bytes;
  bool pinned;
};

// Frees what allocate_host gave out and takes it off the count.
void free_host(void* ctx) {
  auto* b = static_cast<HostBlock*>(ctx);
  g_in_use.fetch_sub(b->bytes, std::memory_order_relaxed);
#ifdef NNSTRAIN_CUDA
  if (b->pinned) {
    cudaFreeHost(b->ptr);
    delete b;
    return;
  }
#endif
  std::free(b->ptr);
  delete b;
}

}  // namespace

at::Tensor host_zeros(int64_t n, c10::ScalarType dtype, bool pinned) {
  const int64_t bytes = std::max<int64_t>(1, n) * static_cast<int64_t>(c10::elementSize(dtype));
  // Not through c10's CPU allocator: on a CPU run that one counts the "device"
  // tensors (peak_tensor_mb), and these buffers are the host's.
  void* p = nullptr;
#ifdef NNSTRAIN_CUDA
  if (pinned) TORCH_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess, "offload: cudaHostAlloc of ", bytes, " bytes failed");
#else
  TORCH_CHECK(!pinned, "offload: pinned host memory needs a CUDA build");
#endif
  if (!pinned) {
    const size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
    p = std::aligned_alloc(64, rounded);
    TORCH_CHECK(p, "offload: out of host memory allocating ", bytes, " bytes");
  }
  std::memset(p, 0, bytes);
  auto* block = new HostBlock{p, bytes, pinned};
  const int64_t now = g_in_use.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return at::from_blob(p, {n}, [block](void*) { free_host(block); }, at::TensorOptions().dtype(dtype));
}

HostBufferBytes host_buffer_bytes() {
  return {g_in_use.load(std::memory_order_relaxed), g_peak.load(std::memory_order_relaxed)};
}

#ifdef NNSTRAIN_CUDA
struct HostCopier::Cuda {
  c10::DeviceIndex index;
  c10::cuda::CUDAStream stream;
  std::vector<at::cuda::CUDAEvent> to_host_done;  // per slot
  at::cuda::CUDAEvent to_device_done;
  bool to_device_pending = false;

  // The copy stream starts what is queued next only once the current stream
  // has done what it has queued so far (produced a source, or last read a target).
  void follow_current() {
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(index));
    ready.block(stream);
  }
};
#else
struct HostCopier::Cuda {};
#endif

HostCopier::HostCopier(const c10::Device& device, size_t slots) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    cuda_ = std::unique_ptr<Cuda>(new Cuda{device.index(), c10::cuda::getStreamFromPool(false, device.index()),
                                           std::vector<at::cuda::CUDAEvent>(slots), at::cuda::CUDAEvent(), false});
  }
#else
  (void)device;
  (void)slots;
#endif
}

HostCopier::~HostCopier() = default;

void HostCopier::to_host(size_t slot, const at::Tensor& dst, const at::Tensor& src) {
#ifdef NNSTRAIN_CUDA
  if (cuda_) {
    // src's memory must not be reused before the copy is done (record_stream).
    cuda_->follow_current();
    c10::cuda::CUDAStreamGuard guard(cuda_->stream);
    const_cast<at::Tensor&>(dst).copy_(src, /*non_blocking=*/true);
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), cuda_->stream);
    cuda_->to_host_done[slot].record(cuda_->stream);
    return;
  }
#endif
  (void)slot;
  const_cast<at::Tensor&>(dst).copy_(src);
}

void HostCopier::wait_to_host(size_t slot) {
#ifdef NNSTRAIN_CUDA
  if (cuda_) cuda_->to_host_done[slot].synchronize();
#else
  (void)slot;
#endif
}

void HostCopier::to_device(const at::Tensor& dst, const at::Tensor& src) {
#ifdef NNSTRAIN_CUDA
  if (cuda_) {
    // dst may still be read by work queued on the current stream (the last forward).
    cuda_->follow_current();
    c10::cuda::CUDAStreamGuard guard(cuda_->stream);
    const_cast<at::Tensor&>(dst).copy_(src, /*non_blocking=*/true);
    cuda_->to_device_done.record(cuda_->stream);
    cuda_->to_device_pending = true;
    return;
  }
#endif
  const_cast<at::Tensor&>(dst).copy_(src);
}

void HostCopier::host_wait_to_device() {
#ifdef NNSTRAIN_CUDA
  if (cuda_) cuda_->to_device_done.synchronize();
#endif
}

void HostCopier::device_wait() {
#ifdef NNSTRAIN_CUDA
  if (cuda_ && cuda_->to_device_pending) {
    cuda_->to_device_done.block(c10::cuda::getCurrentCUDAStream(cuda_->index));
    cuda_->to_device_pending = false;
  }
#endif
}

}  // namespace nnstrain::parallel
