// What the trainer reports: peak memory, device peak FLOP/s for MFU, and the
// JSONL metrics sink.
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

// Dense peak FLOP/s of the device for `precision` (from a table), if known.
std::optional<double> peak_flops(const c10::Device& device, const std::string& precision, bool tf32);

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
