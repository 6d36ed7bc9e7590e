// What offload (compute_config.offload) needs below the training state: host
// buffers and the copies between them and the device.
//
// Device path (CUDA): host buffers are pinned; every copy runs on one copy
// stream, ordered after the work queued so far on the current stream by an
// event, so the host never waits for the device except where it must read
// what was copied (wait_to_host). CPU path (no GPU, as CI runs it): the same
// calls with ordinary host buffers and immediate copies. On both paths the host
// buffers come from an allocator of their own, counted apart from the device's
// tensors (the CPU counting allocator, peak_tensor_mb), so a CPU run shows
// what offload moves off the "device".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace nnstrain::parallel {

// n elements of host memory (zeros), pinned when `pinned`; counted in host_buffer_bytes.
at::Tensor host_zeros(int64_t n, c10::ScalarType dtype, bool pinned);

struct HostBufferBytes {
  int64_t in_use = 0, peak = 0;
};
// Bytes of the host buffers host_zeros handed out, alive now and at most at once.
HostBufferBytes host_buffer_bytes();

// Copies between the device and host buffers, by slot (one per bucket or unit).
class HostCopier {
 public:
  HostCopier(const c10::Device& device, size_t slots);
  ~HostCopier();
  // dst (host) <- src (device), after what the current stream has queued.
  void to_host(size_t slot, const at::Tensor& dst, const at::Tensor& src);
  // The host waits until slot's copy to the host is done (no-op on the CPU path).
  void wait_to_host(size_t slot);
  // dst (device) <- src (host) on the copy stream; the current stream waits for
  // it before anything queued after this call (device_wait).
  void to_device(const at::Tensor& dst, const at::Tensor& src);
  // The current stream waits for every copy to the device issued so far.
  void device_wait();
  // The host waits until the copies to the device issued so far are done, so
  // their host sources may be reused (the NVMe tier's slots; no-op on the CPU path).
  void host_wait_to_device();
  bool on_device() const { return cuda_ != nullptr; }

 private:
  struct Cuda;  // streams and events, CUDA builds only
  std::unique_ptr<Cuda> cuda_;
};

}  // namespace nnstrain::parallel
