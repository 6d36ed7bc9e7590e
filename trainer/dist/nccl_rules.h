// NCCL's point-to-point rules, enforced on Gloo (NNSTRAIN_P2P_SEMANTICS=nccl),
// so that CPU tests fail where a GPU cluster would hang or mis-pair:
//   1. tags are ignored: between two ranks of a communicator the n-th send is
//      matched with the n-th receive, in issue order (one FIFO per ordered pair);
//   2. a send completes only once the peer has posted the matching receive
//      (an ncclSend larger than the connection buffer does exactly that);
//   3. a group's operations (ncclGroupStart/End; c10d's coalescing) progress
//      together, and the groups of one communicator run one after another, in
//      issue order (one NCCL stream per communicator and device).
// A group is carried by this communicator's worker thread, its "stream": the
// receiving side first sends each peer a small ready token per receive, the
// sending side waits for one token per send, then the data moves. Used only by
// process_groups.cpp; the rules are written down in docs/parallelism.md.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::dist {

// One operation of a coalesced point-to-point group: send `tensor` to, or
// receive it from, `peer` (an index into the group's ranks).
struct P2POp {
  bool send = true;
  at::Tensor tensor;
  int peer = 0;
};

// Work made of several works: complete when all are, waited one after another.
class WorkList : public c10d::Work {
 public:
  explicit WorkList(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

class NcclRulesP2P {
 public:
  NcclRulesP2P(c10::intrusive_ptr<c10d::Backend> gloo, std::chrono::milliseconds timeout);
  ~NcclRulesP2P();
  NcclRulesP2P(const NcclRulesP2P&) = delete;
  NcclRulesP2P& operator=(const NcclRulesP2P&) = delete;

  // Queues `ops` as one group behind the groups posted before; the work
  // completes when every operation of the group has.
  c10::intrusive_ptr<c10d::Work> post(std::vector<P2POp> ops);

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the worker thread, which may outlive a stuck destructor
};

}  // namespace nnstrain::dist
