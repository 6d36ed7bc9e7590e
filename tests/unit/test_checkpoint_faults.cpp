// Checkpoint save/load at the library level: atomic publish, `latest`, pruning,
// sharded vs deduped over two simulated ranks (threads), reshard on load, merge,
// and every load fault an error that names the file and the fault.
// The same faults through the nnstrain binary: tests/integration/test_checkpoint.py.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <condition_variable>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <ftw.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/merge.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"

#include "tests/unit/test_support.h"

using namespace nnstrain::checkpoint;

namespace {

using nnstrain::testing::exists;
using nnstrain::testing::TempDir;

std::string read_text(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void write_text(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// The global tensors of a small "run": a replicated parameter, a 0-d scalar and
// an optimizer state partitioned ZeRO-style over two ranks at an odd element.
struct Globals {
  torch::Tensor w = torch::randn({6, 5});
  torch::Tensor b = torch::randn({5});
  torch::Tensor s = torch::randn({});
  torch::Tensor m = torch::randn({6, 5});
};

ShardSpec full(const std::string& name, const torch::Tensor& t, std::vector<int> replicas) {
  auto s = ShardSpec::full(name, "F32", t.sizes().vec());
  s.replica_ranks = std::move(replicas);
  return s;
}

// What rank `rank` of `world` holds (world 1 or 2).
std::vector<StateTensor> rank_tensors(const Globals& g, int rank, int world) {
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  std::vector<StateTensor> out = {{full("model/w", g.w, all), g.w.clone()},
                                  {full("model/b", g.b, all), g.b.clone()},
                                  {full("model/s", g.s, all), g.s.clone()}};
  auto m = full("optim/exp_avg/w", g.m, {rank});
  const int64_t cut = world == 1 ? 30 : 13;  // rank 0: [0, 13), rank 1: [13, 30)
  m.flat_begin = rank == 0 ? 0 : cut;
  m.flat_end = rank == 0 ? cut : 30;
  out.push_back({m, g.m.reshape({-1}).narrow(0, m.flat_begin, m.numel()).clone()});
  return out;
}

// A barrier and an all-reduced AND for ranks simulated by threads.
struct Group {
  explicit Group(int n) : n(n) {}
  int n, waiting = 0, generation = 0;
  bool acc = true, result = true;
  std::mutex mu;
  std::condition_variable cv;
  bool all(bool ok) {
    std::unique_lock<std::mutex> lock(mu);
    acc = acc && ok;
    const int gen = generation;
    if (++waiting == n) {
      result = acc;
      acc = true;
      waiting = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
    return result;
  }
};

// Saves step `step` from `world` ranks (threads); returns the published folder.
std::string save_run(const Globals& g, const std::string& save_dir, const std::string& type, int world, int64_t step,
                     int keep_last = 0, bool rank1_fails = false) {
  Group group(world);
  std::vector<std::string> dirs(world);
  std::vector<std::string> errors(world);
  auto body = [&](int rank) {
    SaveOptions opts{save_dir, type, keep_last};
    SaveContext ctx{rank, world, {}, {}};
    if (world > 1) {
      ctx.barrier = [&] { group.all(true); };
      ctx.all_ok = [&](bool ok) { return group.all(ok && !(rank1_fails && rank == 1)); };
    }
    try {
      dirs[rank] = save(opts, ctx, step, rank_tensors(g, rank, world), {{"step", step}, {"model_type", "toy"}},
                        {{"rank", rank}});
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r)
    if (!errors[r].empty()) throw CheckpointError(errors[r]);
  return dirs[0];
}

torch::Tensor load_full(const Checkpoint& ck, const std::string& name, const torch::Tensor& like) {
  StateTensor st{ShardSpec::full(name, "F32", like.sizes().vec()), torch::empty_like(like)};
  ck.load_into(st);
  return st.tensor;
}

void check_all(const Checkpoint& ck, const Globals& g) {
  CHECK(torch::equal(load_full(ck, "model/w", g.w), g.w));
  CHECK(torch::equal(load_full(ck, "model/b", g.b), g.b));
  CHECK(torch::equal(load_full(ck, "model/s", g.s), g.s));
  CHECK(torch::equal(load_full(ck, "optim/exp_avg/w", g.m), g.m));
}

// Bytes of a tensor's name in a shard file (for counting copies on disk).
size_t count_tensor(const std::string& file, const std::string& name) {
  SafetensorsReader r(file);
  return r.find(name) ? 1 : 0;
}

}  // namespace

TEST_CASE("a shard larger than the writer's writeback window round-trips and leaves the page cache",
          "[checkpoint][safetensors]") {
  // 3 x 72 MiB + odd-sized tensors: writeback starts every 32 MiB and ranges 4 chunks back
  // are waited for and dropped, so this crosses every branch of that path mid-tensor.
  TempDir tmp;
  const auto path = tmp / "big.safetensors";
  torch::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int i = 0; i < 3; ++i) {
    tensors.emplace_back("small." + std::to_string(i), torch::randn({1001 + i}));
    tensors.emplace_back("big." + std::to_string(i), torch::randn({18 * 1024 * 1024 + 7 * i}));
  }
  save_tensors(path, tensors, {{"format", "test"}});

  struct statfs fs {};
  REQUIRE(::statfs(path.c_str(), &fs) == 0);
  if (fs.f_type != TMPFS_MAGIC && fs.f_type != RAMFS_MAGIC) {  // where pages can be dropped at all
    const int fd = ::open(path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    struct stat st {};
    REQUIRE(::fstat(fd, &st) == 0);
    void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    REQUIRE(map != MAP_FAILED);
    const size_t page = ::sysconf(_SC_PAGESIZE), pages = (st.st_size + page - 1) / page;
    std::vector<unsigned char> resident(pages);
    REQUIRE(::mincore(map, st.st_size, resident.data()) == 0);
    size_t cached = 0;
    for (unsigned char r : resident) cached += r & 1;
    ::munmap(map, st.st_size);
    ::close(fd);
    CHECK(cached < pages / 10);  // durable, then dropped: not kept at the training's expense
  }

  const auto back = load_tensors(path);
  REQUIRE(back.size() == tensors.size());
  for (const auto& [name, t] : tensors) CHECK(torch::equal(back.at(name), t));
}

TEST_CASE("save publishes step folders, `latest` and prunes", "[checkpoint]") {
  TempDir tmp;
  Globals g;
  const auto save_dir = tmp / "ckpt";
  CHECK(latest(save_dir).empty());
  for (int64_t step : {10, 20, 30}) save_run(g, save_dir, "sharded", 1, step, /*keep_last=*/2);
  CHECK(latest(save_dir) == save_dir + "/step-00000030");
  CHECK_FALSE(exists(save_dir + "/step-00000010"));  // pruned
  CHECK(exists(save_dir + "/step-00000020/manifest.json"));
  CHECK_FALSE(exists(save_dir + "/.tmp-step-00000030"));
  const Checkpoint ck(latest(save_dir));
  CHECK(ck.state().at("step") == 30);
  CHECK(ck.rank_state(0)->at("rank") == 0);
  check_all(ck, g);
}

TEST_CASE("a failed rank publishes nothing and `latest` stays", "[checkpoint]") {
  TempDir tmp;
  Globals g;
  const auto save_dir = tmp / "ckpt";
  save_run(g, save_dir, "sharded", 2, 5);
  Globals other;
  CHECK_THROWS_WITH(save_run(other, save_dir, "sharded", 2, 6, 0, /*rank1_fails=*/true),
                    Catch::Contains("not published") || Catch::Contains("could not write"));
  CHECK_FALSE(exists(save_dir + "/step-00000006"));
  CHECK(latest(save_dir) == save_dir + "/step-00000005");
  check_all(Checkpoint(latest(save_dir)), g);
  CHECK_FALSE(exists(save_dir + "/.tmp-step-00000006"));
  // A crashed save's leftover is not a checkpoint, and the next publish removes it.
  REQUIRE(::mkdir((save_dir + "/.tmp-step-00000006").c_str(), 0755) == 0);
  write_text(save_dir + "/.tmp-step-00000006/rank-00000.safetensors", "partial");
  CHECK(latest(save_dir) == save_dir + "/step-00000005");
  save_run(other, save_dir, "sharded", 2, 7);
  CHECK_FALSE(exists(save_dir + "/.tmp-step-00000006"));
  check_all(Checkpoint(latest(save_dir)), other);
}

TEST_CASE("deduped stores each replicated tensor once and both types load under another world size", "[checkpoint]") {
  TempDir tmp;
  Globals g;
  const auto sharded = save_run(g, tmp / "sharded", "sharded", 2, 3);
  const auto deduped = save_run(g, tmp / "deduped", "deduped", 2, 3);
  for (const char* name : {"model/w", "model/b", "model/s"}) {
    CHECK(count_tensor(sharded + "/rank-00000.safetensors", name) + count_tensor(sharded + "/rank-00001.safetensors", name) == 2);
    CHECK(count_tensor(deduped + "/rank-00000.safetensors", name) + count_tensor(deduped + "/rank-00001.safetensors", name) == 1);
  }
  // The ZeRO partitions are each held by one rank: both save types keep both.
  CHECK(count_tensor(deduped + "/rank-00001.safetensors", "optim/exp_avg/w") == 1);
  for (const auto& dir : {sharded, deduped}) {
    const Checkpoint ck(dir);
    check_all(ck, g);
    // Resharding: rank 1 of a 3-way flat partition of exp_avg, cutting across both stored pieces.
    auto want = ShardSpec::full("optim/exp_avg/w", "F32", {6, 5});
    want.flat_begin = 10;
    want.flat_end = 20;
    StateTensor st{want, torch::empty({10})};
    ck.load_into(st);
    CHECK(torch::equal(st.tensor, g.m.reshape({-1}).narrow(0, 10, 10)));
  }
}

TEST_CASE("merge writes one whole-tensor checkpoint that loads like the original", "[checkpoint][merge]") {
  TempDir tmp;
  Globals g;
  const auto src = save_run(g, tmp / "ckpt", "deduped", 2, 4);
  const auto out = tmp / "merged";
  const auto report = merge(src, out);
  CHECK(report.tensors == 4);  // w, b, s, exp_avg/w
  CHECK(report.largest_bytes == 30 * 4);
  CHECK_FALSE(exists(out + ".tmp"));
  const Checkpoint ck(out);
  CHECK(ck.manifest().at("world_size") == 1);
  CHECK(ck.manifest().at("save_type") == "merged");
  for (const auto& name : ck.names()) {
    REQUIRE(ck.pieces(name).size() == 1);
    CHECK(ck.pieces(name).front().first.is_full());
  }
  check_all(ck, g);
  SafetensorsReader model(out + "/model.safetensors");
  CHECK(model.find("w") != nullptr);
  CHECK(model.find("model/w") == nullptr);
  CHECK(model.metadata().at("format") == "pt");
  SafetensorsReader optim(out + "/optimizer.safetensors");
  CHECK(optim.find("exp_avg/w") != nullptr);
  CHECK(exists(out + "/trainer_state.json"));
  // Merging again into the same folder is refused; a merged checkpoint merges again.
  CHECK_THROWS_WITH(merge(src, out), Catch::Contains("already exists"));
  merge(out, tmp / "merged2");
  check_all(Checkpoint(tmp / "merged2"), g);
  CHECK(read_text(out + "/model.safetensors") == read_text(tmp / "merged2/model.safetensors"));
}

TEST_CASE("load faults are errors naming the file and the fault", "[checkpoint][faults]") {
  TempDir tmp;
  Globals g;
  const auto dir = save_run(g, tmp / "ckpt", "sharded", 2, 8);
  const auto manifest = read_text(dir + "/manifest.json");
  const auto shard1 = read_text(dir + "/rank-00001.safetensors");
  auto restore = [&] {
    write_text(dir + "/manifest.json", manifest);
    write_text(dir + "/rank-00001.safetensors", shard1);
  };
  auto edit_manifest = [&](const std::function<void(nlohmann::json&)>& f) {
    auto j = nlohmann::json::parse(manifest);
    f(j);
    write_text(dir + "/manifest.json", j.dump());
  };
  auto load_all = [&] {  // throws on the first fault
    const Checkpoint ck(dir);
    for (const auto& [name, like] : {std::pair<const char*, torch::Tensor>{"model/w", g.w}, {"model/b", g.b},
                                     {"model/s", g.s}, {"optim/exp_avg/w", g.m}})
      load_full(ck, name, like);
  };

  SECTION("no manifest: an incomplete folder") {
    ::unlink((dir + "/manifest.json").c_str());
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("manifest.json missing"));
  }
  SECTION("missing shard file") {
    ::unlink((dir + "/rank-00001.safetensors").c_str());
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("rank-00001.safetensors") && Catch::Contains("missing"));
  }
  SECTION("manifest not JSON") {
    write_text(dir + "/manifest.json", manifest.substr(0, manifest.size() / 2));
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("manifest.json") && Catch::Contains("not valid JSON"));
  }
  SECTION("not an nnstrain manifest") {
    edit_manifest([](nlohmann::json& j) { j["format"] = "something-else"; });
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("not an nnstrain checkpoint manifest"));
  }
  SECTION("a piece out of bounds") {
    edit_manifest([](nlohmann::json& j) { j["files"]["rank-00001.safetensors"][0]["offsets"] = {1, 0}; });
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("manifest.json") && Catch::Contains("out of bounds"));
  }
  SECTION("pieces disagree on the global shape") {
    edit_manifest([](nlohmann::json& j) {
      for (auto& e : j["files"]["rank-00001.safetensors"])
        if (e["name"] == "model/b") e["global_shape"] = {6}, e["shape"] = {6};
    });
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("model/b") && Catch::Contains("disagree"));
  }
  SECTION("a shape that disagrees with the model") {
    const Checkpoint ck(dir);
    StateTensor st{ShardSpec::full("model/w", "F32", {6, 4}), torch::empty({6, 4})};
    CHECK_THROWS_WITH(ck.load_into(st), Catch::Contains("rank-0000") && Catch::Contains("model/w") &&
                                            Catch::Contains("[6,5] in the checkpoint but [6,4] in the model"));
  }
  SECTION("a dtype that disagrees with the model") {
    edit_manifest([](nlohmann::json& j) {
      for (auto& [f, entries] : j["files"].items())
        for (auto& e : entries)
          if (e["name"] == "model/b") e["dtype"] = "I32";  // floats convert (bf16 <-> fp32); ints never
    });
    const Checkpoint ck(dir);
    StateTensor st{ShardSpec::full("model/b", "F32", {5}), torch::empty({5})};
    CHECK_THROWS_WITH(ck.load_into(st), Catch::Contains("model/b") && Catch::Contains("dtype I32 in the checkpoint"));
  }
  SECTION("the manifest's dtype is not the file's") {
    edit_manifest([](nlohmann::json& j) {
      for (auto& [f, entries] : j["files"].items())
        for (auto& e : entries)
          if (e["name"] == "model/b") e["dtype"] = "I32";
    });
    const Checkpoint ck(dir);
    StateTensor st{ShardSpec::full("model/b", "I32", {5}), torch::empty({5}, torch::kInt32)};
    CHECK_THROWS_WITH(ck.load_into(st), Catch::Contains(".safetensors") && Catch::Contains("disagrees with its manifest"));
  }
  SECTION("an optimizer partition missing from the manifest") {
    edit_manifest([](nlohmann::json& j) {
      auto& e = j["files"]["rank-00001.safetensors"];
      for (size_t i = 0; i < e.size(); ++i)
        if (e[i]["name"] == "optim/exp_avg/w") e.erase(i);
    });
    const Checkpoint ck(dir);
    CHECK_THROWS_WITH(load_full(ck, "optim/exp_avg/w", g.m), Catch::Contains("do not cover"));
    CHECK_THROWS_WITH(merge(dir, tmp / "m"), Catch::Contains("optim/exp_avg/w") && Catch::Contains("do not cover"));
    CHECK_FALSE(exists(tmp / "m"));
    CHECK_FALSE(exists(tmp / "m.tmp"));
  }
  SECTION("a tensor listed in the manifest but absent from the file") {
    // model/w only in rank 0's entry, under a name the file does not have.
    edit_manifest([](nlohmann::json& j) {
      for (auto& e : j["files"]["rank-00000.safetensors"])
        if (e["name"] == "model/w") e["key"] = "renamed";
      auto& e1 = j["files"]["rank-00001.safetensors"];
      for (size_t i = 0; i < e1.size(); ++i)
        if (e1[i]["name"] == "model/w") e1.erase(i);
    });
    CHECK_THROWS_WITH(load_all(), Catch::Contains("rank-00000.safetensors") &&
                                      Catch::Contains("'renamed' listed in manifest.json is not in the file"));
  }
  SECTION("a truncated shard file") {
    write_text(dir + "/rank-00001.safetensors", shard1.substr(0, shard1.size() - 7));
    CHECK_THROWS_WITH(load_all(), Catch::Contains("rank-00001.safetensors") && Catch::Contains("truncated"));
  }
  SECTION("trailing bytes after a shard's data") {
    write_text(dir + "/rank-00001.safetensors", shard1 + "junk");
    CHECK_THROWS_WITH(load_all(), Catch::Contains("rank-00001.safetensors") && Catch::Contains("trailing bytes"));
  }
  SECTION("transposed on something that is not a whole 2-d tensor") {
    edit_manifest([](nlohmann::json& j) {
      for (auto& e : j["files"]["rank-00001.safetensors"])
        if (e["name"] == "model/b") e["transposed"] = true;
    });
    CHECK_THROWS_WITH(Checkpoint(dir), Catch::Contains("model/b") && Catch::Contains("not a whole 2-d tensor"));
  }
  restore();
  check_all(Checkpoint(dir), g);  // the untouched checkpoint still loads
}
