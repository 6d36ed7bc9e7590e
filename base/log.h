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

}  // namespace nnstrain::log
