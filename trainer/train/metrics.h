// What the trainer reports: peak memory and the JSONL metrics sink. (Device
// peak FLOP/s for MFU come from the planner's device table.)
#pragma once

#include <c10/core/Device.h>

#include <fstream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace nnstrain::train {

// Peak memory of this process on `device` in bytes: the CUDA allocator's peak,
// or the peak resident set size (VmHWM) on CPU.
int64_t peak_memory_bytes(const c10::Device& device);
// This process's peak resident set size (VmHWM) in bytes: host memory, whatever the device.
int64_t peak_host_rss_bytes();
// Bytes allocated now on `device`: the CUDA allocator's current bytes, or on CPU
// what malloc has handed out (mallinfo2: arena plus mmapped chunks), which is
// where LibTorch's CPU tensors live. Differences of it measure what a phase holds.
int64_t memory_in_use_bytes(const c10::Device& device);

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
