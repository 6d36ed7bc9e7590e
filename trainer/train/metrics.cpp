#include "trainer/train/metrics.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>

#ifdef NNSTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
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

std::optional<double> peak_flops(const c10::Device& device, const std::string& precision, bool tf32) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device.index()) != cudaSuccess) return std::nullopt;
    const std::string name = prop.name;
    // Dense tensor-core peaks (bf16/fp16, tf32, fp32 without tensor cores), FLOP/s.
    struct Peak { const char* match; double half, tf32, fp32; };
    static const Peak table[] = {
        {"H200", 989e12, 494e12, 67e12}, {"H100", 989e12, 494e12, 67e12},
        {"A100", 312e12, 156e12, 19.5e12}, {"L40S", 362e12, 183e12, 91.6e12},
        {"A10", 125e12, 62.5e12, 31.2e12}, {"V100", 125e12, 15.7e12, 15.7e12},
        {"4090", 165e12, 82.6e12, 82.6e12}, {"3090", 71e12, 35.6e12, 35.6e12},
    };
    for (const auto& p : table)
      if (name.find(p.match) != std::string::npos) {
        if (precision.rfind("32", 0) == 0) return tf32 ? p.tf32 : p.fp32;
        return p.half;
      }
  }
#endif
  (void)device; (void)precision; (void)tf32;
  return std::nullopt;  // CPUs vary too much for a table
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
