#include "base/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

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
}  // namespace

void init(int rank, int world_size) {
  auto l = logger();
  if (world_size > 1) l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  // The terminal gets rank 0's info and every rank's warnings; a rank's log file (add_file) gets its info too.
  l->set_level(spdlog::level::info);
  l->sinks().front()->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
}
void add_file(const std::string& path) {
  auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  sink->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  auto& sinks = logger()->sinks();
  sinks.resize(1);  // one log file at a time: the terminal sink stays first
  sinks.push_back(sink);
  logger()->flush_on(spdlog::level::info);
}
void info(const std::string& msg) { logger()->info(msg); }
void warn(const std::string& msg) { logger()->warn(msg); }
void error(const std::string& msg) { logger()->error(msg); }

}  // namespace nnstrain::log
