#include "trainer/state/optimizer_comm.h"

#include <torch/torch.h>

#include <numeric>

#include "trainer/dist/process_groups.h"

namespace nnstrain::parallel {

namespace {
class StageComm : public optim::OptimizerComm {
 public:
  StageComm(dist::Runtime& rt, c10::Device device) : rt_(rt), device_(device) {}
  int size() const override { return rt_.stage.size(); }
  int rank() const override { return rt_.stage.rank; }
  int global_rank(int member) const override { return rt_.stage.ranks.at(member); }
  c10::Device device() const override { return device_; }
  at::Tensor all_gather(const at::Tensor& in) override {
    static const char* what = "optimizer all-gather";
    auto src = in.contiguous().view({-1});
    auto out = torch::empty({src.numel() * size()}, src.options());
    rt_.wait(rt_.all_gather_async(rt_.stage, out, src, what), rt_.stage, what);
    return out;
  }
  at::Tensor all_to_all(const at::Tensor& in, const std::vector<int64_t>& in_splits,
                        const std::vector<int64_t>& out_splits) override {
    static const char* what = "optimizer all-to-all (whole matrices)";
    auto out = torch::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})}, in.options());
    rt_.wait(rt_.all_to_all_async(rt_.stage, out, in.contiguous().view({-1}), out_splits, in_splits, what), rt_.stage,
             what);
    return out;
  }

 private:
  dist::Runtime& rt_;
  c10::Device device_;
};
}  // namespace

std::shared_ptr<optim::OptimizerComm> make_optimizer_comm(dist::Runtime* rt, c10::Device device) {
  if (!rt || rt->stage.size() < 2) return optim::local_comm(device, rt ? rt->rank() : 0);
  return std::make_shared<StageComm>(*rt, device);
}

}  // namespace nnstrain::parallel
