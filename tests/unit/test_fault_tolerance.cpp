// The fault-tolerance pieces that need no run: the data position under skipped
// windows, the flight recorder's line-up of the ranks' records (a rank
// missing from a collective, a different op, a different size, a rank with no
// record at all), from records written by FlightRecorder itself, and an earlier
// attempt's record kept out of it; the spike detector of one process fed
// values directly (a loss scaler's overflow, a confirmed non-finite run), a
// rewind killed in the middle of deleting a later checkpoint, and an
// asynchronous save of a step saved before (after a rewind) over two ranks.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "trainer/checkpoint/async_save.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/dist/flight_recorder.h"
#include "trainer/state/training_state.h"
#include "trainer/train/fault_tolerance.h"
#include "tests/unit/test_support.h"

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
  nnstrain::checkpoint::remove_tree(dir.string());
}

TEST_CASE("an earlier attempt's flight record is moved out of the report's way", "[fault_tolerance]") {
  nnstrain::testing::TempDir tmp;
  const fs::path flight = fs::path(tmp.path) / "flight";
  fs::create_directories(flight);
  // Attempt 0 of 3 ranks left records; attempt 1 runs 2 ranks.
  for (int r = 0; r < 3; ++r) std::ofstream(flight / ("rank" + std::to_string(r) + ".json")) << "{}";
  FlightRecorder f0((flight / "rank0.json").string(), 8, 0, 2);
  CHECK_FALSE(fs::exists(flight / "rank0.json"));
  CHECK_FALSE(fs::exists(flight / "rank2.json"));  // a rank this run does not have: rank 0 moves it
  CHECK(fs::exists(flight / "rank1.json"));        // rank 1 moves its own
  FlightRecorder f1((flight / "rank1.json").string(), 8, 1, 2);
  CHECK_FALSE(fs::exists(flight / "rank1.json"));
  for (int r = 0; r < 3; ++r) CHECK(fs::exists(flight / "earlier" / ("rank" + std::to_string(r) + ".json")));
}

