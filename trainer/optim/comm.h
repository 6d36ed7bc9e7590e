// Collectives an optimizer may need (Muon gathers each matrix whole to one
// rank): over the ranks that share this pipeline stage's parameters (dp x cp x
// tp at this pp index, Runtime::stage). Every member calls them in the same
// order; tensors live on device(). Implemented over the Runtime in
// trainer/state/optimizer_comm.cpp, and for one process below.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace nnstrain::optim {

class OptimizerComm {
 public:
  virtual ~OptimizerComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;                  // this process's index among the members
  virtual int global_rank(int member) const = 0; // a member's rank in the world
  virtual c10::Device device() const = 0;
  // Every member's `in` (the same numel on all), concatenated in member order.
  virtual at::Tensor all_gather(const at::Tensor& in) = 0;
  // in_splits[d] elements of the flat `in` to member d; returns what each
  // member s sent here (out_splits[s] elements), concatenated in member order.
  virtual at::Tensor all_to_all(const at::Tensor& in, const std::vector<int64_t>& in_splits,
                                const std::vector<int64_t>& out_splits) = 0;
};

// One process: every collective is a copy.
std::shared_ptr<OptimizerComm> local_comm(c10::Device device, int global_rank = 0);

}  // namespace nnstrain::optim
