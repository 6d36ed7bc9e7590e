#include "data/loader.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <optional>

namespace nnstrain::data {

namespace {
Batch pinned(const Batch& b) {
  auto pin = [](const at::Tensor& t) { return t.defined() ? t.pin_memory() : t; };
  return {pin(b.x), pin(b.y), pin(b.positions), pin(b.segments), pin(b.pair_index)};
}
}  // namespace

PrefetchLoader::PrefetchLoader(Producer producer, int64_t first_index, int depth, c10::Device device,
                               bool pin_memory)
    : producer_(std::move(producer)),
      consumed_(first_index),
      depth_(depth < 0 ? 0 : depth),
      device_(device),
      pin_(pin_memory && device.is_cuda() && torch::cuda::is_available()) {
  if (!producer_) throw std::invalid_argument("PrefetchLoader: empty producer");
  if (depth_ > 0) thread_ = std::thread([this, first_index] { run(first_index); });
}

PrefetchLoader::~PrefetchLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PrefetchLoader::run(int64_t index) {
  // Pinned host memory belongs to the training device's context: without this
  // guard the thread would pin on (and open a context on) cuda:0.
  std::optional<c10::DeviceGuard> guard;
  if (pin_) guard.emplace(device_);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || int(queue_.size()) < depth_; });
      if (stop_) return;
    }
    Item item;
    try {
      item.batch = producer_(index);
      // Pinning here, off the training thread, makes next()'s host-to-device copies asynchronous.
      if (pin_) item.batch = pinned(item.batch);
    } catch (...) {
      item.error = std::current_exception();
    }
    const bool failed = item.error != nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
    if (failed) return;  // nothing after a failed index is meaningful
    ++index;
  }
}

Batch PrefetchLoader::to_device(Batch b) const {
  if (device_.is_cpu()) return b;
  // Asynchronous copies from pinned memory; the caching host allocator keeps a
  // pinned block alive until the copy that reads it has run.
  if (pin_ && !b.x.is_pinned()) b = pinned(b);
  auto to = [&](const at::Tensor& t) { return t.defined() ? t.to(device_, /*non_blocking=*/pin_) : t; };
  return {to(b.x), to(b.y), to(b.positions), to(b.segments), to(b.pair_index)};
}

Batch PrefetchLoader::next() {
  if (error_) std::rethrow_exception(error_);
  if (depth_ == 0) {
    Batch b;
    try {
      b = producer_(consumed_);
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
    ++consumed_;
    return to_device(std::move(b));
  }
  Item item;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !queue_.empty(); });
    item = std::move(queue_.front());
    queue_.pop_front();
  }
  cv_.notify_all();
  if (item.error) {
    error_ = item.error;
    std::rethrow_exception(error_);
  }
  ++consumed_;
  return to_device(std::move(item.batch));
}

}  // namespace nnstrain::data