namespace {

namespace ckpt = nnstrain::checkpoint;
using nnstrain::train::FaultTolerance;
using nnstrain::train::Rewind;

// A published-looking step folder (manifest last, as a save leaves it).
void fake_checkpoint(const fs::path& save_dir, int64_t step, int files = 0) {
  const fs::path d = save_dir / ckpt::step_dir_name(step);
  fs::create_directories(d);
  for (int i = 0; i < files; ++i) std::ofstream(d / ("rank-" + std::to_string(i) + ".safetensors")) << "x";
  std::ofstream(d / "manifest.json") << nlohmann::json{{"step", step}, {"state", {{"step", step}}}}.dump();
}

nnstrain::config::TrainerArgs ft_args(const std::string& dir) {
  nnstrain::config::TrainerArgs a;
  a.run_dir = dir;
  a.checkpoint.save_dir = (fs::path(dir) / "ckpt").string();
  a.fault_tolerance.nonfinite_steps = 1;
  a.fault_tolerance.on_spike = "rewind";
  return a;
}

std::optional<Rewind> feed(FaultTolerance& ft, int64_t step, double loss, double grad_norm) {
  return ft.after_step(step, torch::full({}, loss), torch::full({}, grad_norm), {});
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("a loss scaler's overflow steps are not non-finite steps", "[fault_tolerance]") {
  nnstrain::testing::TempDir tmp;
  auto args = ft_args(tmp.path);
  args.precision = "16-mixed";
  args.fault_tolerance.on_spike = "stop";
  FaultTolerance ft(args, nullptr, 0, 1, false, "cpu", "", 0);
  // The first steps of fp16 training: a finite loss, gradients that overflow at
  // the initial scale; the scaler skips the update and backs off.
  for (int64_t s = 1; s <= 3; ++s) CHECK_NOTHROW(feed(ft, s, 4.2, kInf));
  CHECK_NOTHROW(feed(ft, 4, 4.1, 1.5));
  // A non-finite loss is a fault all the same.
  CHECK_THROWS_WITH(feed(ft, 5, kNaN, kNaN), Catch::Matchers::Contains("1 non-finite steps in a row"));
}

TEST_CASE("a non-finite run confirmed by its rerun is skipped whole", "[fault_tolerance]") {
  nnstrain::testing::TempDir tmp;
  auto args = ft_args(tmp.path);
  args.fault_tolerance.nonfinite_steps = 2;
  args.fault_tolerance.rerun_check = true;
  fake_checkpoint(args.checkpoint.save_dir, 4);
  FaultTolerance ft(args, nullptr, 0, 1, false, "cpu", "", 0);
  for (int64_t s = 1; s <= 4; ++s) REQUIRE_FALSE(feed(ft, s, 3.0, 1.0));
  REQUIRE_FALSE(feed(ft, 5, kNaN, kNaN));
  auto r = feed(ft, 6, kNaN, kNaN);  // 2 in a row: rerun from the checkpoint before step 5
  REQUIRE(r);
  CHECK(r->step == 4);
  ft.rewound(*r);
  REQUIRE_FALSE(feed(ft, 5, kNaN, kNaN));
  r = feed(ft, 6, kNaN, kNaN);  // reproduced: rewind and skip
  REQUIRE(r);
  CHECK(r->step == 4);
  ft.rewound(*r);
  // Both data steps of the run (4 and 5, read by steps 5 and 6), not skip_window's 1.
  CHECK(ft.data_step(4) == 6);
  nlohmann::json state;
  ft.annotate(state);
  CHECK(state["data_cursor"]["skipped"] == nlohmann::json::array({{4, 6}}));
  // ... and written into the checkpoint the rewind went back to (a restart before the next save skips them too).
  std::ifstream in(args.checkpoint.save_dir + "/step-00000004/manifest.json");
  CHECK(nlohmann::json::parse(in)["state"]["data_cursor"]["skipped"] == nlohmann::json::array({{4, 6}}));
}

TEST_CASE("a rewind killed while deleting a later checkpoint leaves no step folder to resume from",
          "[fault_tolerance]") {
  nnstrain::testing::TempDir tmp;
  auto args = ft_args(tmp.path);
  const fs::path save_dir = args.checkpoint.save_dir;
  fake_checkpoint(save_dir, 4);
  fake_checkpoint(save_dir, 8, 4);
  FaultTolerance ft(args, nullptr, 0, 1, false, "cpu", "", 0);
  // The deletion stops after one entry, as a kill there would leave it.
  ::setenv("NNSTRAIN_TEST_REMOVE_FAILS_AFTER", "1", 1);
  try {
    ft.rewound({(save_dir / "step-00000004").string(), 4});
  } catch (const std::exception&) {
  }
  ::unsetenv("NNSTRAIN_TEST_REMOVE_FAILS_AFTER");
  CHECK_FALSE(fs::exists(save_dir / "step-00000008"));
  CHECK(ckpt::latest(save_dir.string()) == (save_dir / "step-00000004").string());
}

namespace {

// c10d's store as the saver sees it: set, and a get that waits for the key.
struct FakeStore {
  std::mutex m;
  std::condition_variable cv;
  std::map<std::string, std::string> kv;
  ckpt::SaveStore view() {
    return {[this](const std::string& k, const std::string& v) {
              std::lock_guard<std::mutex> l(m);
              kv[k] = v;
              cv.notify_all();
            },
            [this](const std::string& k) {
              std::unique_lock<std::mutex> l(m);
              if (!cv.wait_for(l, std::chrono::seconds(30), [&] { return kv.count(k) > 0; }))
                throw std::runtime_error("store timeout on " + k);
              return kv.at(k);
            }};
  }
};

std::vector<ckpt::StateTensor> rank_tensors(int rank) {
  auto spec = nnstrain::sharding::ShardSpec::full("w" + std::to_string(rank), "F32", {3});
  spec.replica_ranks = {rank};
  return {{spec, torch::full({3}, static_cast<float>(rank + 1))}};
}

}  // namespace

TEST_CASE("an async save of a step saved before waits for this save's agreement, not the earlier one's",
          "[fault_tolerance][checkpoint]") {
  nnstrain::testing::TempDir tmp;
  const std::string dir = tmp / "ckpt";
  FakeStore store;
  ckpt::Saver s0({dir, "sharded", 0}, {0, 2, {}, {}}, true, store.view());
  ckpt::Saver s1({dir, "sharded", 0}, {1, 2, {}, {}}, true, store.view());
  const auto t0 = rank_tensors(0), t1 = rank_tensors(1);
  s1.save(6, t1, {{"step", 6}}, {{"rank", 1}});
  s0.save(6, t0, {{"step", 6}}, {{"rank", 0}});
  s0.wait();
  s1.wait();
  REQUIRE(fs::exists(dir + "/step-00000006"));
  // A rewind to step 4 removes step 6, which the run then saves again.
  ckpt::discard_step(dir + "/step-00000006");
  s1.save(6, t1, {{"step", 6}, {"again", true}}, {{"rank", 1}});
  std::atomic<bool> rank1_done{false};
  std::string rank1_error;
  std::thread waiter([&] {
    try {
      s1.wait();
    } catch (const std::exception& e) {
      rank1_error = e.what();
    }
    rank1_done = true;
  });
  // Rank 0 has not started this save: rank 1 cannot have finished it.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK_FALSE(rank1_done.load());
  std::string rank0_error;
  try {
    s0.save(6, t0, {{"step", 6}, {"again", true}}, {{"rank", 0}});
    s0.wait();
  } catch (const std::exception& e) {
    rank0_error = e.what();
  }
  waiter.join();
  CHECK(rank0_error.empty());
  CHECK(rank1_error.empty());
  const ckpt::Checkpoint ck(dir + "/step-00000006");
  CHECK(ck.state().value("again", false));
  CHECK(ck.rank_state(1)->at("rank") == 1);
}
