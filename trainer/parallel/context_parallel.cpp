#include "trainer/parallel/context_parallel.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace nnstrain::parallel {

namespace {

class BackendCpComm : public models::common::CpComm {
 public:
  BackendCpComm(c10::intrusive_ptr<c10d::Backend> b, std::chrono::milliseconds timeout)
      : b_(std::move(b)), timeout_(timeout) {}
  int size() const override { return b_ ? b_->getSize() : 1; }
  int rank() const override { return b_ ? b_->getRank() : 0; }

  Pending ring_shift_start(const at::Tensor& t, int channel) override {
    static const char* what = "context-parallel ring send/recv";
    auto in = t.contiguous();
    if (size() == 1) return [in] { return in; };
    auto out = at::empty_like(in);
    const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
    std::vector<at::Tensor> send{in}, recv{out};
    c10::intrusive_ptr<c10d::Work> sent, received, both;
    guard(what, [&] {
      const bool batch = b_->supportsCoalescing();  // NCCL: one group, as batch_isend_irecv
      if (batch) b_->startCoalescing();
      sent = b_->send(send, next, channel);
      received = b_->recv(recv, prev, channel);
      if (batch) both = b_->endCoalescing();
    });
    return [this, sent, received, both, in, out] {  // `in` lives until it is sent
      guard(what, [&] {
        if (both) {
          wait(both);
        } else {
          wait(received);
          wait(sent);
        }
      });
      return out;
    };
  }

  at::Tensor all_gather(const at::Tensor& t) override {
    auto in = t.contiguous();
    if (size() == 1) return in.unsqueeze(0);
    auto shape = in.sizes().vec();
    shape.insert(shape.begin(), size());
    auto out = at::empty(shape, in.options());
    // Gloo takes flat buffers: [cp x n] out of [n] in.
    auto flat_out = out.view({-1}), flat_in = in.view({-1});
    guard("context-parallel all-gather", [&] { wait(b_->_allgather_base(flat_out, flat_in)); });
    return out;
  }

  at::Tensor reduce_scatter(const at::Tensor& t) override {
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == size(), "reduce_scatter: expected [cp, ...], got ", t.sizes());
    auto in = t.contiguous();
    if (size() == 1) return in[0];
    auto out = at::empty(in.sizes().slice(1), in.options());
    auto flat_out = out.view({-1}), flat_in = in.view({-1});
    guard("context-parallel reduce-scatter", [&] { wait(b_->_reduce_scatter_base(flat_out, flat_in)); });
    return out;
  }

 private:
  void wait(const c10::intrusive_ptr<c10d::Work>& w) {
    if (b_->getBackendName() == "nccl") w->wait();  // the current stream waits; the host goes on
    else w->wait(timeout_);
  }
  template <typename F>
  void guard(const char* what, F&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      throw std::runtime_error(std::string(what) + " on rank " + std::to_string(rank()) + " of " +
                               std::to_string(size()) + " failed: " + e.what_without_backtrace());
    }
  }

  c10::intrusive_ptr<c10d::Backend> b_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

c10::intrusive_ptr<models::common::CpComm> make_cp_comm(c10::intrusive_ptr<c10d::Backend> backend,
                                                        std::chrono::milliseconds timeout) {
  return c10::make_intrusive<BackendCpComm>(std::move(backend), timeout);
}

}  // namespace nnstrain::parallel
