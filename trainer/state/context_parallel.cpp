#include "trainer/state/context_parallel.h"

#include <torch/torch.h>

#include <cstdlib>
#include <csignal>
#include <string>

namespace nnstrain::parallel {

namespace {

// Test-only: NNSTRAIN_TEST_KILL_IN_RING=N:RANK kills global rank RANK with
// SIGKILL as it enters its N-th ring step (1-based), before sending: a rank
// lost inside a ring step (tests/integration/test_context_parallel.py).
void maybe_die_in_ring(int global_rank) {
  static const std::string at = [] {
    const char* e = std::getenv("NNSTRAIN_TEST_KILL_IN_RING");
    return std::string(e ? e : "");
  }();
  if (at.empty()) return;
  static int64_t steps = 0;
  const auto colon = at.find(':');
  if (++steps == std::stoll(at.substr(0, colon)) && std::stoi(at.substr(colon + 1)) == global_rank)
    std::raise(SIGKILL);
}

class RuntimeCpComm : public models::common::CpComm {
 public:
  explicit RuntimeCpComm(dist::Runtime& rt) : rt_(rt) {}
  int size() const override { return rt_.cp.size(); }
  int rank() const override { return rt_.cp.rank; }

  // `channel` tells concurrent steps apart for the model's code only: on the
  // wire (NCCL's rules on every backend) their order does, and every rank of
  // the cp group starts them in the same order (docs/parallelism.md).
  Pending ring_shift_start(const at::Tensor& t, int /*channel*/) override {
    static const char* what = "context-parallel ring send/recv";
    auto in = t.contiguous();
    if (size() == 1) return [in] { return in; };
    maybe_die_in_ring(rt_.rank());
    auto out = at::empty_like(in);
    auto work = rt_.ring_shift_async(rt_.cp, in, out, what);
    return [this, work, in, out] {  // `in` lives until it is sent
      rt_.wait(work, rt_.cp, what);
      return out;
    };
  }

  at::Tensor all_gather(const at::Tensor& t) override {
    static const char* what = "context-parallel all-gather";
    auto in = t.contiguous();
    if (size() == 1) return in.unsqueeze(0);
    auto shape = in.sizes().vec();
    shape.insert(shape.begin(), size());
    auto out = at::empty(shape, in.options());
    rt_.wait(rt_.all_gather_async(rt_.cp, out.view({-1}), in.view({-1}), what), rt_.cp, what);
    return out;
  }

  at::Tensor reduce_scatter(const at::Tensor& t) override {
    static const char* what = "context-parallel reduce-scatter";
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == size(), "reduce_scatter: expected [cp, ...], got ", t.sizes());
    auto in = t.contiguous();
    if (size() == 1) return in[0];
    auto out = at::empty(in.sizes().slice(1), in.options());
    rt_.wait(rt_.reduce_scatter_async(rt_.cp, out.view({-1}), in.view({-1}), what), rt_.cp, what);
    return out;
  }

 private:
  dist::Runtime& rt_;
};

}  // namespace

c10::intrusive_ptr<models::common::CpComm> make_cp_comm(dist::Runtime& rt) {
  return c10::make_intrusive<RuntimeCpComm>(rt);
}

}  // namespace nnstrain::parallel
