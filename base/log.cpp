#include "base/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <iostream>
#include <streambuf>

namespace nnstrain::log {

namespace {
std::shared_ptr<spdlog::logger> logger() {
  static auto l = [] {
    auto lg = spdlog::stderr_color_mt("nnstrain");
    lg->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
    return lg;
  }();
  return l;
}

thread_local int t_quiet = 0;  // QuietTorchLog scopes open on this thread

// c10's log record header (c10/util/Logging.cpp without glog): '[', the
// severity letter, the month's two digits.
bool is_torch_record(const char* s, std::streamsize n) {
  return n >= 3 && s[0] == '[' && (s[1] == 'I' || s[1] == 'W' || s[1] == 'E' || s[1] == 'F') && s[2] >= '0' &&
         s[2] <= '9';
}

// In front of std::cerr's buffer: passes everything through, except LibTorch's
// records written inside a QuietTorchLog scope (c10 writes each record whole, in
// one call), which go to the log file. Per-thread state only, so no lock.
class CerrFilter : public std::streambuf {
 public:
  explicit CerrFilter(std::streambuf* out) : out_(out) {}

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override;
  int_type overflow(int_type c) override {
    return traits_type::eq_int_type(c, traits_type::eof()) ? traits_type::not_eof(c) : out_->sputc(static_cast<char>(c));
  }
  int sync() override { return out_->pubsync(); }

 private:
  std::streambuf* out_;
};

std::streamsize CerrFilter::xsputn(const char* s, std::streamsize n) {
  if (t_quiet == 0 || !is_torch_record(s, n)) return out_->sputn(s, n);
  std::string record(s, static_cast<size_t>(n));
  while (!record.empty() && record.back() == '\n') record.pop_back();
  logger()->debug("LibTorch, in a store call whose failure nnstrain reports: " + record);
  return n;
}
}  // namespace

QuietTorchLog::QuietTorchLog() { ++t_quiet; }
QuietTorchLog::~QuietTorchLog() { --t_quiet; }

void init(int rank, int world_size) {
  auto l = logger();
  if (world_size > 1) l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  // The terminal gets rank 0's info and every rank's warnings; a rank's log file (add_file) gets its info too.
  l->set_level(spdlog::level::debug);
  l->sinks().front()->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  // Installed once, before any thread writes to std::cerr; never removed (threads may outlive main).
  static CerrFilter* filter = nullptr;
  if (!filter) {
    filter = new CerrFilter(std::cerr.rdbuf());
    std::cerr.rdbuf(filter);
  }
}
void add_file(const std::string& path) {
  auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  sink->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  auto& sinks = logger()->sinks();
  sinks.resize(1);  // one log file at a time: the terminal sink stays first
  sinks.push_back(sink);
  logger()->flush_on(spdlog::level::debug);  // a failing rank may leave by _Exit, which flushes nothing
}
void info(const std::string& msg) { logger()->info(msg); }
void warn(const std::string& msg) { logger()->warn(msg); }
void error(const std::string& msg) { logger()->error(msg); }
void debug(const std::string& msg) { logger()->debug(msg); }

}  // namespace nnstrain::log
