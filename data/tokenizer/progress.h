// A progress line for long work (tokenizing a corpus): bytes, documents, MB/s and
// ETA on stderr, once a second after the first two seconds (so short runs stay quiet).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "data/tokenizer/tokenizer.h"

namespace nnstrain::tok {

class ProgressLine {
 public:
  // total_bytes: 0 when unknown (no ETA).
  ProgressLine(std::string label, const EncodeProgress& counters, uint64_t total_bytes);
  ~ProgressLine();  // stops; prints a final line if any line was printed
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

 private:
  void run();
  std::string line(double seconds) const;

  std::string label_;
  const EncodeProgress& counters_;
  uint64_t total_;
  std::chrono::steady_clock::time_point start_;
  bool printed_ = false;
  bool stop_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace nnstrain::tok
