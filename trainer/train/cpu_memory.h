// Tensor bytes on the CPU, counted at the allocator: what "peak memory" means
// for a CPU run, as the CUDA caching allocator's allocated-bytes peak does on a
// GPU. A wrapper around c10's CPU allocator (installed with a higher priority)
// adds every tensor storage's size when it is allocated and subtracts it when
// it is freed; the in-use figure and its peaks are atomics, so counting costs
// two atomic operations per allocation. What it does not see: memory outside
// tensor storages (libraries, thread stacks, Gloo's own buffers, malloc's
// bookkeeping and fragmentation), and tensors allocated before it is installed.
#pragma once

#include <cstdint>

namespace nnstrain::train {

// Installs the counter as the CPU allocator (idempotent, thread-safe). Tensors
// allocated earlier are not counted, and their frees are not subtracted.
void install_cpu_tensor_counter();
bool cpu_tensor_counter_installed();

struct CpuTensorBytes {
  int64_t in_use = 0;       // storages alive now
  int64_t peak = 0;         // most in use at once since install
  int64_t window_peak = 0;  // most in use at once since the last reset_window_peak
};
CpuTensorBytes cpu_tensor_bytes();
// Starts a new window: its peak starts at what is in use now.
void reset_cpu_window_peak();

}  // namespace nnstrain::train
