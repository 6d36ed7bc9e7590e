#include "trainer/train/metrics.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <malloc.h>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/train/cpu_memory.h"
#include "base/log.h"

#ifdef NNSTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace nnstrain::train {

Mfu model_flops_utilization(double flops_at_seq, double flops_at_zero, double tokens_per_s, double peak_flops) {
  const double per_flop = tokens_per_s / peak_flops;
  return {flops_at_seq * per_flop, (flops_at_seq - (flops_at_seq - flops_at_zero) / 2) * per_flop};
}

namespace {
// CUDA: the allocator's peaks read just before each reset_step_peak, per
// device, so the whole run's peak survives the resets.
std::map<int, int64_t>& cuda_peak_before_reset() {
  static std::map<int, int64_t> m;
  return m;
}
}  // namespace

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return std::max(stats.allocated_bytes[0].peak, cuda_peak_before_reset()[device.index()]);  // aggregate pool
  }
#endif
  if (cpu_tensor_counter_installed()) return cpu_tensor_bytes().peak;
  return peak_host_rss_bytes();
}

void reset_step_peak(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    auto& before = cuda_peak_before_reset()[device.index()];
    before = std::max(before, c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak);
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return;
  }
#endif
  (void)device;
  reset_cpu_window_peak();
}

int64_t step_peak_bytes(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak;
#endif
  (void)device;
  return cpu_tensor_counter_installed() ? cpu_tensor_bytes().window_peak : -1;
}

int64_t memory_in_use_bytes(const c10::Device& device) {
#ifdef NNSTRAIN_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].current;
  }
#endif
  if (cpu_tensor_counter_installed()) return cpu_tensor_bytes().in_use;
  const auto m = ::mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

int64_t peak_host_rss_bytes() {
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

namespace {
// Keeps the records of steps <= keep_through_step (rewritten durably); a torn
// last line (the interrupted run died mid-write) goes too.
void drop_records_after(const std::string& path, int64_t keep_through_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (rec.is_object() && rec.contains("step") && rec["step"].is_number_integer() &&
        rec["step"].get<int64_t>() <= keep_through_step)
      kept += line + "\n";
    else
      ++dropped;
  }
  in.close();
  checkpoint::write_file_durable(path, kept);
  if (dropped > 0)
    log::info("dropped " + std::to_string(dropped) + " records after step " + std::to_string(keep_through_step) +
              " from " + path + " (logged after the checkpoint this run resumes from)");
}
}  // namespace

JsonlSink::JsonlSink(const std::string& path, int64_t start_step) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  if (start_step > 0) drop_records_after(path, start_step);
  out_.open(path, start_step > 0 ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot open metrics file " + path);
}

void JsonlSink::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
}

}  // namespace nnstrain::train
