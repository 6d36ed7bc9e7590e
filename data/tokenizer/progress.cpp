#include "data/tokenizer/progress.h"

#include <cstdio>

namespace nnstrain::tok {

ProgressLine::ProgressLine(std::string label, const EncodeProgress& counters, uint64_t total_bytes)
    : label_(std::move(label)), counters_(counters), total_(total_bytes), start_(std::chrono::steady_clock::now()) {
  thread_ = std::thread([this] { run(); });
}

ProgressLine::~ProgressLine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (printed_) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "%s\n", line(s).c_str());
  }
}

std::string ProgressLine::line(double seconds) const {
  const double mb = counters_.bytes.load() / 1e6;
  const double rate = seconds > 0 ? mb / seconds : 0;
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "%s: %.1f MB", label_.c_str(), mb);
  if (total_) n += std::snprintf(buf + n, sizeof buf - n, " of %.1f MB", total_ / 1e6);
  n += std::snprintf(buf + n, sizeof buf - n, ", %llu documents, %.1f MB/s",
                     static_cast<unsigned long long>(counters_.docs.load()), rate);
  if (total_ && rate > 0) {
    const double left = (total_ / 1e6 - mb) / rate;
    std::snprintf(buf + n, sizeof buf - n, ", ETA %.0f s", left > 0 ? left : 0.0);
  }
  return buf;
}

void ProgressLine::run() {
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_for(lock, std::chrono::seconds(2), [this] { return stop_; })) return;
  while (!stop_) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "%s\n", line(s).c_str());
    printed_ = true;
    cv_.wait_for(lock, std::chrono::seconds(5), [this] { return stop_; });
  }
}

}  // namespace nnstrain::tok
