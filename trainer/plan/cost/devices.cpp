// The accelerators the cost model knows (a table), the device a run gets
// (device_spec: by name, or the CUDA device's own), its FLOP/s per precision,
// the memory budget and the links collectives take.
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <limits>

#include <unistd.h>

#ifdef NNSTRAIN_CUDA
#include <cuda_runtime_api.h>
#endif

#include "trainer/plan/cost/setting.h"

namespace nnstrain::parallel {

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The table. Memory as the driver reports it (GiB); dense peaks from the data
// sheets (SXM parts); bandwidth: NVLink per direction for ranks of one node,
// one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU between nodes.
const std::vector<DeviceSpec>& table() {
  static const std::vector<DeviceSpec> t = {
      // Host link: PCIe Gen5 x16 (H100/H200) or Gen4 (A100) as achieved by
      // pinned copies, about half the nominal; host AdamW: a server socket's
      // memory bandwidth shared by 8 ranks, a rough figure.
      // Device memory bandwidth: the data sheets' HBM figure.
      {"H100", 80 * kGiB, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6, 25e9, 10e9, 3.35e12},
      {"H200", 141e9, 989e12, 494e12, 67e12, 450e9, 50e9, 8, 20e-6, 25e9, 10e9, 4.8e12},
      {"A100-80G", 80 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6, 12e9, 10e9, 2.039e12},
      {"A100-40G", 40 * kGiB, 312e12, 156e12, 19.5e12, 300e9, 25e9, 8, 20e-6, 12e9, 10e9, 1.555e12},
      // A CPU rank: memory is filled in from the machine; the rates are a
      // rough server-socket figure, for relative choices only.
      {"cpu", 0, 1e12, 1e12, 1e12, 10e9, 1.25e9, 8, 100e-6, 10e9, 10e9, 10e9},
  };
  return t;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
}

DeviceSpec table_entry(const std::string& name) {
  for (const auto& d : table())
    if (lower(d.name) == lower(name)) {
      DeviceSpec s = d;
      if (s.name == "cpu") s.memory_bytes = physical_memory_bytes();
      return s;
    }
  throw PlanError("unknown device '" + name + "'; known: H100, H200, A100-80G, A100-40G, cpu, auto");
}

// The current CUDA device (the rank's own once bound) as a table entry: matched
// by name, memory as reported.
DeviceSpec cuda_device_spec() {
#ifdef NNSTRAIN_CUDA
  cudaDeviceProp prop{};
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
    const std::string name = prop.name;
    const double mem = double(prop.totalGlobalMem);
    DeviceSpec s = table_entry("H100");
    if (name.find("H200") != std::string::npos) s = table_entry("H200");
    else if (name.find("A100") != std::string::npos) s = table_entry(mem > 60 * kGiB ? "A100-80G" : "A100-40G");
    else if (name.find("H100") == std::string::npos) s.name = name + " (H100 rates assumed)";
    s.memory_bytes = mem;
    if (s.name.find(name) == std::string::npos) s.name += " (" + name + ")";
    return s;
  }
#endif
  DeviceSpec s = table_entry("H100");
  s.name = "cuda (name unknown to this build: H100 assumed)";
  return s;
}

}  // namespace

std::vector<std::string> known_devices() {
  std::vector<std::string> names;
  for (const auto& d : table()) names.push_back(d.name);
  return names;
}

DeviceSpec device_spec(const std::string& name_or_auto) {
  const std::string n = lower(name_or_auto);
  if (n == "auto" || n == "cuda" || n.empty()) {
    if (torch::cuda::is_available()) return cuda_device_spec();
    if (n == "cuda") throw PlanError("device cuda requested but no CUDA device is available");
    return table_entry("cpu");
  }
  return table_entry(name_or_auto);
}

double peak_flops_for(const DeviceSpec& device, const std::string& precision, bool allow_tf32) {
  if (precision.rfind("32", 0) == 0) return allow_tf32 ? device.peak_flops_tf32 : device.peak_flops_fp32;
  return device.peak_flops;
}

double memory_budget(const PlanRequest& req) {
  if (req.memory_budget_bytes > 0) return req.memory_budget_bytes;
  if (req.device.memory_bytes > 0) return kDefaultMemoryFraction * req.device.memory_bytes;
  return std::numeric_limits<double>::infinity();
}

double cost::link_bw(const DeviceSpec& dev, double span) {
  return span <= std::max(1, dev.ranks_per_node) ? dev.intra_node_bw : dev.inter_node_bw;
}

}  // namespace nnstrain::parallel
