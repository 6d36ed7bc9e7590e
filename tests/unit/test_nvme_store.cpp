// The NVMe tier's store (trainer/offload/nvme_store.h): what it trusts under
// offload.nvme_path (nothing: a private per-run folder, no link followed, a
// foreign folder refused), how it picks its engine (io_uring only where the
// kernel has its read and write opcodes) and how many pieces it keeps in flight.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/test_support.h"
#include "trainer/offload/nvme_store.h"

using nnstrain::parallel::NvmeError;
using nnstrain::parallel::NvmeQueueShape;
using nnstrain::parallel::NvmeSetupError;
using nnstrain::parallel::NvmeStore;
using nnstrain::parallel::nvme_buffer;
using nnstrain::testing::TempDir;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

struct stat lstat_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return st;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// NNSTRAIN_TEST_NVME_URING_PROBE set for one scope.
struct ProbeSays {
  explicit ProbeSays(const char* v) { ::setenv("NNSTRAIN_TEST_NVME_URING_PROBE", v, 1); }
  ~ProbeSays() { ::unsetenv("NNSTRAIN_TEST_NVME_URING_PROBE"); }
};

}  // namespace

TEST_CASE("nvme store: io_uring keeps no more pieces in flight than its completion queue holds", "[nvme]") {
  TempDir dir("nvme_queue");
  // 4 submission entries (8 completions), 4 KiB pieces: 8 chunks of 16 pieces each submitted before any wait.
  NvmeStore store(dir.path, 0, "auto", NvmeQueueShape{4, 4096});
  if (store.engine() != "io_uring") {
    WARN("io_uring unavailable here: " + store.engine_why());
    return;
  }
  REQUIRE(store.queue_entries() == 8);
  constexpr size_t kChunks = 8;
  constexpr int64_t kBytes = 16 * 4096;
  const int f = store.add_file("data.bin", std::vector<int64_t>(kChunks, kBytes));
  store.allocate();
  std::vector<std::shared_ptr<void>> out, in;
  for (size_t c = 0; c < kChunks; ++c) {
    out.push_back(nvme_buffer(kBytes));
    in.push_back(nvme_buffer(kBytes));
    auto* p = static_cast<unsigned char*>(out.back().get());
    for (int64_t i = 0; i < kBytes; ++i) p[i] = static_cast<unsigned char>((i * 7 + c * 31) & 0xff);
  }
  for (size_t c = 0; c < kChunks; ++c) store.submit_write(f, c, out[c].get());
  store.drain();
  for (size_t c = 0; c < kChunks; ++c) store.submit_read(f, c, in[c].get());
  for (size_t c = kChunks; c-- > 0;) store.wait(f, c);  // checksums checked on each
  for (size_t c = 0; c < kChunks; ++c) CHECK(std::memcmp(out[c].get(), in[c].get(), kBytes) == 0);
  const auto n = store.counters();
  CHECK(n.writes == int64_t(kChunks));
  CHECK(n.reads == int64_t(kChunks));
  // 128 pieces asked for at once: the ring was filled to its completion queue, never past it.
  CHECK(n.max_in_flight == int64_t(store.queue_entries()));
  store.close();
  CHECK(!exists(dir / "rank0"));
}

TEST_CASE("nvme store: a kernel whose io_uring lacks read and write gets the thread pool", "[nvme]") {
  TempDir dir("nvme_probe");
  ProbeSays unsupported("unsupported");
  {
    NvmeStore store(dir.path, 0, "auto");
    CHECK(store.engine() == "threads");
    CHECK(store.queue_entries() == 0u);
    CHECK_THAT(store.engine_why(), Catch::Contains("IORING_OP_READ"));
    // and the pool does the I/O
    const int f = store.add_file("x.bin", {4096 * 3});
    store.allocate();
    auto a = nvme_buffer(4096 * 3), b = nvme_buffer(4096 * 3);
    std::memset(a.get(), 0x3c, 4096 * 3);
    store.submit_write(f, 0, a.get());
    store.wait(f, 0);
    store.submit_read(f, 0, b.get());
    store.wait(f, 0);
    CHECK(std::memcmp(a.get(), b.get(), 4096 * 3) == 0);
    store.close();
  }
  try {
    NvmeStore store(dir.path, 0, "io_uring");
    FAIL("io_uring asked for on a kernel without its read and write opcodes was accepted");
  } catch (const NvmeSetupError& e) {
    CHECK(e.key == "nvme_io");
    CHECK_THAT(std::string(e.what()), Catch::Contains("io_uring asked for") && Catch::Contains("IORING_OP_WRITE"));
  }
  CHECK(!exists(dir / "rank0"));  // refused before anything was created
}

