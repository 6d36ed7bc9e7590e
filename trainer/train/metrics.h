// What the trainer reports: peak memory and the JSONL metrics sink. (Device
// peak FLOP/s for MFU come from the planner's device table.)
#pragma once

#include <c10/core/Device.h>

#include <fstream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace nnstrain::train {

// Peak tensor memory of this process on `device` in bytes since it started:
// the CUDA allocator's allocated-bytes peak, or on CPU the counting allocator's
// (cpu_memory.h; the peak resident set size if it is not installed).
int64_t peak_memory_bytes(const c10::Device& device);
// The peak over a window, for one step: reset_step_peak starts it (the peak
// starts at what is allocated now), step_peak_bytes reads the most allocated at
// once since. CUDA: the caching allocator's peak, reset (peak_memory_bytes
// still reports the whole run's); CPU: the counting allocator's window.
void reset_step_peak(const c10::Device& device);
int64_t step_peak_bytes(const c10::Device& device);
// This process's peak resident set size (VmHWM) in bytes: host memory, whatever the device.
int64_t peak_host_rss_bytes();
// Bytes allocated now on `device`: the CUDA allocator's current bytes, or on CPU
// the counting allocator's tensor bytes in use (what malloc has handed out,
// mallinfo2, if it is not installed). Differences of it measure what a phase holds.
int64_t memory_in_use_bytes(const c10::Device& device);

// Model FLOPs utilisation two ways for causal attention (docs/observability.md):
// `counted` counts attention's masked half as work (the models' flops_per_token,
// nnScaler's and torchtitan's convention), `unmasked` only the half computed.
// flops_at_seq, flops_at_zero: the model's flops_per_token at the run's sequence
// length and at 0 (its attention term is linear in the length); peak_flops: of
// every rank together.
struct Mfu {
  double counted = 0, unmasked = 0;
};
Mfu model_flops_utilization(double flops_at_seq, double flops_at_zero, double tokens_per_s, double peak_flops);

// One JSON object per line, flushed every write (a crash loses nothing logged).
class JsonlSink {
 public:
  // A run resumed at `start_step` keeps the records of steps up to it and drops
  // those the interrupted run logged after its checkpoint, so every step appears
  // once; a fresh run (0) starts the file anew.
  JsonlSink(const std::string& path, int64_t start_step);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
};

}  // namespace nnstrain::train
