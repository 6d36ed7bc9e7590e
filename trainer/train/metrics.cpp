#include "trainer/train/metrics.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>

#ifdef NNSTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace nnstrain::train {

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].peak;  // aggregate pool
  }
#endif
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      int64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
    in.ignore(1 << 16, '\n');
  }
  return 0;
}

JsonlSink::JsonlSink(const std::string& path, bool append) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot open metrics file " + path);
}

void JsonlSink::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
}

}  // namespace nnstrain::train
