// Asynchronous checkpoints (checkpoint::Saver) at the library level: the snapshot
// is the state at save() whatever training does next, any dtype and layout; two
// simulated ranks (threads) agree through a store; a failing rank publishes
// nothing and the failure surfaces at wait(). Also `latest()` (what --resume
// takes) and the one-line form of a LibTorch error.
// Kills at random moments through the binary: tests/integration/test_checkpoint.py.
#include <catch2/catch.hpp>

#include <torch/torch.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <sys/stat.h>

#include "trainer/checkpoint/async_save.h"
#include "trainer/train/trainer.h"

#include "tests/unit/test_support.h"

using namespace nnstrain;
using namespace nnstrain::checkpoint;
using Catch::Matchers::Contains;
using nnstrain::testing::exists;
using nnstrain::testing::TempDir;

namespace {

// c10d's store as the saver sees it: set, and a get that waits for the key.
struct FakeStore {
  std::mutex m;
  std::condition_variable cv;
  std::map<std::string, std::string> kv;
  SaveStore view() {
    return {[this](const std::string& k, const std::string& v) {
              std::lock_guard<std::mutex> l(m);
              kv[k] = v;
              cv.notify_all();
            },
            [this](const std::string& k) {
              std::unique_lock<std::mutex> l(m);
              if (!cv.wait_for(l, std::chrono::seconds(60), [&] { return kv.count(k) > 0; }))
                throw std::runtime_error("store timeout on " + k);
              return kv.at(k);
            }};
  }
};

StateTensor piece(const std::string& name, const torch::Tensor& t, const std::string& dtype, std::vector<int> ranks) {
  auto s = ShardSpec::full(name, dtype, t.sizes().vec());
  s.replica_ranks = std::move(ranks);
  return {s, t};
}

// Tensors of several dtypes, one of them a non-contiguous view. A generator of
// its own per call: the two-rank test calls this from two threads at once, and
// LibTorch's one default generator would interleave their draws.
std::vector<StateTensor> state(int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(rank + 1));
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto base = torch::randn({8, 6}, gen, f32);
  return {piece("w" + std::to_string(rank), torch::randn({5, 7}, gen, f32), "F32", {rank}),
          piece("h" + std::to_string(rank), torch::randn({9}, gen, f32).to(torch::kBFloat16), "BF16", {rank}),
          piece("t" + std::to_string(rank), base.t(), "F32", {rank}),
          piece("rng" + std::to_string(rank), torch::randint(0, 255, {33}, gen, torch::kUInt8), "U8", {rank}),
          piece("n" + std::to_string(rank), torch::randint(0, 1000, {4}, gen, torch::kInt64), "I64", {rank})};
}

void check_loads(const Checkpoint& ck, const std::vector<StateTensor>& want) {
  for (const auto& w : want) {
    StateTensor got{w.spec, torch::empty(w.tensor.sizes(), w.tensor.options())};
    ck.load_into(got);
    INFO(w.spec.name);
    CHECK(torch::equal(got.tensor, w.tensor));
  }
}

}  // namespace

TEST_CASE("async save: the checkpoint holds the state at save(), whatever happens after", "[checkpoint][async]") {
  TempDir tmp;
  const auto dir = tmp / "ckpt";
  std::vector<SaveReport> reports;
  Saver saver({dir, "sharded", 0}, {0, 1, {}, {}}, /*async=*/true, {},
              [&](const SaveReport& r) { reports.push_back(r); });
  auto live = state(0);
  std::vector<StateTensor> expected;
  for (const auto& t : live) expected.push_back({t.spec, t.tensor.clone()});
  {
    torch::NoGradGuard no_grad;
    saver.save(3, live, {{"step", 3}}, nlohmann::json::object());
    saver.state_may_change();               // what the trainer calls before its optimizer step
    for (auto& t : live) t.tensor.zero_();  // training goes on and changes the state in place
    saver.save(4, live, {{"step", 4}}, nlohmann::json::object());  // waits for step 3, then snapshots zeros
  }
  saver.wait();
  REQUIRE(reports.size() == 2);
  CHECK(reports[0].dir == dir + "/step-00000003");
  CHECK(reports[0].bytes == 5 * 7 * 4 + 9 * 2 + 8 * 6 * 4 + 33 + 4 * 8);
  check_loads(Checkpoint(dir + "/step-00000003"), expected);
  check_loads(Checkpoint(dir + "/step-00000004"), live);
  CHECK(latest(dir) == dir + "/step-00000004");
}

