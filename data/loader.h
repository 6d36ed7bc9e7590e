// PrefetchLoader: a background thread produces batches index, index + 1, ... into a
// bounded queue so the training loop never waits on data. Batches come back in order,
// on the target device (host memory pinned and non_blocking copies when it is CUDA).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include <c10/core/Device.h>

#include "data/token_bin.h"

namespace nnstrain::data {

class PrefetchLoader {
 public:
  using Producer = std::function<Batch(int64_t index)>;

  // depth: batches prepared ahead (DataloaderArgs::prefetch); 0 = produce synchronously in next().
  // pin_memory takes effect only when `device` is CUDA and CUDA is available.
  PrefetchLoader(Producer producer, int64_t first_index, int depth, c10::Device device, bool pin_memory);
  ~PrefetchLoader();  // stops the thread (waits for a producer call in flight)
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  // The batch for next_index(), on the device. Rethrows an exception the producer raised
  // for that index (and again on every later call).
  Batch next();
  // Index the next call to next() returns: the data cursor a checkpoint records.
  int64_t next_index() const { return consumed_; }

 private:
  struct Item {
    Batch batch;
    std::exception_ptr error;
  };
  void run(int64_t index);
  Batch to_device(Batch b) const;

  Producer producer_;
  int64_t consumed_;
  int depth_;
  c10::Device device_;
  bool pin_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::exception_ptr error_;  // sticky once next() has hit it
  std::thread thread_;
};

}  // namespace nnstrain::data
