// The fault-tolerance pieces that need no run: the data position under skipped
// windows, and the flight recorder's line-up of the ranks' records (a rank
// missing from a collective, a different op, a different size, a rank with no
// record at all), from records written by FlightRecorder itself.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <tuple>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "trainer/dist/flight_recorder.h"
#include "trainer/train/fault_tolerance.h"

namespace fs = std::filesystem;
using nnstrain::dist::FlightRecorder;
using nnstrain::train::SkipWindows;

TEST_CASE("data_step moves past every skipped window", "[fault_tolerance]") {
  const SkipWindows none;
  CHECK(nnstrain::train::data_step(none, 7) == 7);
  // Data steps 3 and 4 skipped, then 9.
  const auto w = nnstrain::train::add_window(nnstrain::train::add_window({}, 9, 10), 3, 5);
  REQUIRE(w == SkipWindows{{3, 5}, {9, 10}});
  std::vector<int64_t> read;
  for (int64_t s = 0; s < 9; ++s) read.push_back(nnstrain::train::data_step(w, s));
  CHECK(read == std::vector<int64_t>{0, 1, 2, 5, 6, 7, 8, 10, 11});
  // Touching windows merge.
  CHECK(nnstrain::train::add_window(w, 5, 7) == SkipWindows{{3, 7}, {9, 10}});
}

namespace {

// A rank's record after issuing `ops` (op, what, bytes) on group "dp" of ranks {0, 1}, all completed
// except the last when `hang`.
nlohmann::json record(int rank, const std::vector<std::tuple<const char*, const char*, int64_t>>& ops, bool hang,
                      const fs::path& dir) {
  const auto path = (dir / ("rank" + std::to_string(rank) + ".json")).string();
  FlightRecorder f(path, 8, rank, 3);
  int64_t seq = 0;
  int key = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [op, what, bytes] = ops[i];
    const auto id = f.issued("dp", {0, 1}, op, what, bytes, ++seq);
    f.started(id, &key + i);
    if (!(hang && i + 1 == ops.size())) f.completed(&key + i);
  }
  REQUIRE(f.dump("test"));
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

}  // namespace

TEST_CASE("flight records lined up name the first disagreement", "[fault_tolerance]") {
  const auto dir = fs::temp_directory_path() / ("nnstrain_flight_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::tuple<const char*, const char*, int64_t> loss{"all_reduce", "loss all-reduce", 4},
      grads{"all_reduce", "gradient bucket", 4096};

  SECTION("a rank that never joined") {
    const auto a = record(0, {loss, grads, loss}, true, dir), b = record(1, {loss, grads}, false, dir);
    const auto lines = nnstrain::dist::align_flight_records({a, b}, 2);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0] == "group dp (ranks 0,1) collective #3: rank 1 never joined all_reduce 'loss all-reduce' "
                      "(4 bytes), which rank 0 issued (state: issued)");
  }
  SECTION("a different size") {
    const auto a = record(0, {loss, grads}, false, dir);
    const auto b = record(1, {loss, {"all_reduce", "gradient bucket", 2048}}, false, dir);
    const auto lines = nnstrain::dist::align_flight_records({a, b}, 2);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].find("collective #2: the ranks disagree: rank 0 issued all_reduce 'gradient bucket' of 4096 "
                        "bytes, rank 1 all_reduce 'gradient bucket' of 2048 bytes") != std::string::npos);
  }
  SECTION("a rank with no record is named at the collective the others did not complete") {
    const auto a = record(0, {loss, grads, loss}, true, dir);
    const auto lines = nnstrain::dist::align_flight_records({a}, 3);
    REQUIRE(lines.size() == 2);
    CHECK(lines[0] == "ranks with no flight record (gone or frozen before they could write): 1,2");
    CHECK(lines[1].find("collective #3: rank 1 never joined all_reduce 'loss all-reduce'") != std::string::npos);
  }
  SECTION("ranks that agree") {
    const auto a = record(0, {loss, grads}, false, dir), b = record(1, {loss, grads}, false, dir);
    CHECK(nnstrain::dist::align_flight_records({a, b}, 2).empty());
  }
  // Not fs::remove_all: libtorch exports its own copy of it (trainer/checkpoint/checkpoint.h, remove_tree).
  for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());
  fs::remove(dir);
}
