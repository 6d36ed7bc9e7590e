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

// One JSON object per line, flushed every write (a crash loses nothing logged).
class JsonlSink {
 public:
  // A fresh run starts the file anew; a resumed one appends to it.
  JsonlSink(const std::string& path, bool append);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
};

}  // namespace nnstrain::train
