#include "trainer/dist/nccl_rules.h"

#include <ATen/ATen.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace nnstrain::dist {

namespace {

// Gloo slots: the data, and the receivers' ready tokens. One FIFO each per
// ordered pair of ranks, whatever tag the caller meant.
constexpr int kDataTag = 0;
constexpr int kReadyTag = 1;

class GroupWork : public c10d::Work {
 public:
  void done(std::exception_ptr e) { finish(std::move(e)); }
};

}  // namespace

bool WorkList::isCompleted() {
  for (auto& w : works_)
    if (!w->isCompleted()) return false;
  return true;
}

bool WorkList::isSuccess() const {
  for (const auto& w : works_)
    if (!w->isSuccess()) return false;
  return true;
}

std::exception_ptr WorkList::exception() const {
  for (const auto& w : works_)
    if (auto e = w->exception()) return e;
  return nullptr;
}

bool WorkList::wait(std::chrono::milliseconds timeout) {
  for (auto& w : works_) w->wait(timeout);
  return true;
}

struct NcclRulesP2P::State {
  c10::intrusive_ptr<c10d::Backend> gloo;
  std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::vector<P2POp>, c10::intrusive_ptr<GroupWork>>> queue;
  bool stop = false, busy = false;
  std::exception_ptr broken;  // a group failed: the stream is gone, every later group fails with it
  std::thread thread;

  // One group, as NCCL runs it: its receives announced (a token each to the
  // sender), its sends held until each receive is announced, then all the data
  // at once. The tokens of one ordered pair arrive in the order the receives
  // were posted, so the n-th send waits for exactly the n-th receive.
  void run(std::vector<P2POp>& ops) {
    std::vector<c10::intrusive_ptr<c10d::Work>> announced, heard, data;
    for (auto& op : ops)
      if (!op.send) {
        std::vector<at::Tensor> t{at::zeros({1}, at::kInt)};
        announced.push_back(gloo->send(t, op.peer, kReadyTag));
      }
    for (auto& op : ops)
      if (op.send) {
        std::vector<at::Tensor> t{at::zeros({1}, at::kInt)};
        heard.push_back(gloo->recv(t, op.peer, kReadyTag));
      }
    for (auto& w : heard) w->wait(timeout);
    for (auto& op : ops) {
      std::vector<at::Tensor> t{op.tensor};
      data.push_back(op.send ? gloo->send(t, op.peer, kDataTag) : gloo->recv(t, op.peer, kDataTag));
    }
    for (auto& w : data) w->wait(timeout);
    for (auto& w : announced) w->wait(timeout);
  }

  void loop() {
    for (;;) {
      std::pair<std::vector<P2POp>, c10::intrusive_ptr<GroupWork>> item;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        item = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      std::exception_ptr error = broken;
      if (!error) {
        try {
          run(item.first);
        } catch (...) {
          error = broken = std::current_exception();
        }
      }
      item.first.clear();  // the tensors go before the work reports done
      item.second->done(error);
      std::lock_guard<std::mutex> lock(mu);
      busy = false;
    }
  }
};

NcclRulesP2P::NcclRulesP2P(c10::intrusive_ptr<c10d::Backend> gloo, std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  state_->gloo = std::move(gloo);
  state_->timeout = timeout;
  state_->thread = std::thread([s = state_] { s->loop(); });
}

NcclRulesP2P::~NcclRulesP2P() {
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
    busy = state_->busy || !state_->queue.empty();
  }
  state_->cv.notify_all();
  // A group stuck on a peer that never answers ends at its timeout; the thread
  // holds the state, so it may finish after this object is gone.
  if (busy) state_->thread.detach();
  else state_->thread.join();
}

c10::intrusive_ptr<c10d::Work> NcclRulesP2P::post(std::vector<P2POp> ops) {
  auto work = c10::make_intrusive<GroupWork>();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.emplace_back(std::move(ops), work);
  }
  state_->cv.notify_all();
  return work;
}

}  // namespace nnstrain::dist