TEST_CASE("async save over two ranks agrees through the store and a failed rank publishes nothing",
          "[checkpoint][async]") {
  TempDir tmp;
  const auto dir = tmp / "ckpt";
  FakeStore store;
  auto run_rank = [&](int rank, int64_t step, bool fail, std::string& error) {
    Saver saver({dir, "sharded", 0}, {rank, 2, {}, {}}, true, store.view());
    auto tensors = state(rank);
    // A dtype safetensors cannot hold makes this rank's write fail.
    if (fail) tensors.push_back(piece("bad", torch::zeros({2}, torch::kComplexFloat), "F32", {rank}));
    try {
      saver.save(step, tensors, {{"step", step}}, {{"rank", rank}});
      saver.wait();
    } catch (const CheckpointError& e) {
      error = e.what();
    }
  };
  std::string e0, e1;
  {
    std::thread r1([&] { run_rank(1, 7, false, e1); });
    run_rank(0, 7, false, e0);
    r1.join();
  }
  CHECK(e0.empty());
  CHECK(e1.empty());
  const Checkpoint ck(dir + "/step-00000007");
  CHECK(ck.manifest()["world_size"] == 2);
  CHECK(ck.rank_state(1)->at("rank") == 1);
  check_loads(ck, state(0));
  check_loads(ck, state(1));

  {
    std::thread r1([&] { run_rank(1, 8, true, e1); });
    run_rank(0, 8, false, e0);
    r1.join();
  }
  CHECK_THAT(e0, Contains("not published") && Contains("rank 1 could not write its shard"));
  CHECK_THAT(e1, Contains("not published"));
  CHECK_FALSE(exists(dir + "/step-00000008"));
  CHECK_FALSE(exists(dir + "/.tmp-step-00000008"));
  CHECK(latest(dir) == dir + "/step-00000007");
}

TEST_CASE("async save: a failure surfaces at the next save or wait()", "[checkpoint][async]") {
  TempDir tmp;
  { std::ofstream(tmp / "file") << "x"; }  // save_dir under a regular file cannot be created
  Saver saver({tmp / "file/ckpt", "sharded", 0}, {0, 1, {}, {}}, true);
  saver.save(1, state(0), {{"step", 1}}, nlohmann::json::object());
  CHECK_THROWS_AS(saver.wait(), CheckpointError);
  CHECK_NOTHROW(saver.wait());  // reported once
}

TEST_CASE("latest(): the newest complete checkpoint, whatever the pointer says", "[checkpoint]") {
  TempDir tmp;
  const auto dir = tmp.path;
  auto folder = [&](const std::string& name, bool complete) {
    REQUIRE(::mkdir((dir + "/" + name).c_str(), 0755) == 0);
    if (complete) std::ofstream(dir + "/" + name + "/manifest.json") << "{}";
  };
  CHECK(latest(dir).empty());
  folder("step-00000002", true);
  folder("step-00000005", true);
  folder("step-00000009", false);       // a folder without its manifest is not a checkpoint
  folder(".tmp-step-00000010", true);   // nor is a save in progress
  folder("step-extra", true);           // nor a name that is not step-NNNNNNNN
  std::ofstream(dir + "/latest") << "step-00000002\n";  // lagging: a kill between publish and pointer
  CHECK(latest(dir) == dir + "/step-00000005");

  TempDir other;  // no complete folder: the pointer, which must be a plain name
  std::ofstream(other / "latest") << "../../etc\n";
  CHECK_THROWS_WITH(latest(other.path), Contains("only plain file names"));
}

TEST_CASE("a LibTorch error in training is one line naming rank and step", "[checkpoint][errors]") {
  try {
    torch::zeros({4}).index_select(0, torch::tensor({7}));
    FAIL("index_select did not throw");
  } catch (const c10::Error& e) {
    const auto s = train::step_error(e, 3, 12);
    const std::string line = s.what();
    CHECK_THAT(line, Contains("rank 3: step 12: ") && Contains("out of range"));
    CHECK(line.find('\n') == std::string::npos);
    CHECK(s.detail.size() > line.size());  // --debug keeps LibTorch's full message
    CHECK_THAT(train::step_error(e, 0, 0).what(), Contains("rank 0: before training: "));
  }
}
