// Logging facade over spdlog. spdlog and its fmt live only in log.cpp: the torch
// wheel ships its own, newer fmt headers, and the two must never meet in one TU.
#pragma once

#include <string>

namespace nnstrain::log {

// Rank 0 logs info and up; other ranks only warnings and errors (prefixed with their rank).
void init(int rank, int world_size);
// Also write everything this rank logs (info and up, every rank) to `path`, appended.
void add_file(const std::string& path);
void info(const std::string& msg);
void warn(const std::string& msg);
void error(const std::string& msg);
// The rank's log file only (add_file), never the terminal.
void debug(const std::string& msg);

// While one lives, LibTorch's own log records that this thread writes (c10's
// "[W1124 12:00:00.123456 42 TCPStore.cpp:106] ..." lines, with any backtrace,
// written to std::cerr) go to the rank's log file (debug), not the terminal.
// Only around LibTorch calls whose failure nnstrain reports itself in one line:
// the rendezvous, the heartbeat's writes to the store, and the failure
// diagnosis's probe of a store that may be gone. Other threads' records are untouched.
// Takes effect once init() has run.
class QuietTorchLog {
 public:
  QuietTorchLog();
  ~QuietTorchLog();
  QuietTorchLog(const QuietTorchLog&) = delete;
  QuietTorchLog& operator=(const QuietTorchLog&) = delete;
};

}  // namespace nnstrain::log
