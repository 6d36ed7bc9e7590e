#include "trainer/train/log.h"

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
  l->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
}
void info(const std::string& msg) { logger()->info(msg); }
void warn(const std::string& msg) { logger()->warn(msg); }
void error(const std::string& msg) { logger()->error(msg); }

}  // namespace nnstrain::log
