#include "trainer/optim/comm.h"

#include <torch/torch.h>

namespace nnstrain::optim {

namespace {
class LocalComm : public OptimizerComm {
 public:
  LocalComm(c10::Device device, int global_rank) : device_(device), global_rank_(global_rank) {}
  int size() const override { return 1; }
  int rank() const override { return 0; }
  int global_rank(int) const override { return global_rank_; }
  c10::Device device() const override { return device_; }
  at::Tensor all_gather(const at::Tensor& in) override { return in.clone(); }
  at::Tensor all_to_all(const at::Tensor& in, const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    return in.clone();
  }

 private:
  c10::Device device_;
  int global_rank_;
};
}  // namespace

std::shared_ptr<OptimizerComm> local_comm(c10::Device device, int global_rank) {
  return std::make_shared<LocalComm>(device, global_rank);
}

}  // namespace nnstrain::optim
