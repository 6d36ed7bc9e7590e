#include "trainer/dist/device.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <torch/cuda.h>

#include <cstdlib>

#include "base/log.h"

namespace nnstrain::dist {

bool built_with_cuda() {
#ifdef NNSTRAIN_CUDA
  return true;
#else
  return false;
#endif
}

c10::Device choose_device(const std::string& want, const DistEnv& env, int visible, bool share, bool cuda_built) {
  const std::string who = "rank " + std::to_string(env.rank) + ": ";
  if (want == "cpu" || (want == "auto" && (visible == 0 || !cuda_built))) return c10::Device(c10::kCPU);
  if (!cuda_built)
    throw DistEnvError(who + "compute_config.device is cuda but this nnstrain was built without its CUDA code "
                             "(NNSTRAIN_WITH_CUDA=OFF, or no CUDA toolkit at configure): rebuild with a CUDA toolkit, "
                             "or set compute_config.device: cpu");
  if (visible == 0)
    throw DistEnvError(who + "compute_config.device is cuda but no CUDA device is visible");
  int index = env.local_rank;
  if (share) {
    index = env.local_rank % visible;
  } else if (env.local_rank >= visible) {
    const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
    throw DistEnvError(who + "LOCAL_RANK " + std::to_string(env.local_rank) + " needs cuda:" +
                       std::to_string(env.local_rank) + " but only " + std::to_string(visible) +
                       " CUDA device(s) are visible" + (cvd ? " (CUDA_VISIBLE_DEVICES=" + std::string(cvd) + ")" : "") +
                       ": start at most " + std::to_string(visible) + " processes per node");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

c10::Device bind_device(const std::string& want, const DistEnv& env) {
  // device_count() asks the driver only; it creates no context.
  const int visible = want == "cpu" ? 0 : static_cast<int>(torch::cuda::device_count());
  const char* share = std::getenv("NNSTRAIN_SHARE_DEVICES");
  const auto device = choose_device(want, env, visible, share && std::string(share) == "1", built_with_cuda());
  if (want == "auto" && visible > 0 && !built_with_cuda())
    log::warn("rank " + std::to_string(env.rank) + ": compute_config.device auto: " + std::to_string(visible) +
              " CUDA device(s) visible, but this nnstrain was built without its CUDA code (NNSTRAIN_WITH_CUDA=OFF, "
              "or no CUDA toolkit at configure): training on the CPU");
  if (device.is_cuda()) at::accelerator::setDeviceIndex(device.index());
  return device;
}

void set_allow_tf32(bool allow) {
  at::globalContext().setAllowTF32CuBLAS(allow);
  at::globalContext().setAllowTF32CuDNN(allow);
}

}  // namespace nnstrain::dist
