// Which device a rank trains on, chosen and bound before any CUDA work, process
// group or allocation: rank r of a node takes cuda:LOCAL_RANK, as torchrun's
// workers do, so no two ranks open a context on the same GPU by accident.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "trainer/dist/dist_env.h"

namespace nnstrain::dist {

// The choice alone, for tests: `want` is compute_config.device (auto | cpu | cuda),
// `visible` the number of CUDA devices this process sees. Throws DistEnvError
// naming the rank when LOCAL_RANK has no device of its own. `share` (the
// NNSTRAIN_SHARE_DEVICES=1 escape hatch, for Gloo runs of several ranks on one
// GPU) maps local ranks onto the visible devices round-robin instead.
// `cuda_built`: this binary has nnstrain's CUDA code (NNSTRAIN_CUDA). One
// without it links a CUDA LibTorch all the same, but its CUDA paths (the
// asynchronous save's copy synchronisation, CUDA memory figures, NCCL) are
// compiled out: it refuses `cuda` and takes the CPU under `auto`.
c10::Device choose_device(const std::string& want, const DistEnv& env, int visible, bool share, bool cuda_built);
// Whether this binary was built with nnstrain's CUDA code.
bool built_with_cuda();

// choose_device() on this machine, then makes the chosen CUDA device current
// for this thread (later CUDA work, NCCL communicators and the caching
// allocator all follow it).
c10::Device bind_device(const std::string& want, const DistEnv& env);

// compute_config.allow_tf32: TF32 tensor cores for fp32 matmuls (cuBLAS) and
// convolutions (cuDNN), as torch.backends.cuda.matmul.allow_tf32 and
// torch.backends.cudnn.allow_tf32 set them; off means full fp32 in both.
void set_allow_tf32(bool allow);

}  // namespace nnstrain::dist
