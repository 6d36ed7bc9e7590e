#include "trainer/checkpoint/rng_state.h"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <mutex>
#include <string>

namespace nnstrain::checkpoint {

namespace {

// (name, device) of every generator this rank's state includes.
std::vector<std::pair<std::string, c10::Device>> generators(int rank, c10::Device device) {
  const std::string suffix = "/rank" + std::to_string(rank);
  std::vector<std::pair<std::string, c10::Device>> out{{"rng/cpu" + suffix, c10::Device(c10::kCPU)}};
  if (device.is_cuda()) {
    const int n = static_cast<int>(torch::cuda::device_count());
    for (int i = 0; i < n; ++i)
      out.push_back({"rng/cuda" + std::to_string(i) + suffix, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))});
  }
  return out;
}

}  // namespace

std::vector<StateTensor> rng_state_tensors(int rank, c10::Device device, const std::vector<ExtraRngState>& extra) {
  std::vector<StateTensor> out;
  for (const auto& e : extra) {
    auto spec = ShardSpec::full("rng/" + e.name + "/rank" + std::to_string(rank), "U8", {e.state.numel()});
    spec.replica_ranks = {rank};
    out.push_back({spec, e.state.contiguous()});
  }
  for (const auto& [name, dev] : generators(rank, device)) {
    auto gen = at::globalContext().defaultGenerator(dev);
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    auto spec = ShardSpec::full(name, "U8", {state.numel()});
    spec.replica_ranks = {rank};
    out.push_back({spec, state});
  }
  return out;
}

std::vector<std::string> restore_rng_state(const Checkpoint& ck, int rank, c10::Device device,
                                           std::vector<ExtraRngState>* extra) {
  std::vector<std::string> restored;
  std::vector<ExtraRngState> none;
  for (auto& e : extra ? *extra : none) {  // both lvalues: e refers into *extra
    const auto name = "rng/" + e.name + "/rank" + std::to_string(rank);
    if (!ck.has(name)) continue;
    const auto stored = ck.pieces(name).front().first;
    StateTensor st{stored, torch::empty({stored.numel()}, torch::kUInt8)};
    ck.load_into(st);
    e.state = st.tensor;
    restored.push_back(name);
  }
  for (const auto& [name, dev] : generators(rank, device)) {
    if (!ck.has(name)) continue;
    const auto stored = ck.pieces(name).front().first;
    StateTensor st{stored, torch::empty({stored.numel()}, torch::kUInt8)};
    ck.load_into(st);
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(st.tensor);
    restored.push_back(name);
  }
  return restored;
}

}  // namespace nnstrain::checkpoint