TEST_CASE("nvme store: each run works in a private folder of its own, removed at the end", "[nvme]") {
  TempDir dir("nvme_private");
  REQUIRE(::mkdir((dir / "rank0").c_str(), 0755) == 0);
  REQUIRE(::chmod((dir / "rank0").c_str(), 0755) == 0);
  NvmeStore a(dir.path, 0, "threads"), b(dir.path, 0, "threads");  // two runs may share nvme_path
  REQUIRE(a.folder() != b.folder());
  for (const auto* s : {&a, &b}) {
    const std::string name = s->folder().substr((dir / "rank0/").size());
    CHECK(s->folder() == dir / "rank0/" + name);
    CHECK((name.size() == 10 && name.rfind("run-", 0) == 0));
    const auto st = lstat_of(s->folder());
    CHECK(S_ISDIR(st.st_mode));
    CHECK((st.st_mode & 07777) == 0700);
    CHECK(st.st_uid == ::geteuid());
  }
  CHECK((lstat_of(dir / "rank0").st_mode & 07777) == 0700);  // made private
  a.add_file("o.bin", {4096});
  a.allocate();
  CHECK((lstat_of(a.path(0)).st_mode & 0777) == 0600);
  try {  // a name added twice is never opened again
    a.add_file("o.bin", {4096});
    FAIL("an existing file was opened");
  } catch (const NvmeError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("File exists"));
  }
  a.close();
  CHECK(!exists(a.folder()));
  CHECK(exists(dir / "rank0"));  // b still in it
  b.close();
  CHECK(!exists(dir / "rank0"));
}

TEST_CASE("nvme store: what a dead run left is removed, a live run's folder kept", "[nvme]") {
  TempDir dir("nvme_stale");
  std::string dead_folder;
  {
    NvmeStore dead(dir.path, 0, "threads");
    dead.add_file("optimizer.bin", {4096});
    dead.allocate();
    dead_folder = dead.folder();
  }  // no close(): what a crash leaves, its note unlocked
  REQUIRE(exists(dead_folder + "/optimizer.bin"));
  REQUIRE(exists(dead_folder + "/NOTE.txt"));
  NvmeStore live(dir.path, 0, "threads");
  CHECK(!exists(dead_folder));
  NvmeStore next(dir.path, 0, "threads");
  CHECK(exists(live.folder() + "/NOTE.txt"));  // locked by a live store: left alone
  next.close();
  live.close();
  CHECK(!exists(dir / "rank0"));
}

TEST_CASE("nvme store: a symlinked or foreign rank folder is refused, naming it", "[nvme]") {
  TempDir dir("nvme_refuse"), victim("nvme_victim");
  spit(victim / "NOTE.txt", "their note");
  REQUIRE(::symlink(victim.path.c_str(), (dir / "rank0").c_str()) == 0);
  try {
    NvmeStore store(dir.path, 0, "threads");
    FAIL("a symlinked rank folder was used");
  } catch (const NvmeSetupError& e) {
    CHECK(e.key == "nvme_path");
    CHECK_THAT(std::string(e.what()), Catch::Contains(dir / "rank0") && Catch::Contains("symbolic link"));
  }
  CHECK(slurp(victim / "NOTE.txt") == "their note");
  CHECK(!exists(victim / "rank0"));
  if (::geteuid() != 0) {
    WARN("chown to another user needs root");
    return;
  }
  REQUIRE(::unlink((dir / "rank0").c_str()) == 0);
  REQUIRE(::mkdir((dir / "rank0").c_str(), 0700) == 0);
  REQUIRE(::chown((dir / "rank0").c_str(), 65534, 65534) == 0);
  try {
    NvmeStore store(dir.path, 0, "threads");
    FAIL("a rank folder of another user was used");
  } catch (const NvmeSetupError& e) {
    CHECK(e.key == "nvme_path");
    CHECK_THAT(std::string(e.what()), Catch::Contains(dir / "rank0") && Catch::Contains("owned by uid 65534"));
  }
}

TEST_CASE("nvme disk probe: a symlink planted at a predictable name is never followed", "[nvme]") {
  TempDir dir("nvme_probe_disk"), victim("nvme_probe_victim");
  // The names a probe of this process could take before it drew a random one, pointing at someone's files.
  REQUIRE(::mkdir((victim / "rank0").c_str(), 0700) == 0);
  spit(victim / "rank0/probe.bin", "their file");
  spit(victim / "rank0/NOTE.txt", "their note");
  const std::string planted = dir / ("nnstrain-probe-" + std::to_string(::getpid()));
  REQUIRE(::symlink(victim.path.c_str(), planted.c_str()) == 0);
  const auto r = nnstrain::parallel::probe_disk(dir.path, 8 << 20, "auto");
  CHECK(r.bytes == (8 << 20));
  CHECK(r.write_bytes_per_s > 0);
  CHECK(slurp(victim / "rank0/probe.bin") == "their file");
  CHECK(slurp(victim / "rank0/NOTE.txt") == "their note");
  CHECK(S_ISLNK(lstat_of(planted).st_mode));
  // Nothing else left in the folder: the probe's own is gone.
  REQUIRE(::unlink(planted.c_str()) == 0);
  CHECK(::rmdir(dir.path.c_str()) == 0);
  REQUIRE(::mkdir(dir.path.c_str(), 0700) == 0);  // for TempDir's removal
}
