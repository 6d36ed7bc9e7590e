// token_bin dataset (the data-stream contract) and the prefetching loader.
#include <ftw.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

// torch first: c10's logging header defines its own CHECK, which Catch's must replace.
#include <torch/torch.h>
#include <catch2/catch.hpp>

#include "data/loader.h"
#include "data/token_bin.h"

namespace fs = std::filesystem;
using nnstrain::config::TokenBinArgs;
using nnstrain::data::Batch;
using nnstrain::data::PrefetchLoader;
using nnstrain::data::TokenBinDataset;
using nnstrain::data::TokenFile;

namespace {

// libtorch.so exports its own copies of some std::filesystem functions (pytorch#133437)
// and its remove_all crashes when it wins symbol resolution: clean up with POSIX calls.
int remove_entry(const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nnstrain_tokbin_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() { ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); }
};

// Writes tokens little endian with `bytes` (2 or 4) bytes each.
std::string write_tokens(const fs::path& p, const std::vector<uint32_t>& tokens, int bytes) {
  std::string out;
  for (uint32_t t : tokens)
    for (int i = 0; i < bytes; ++i) out += char((t >> (8 * i)) & 0xFF);
  std::ofstream(p, std::ios::binary) << out;
  return p.string();
}

// Token i = f(i) with distinct neighbours, so a misplaced window shows.
std::vector<uint32_t> ramp(size_t n, uint32_t mod) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint32_t((i * 7 + 3) % mod);
  return v;
}

TokenBinArgs args_for(const std::string& path, int64_t seq_len, const std::string& dtype = "uint16") {
  TokenBinArgs a;
  a.path = path;
  a.seq_len = seq_len;
  a.dtype = dtype;
  return a;
}

torch::Tensor tokens_at(const std::vector<uint32_t>& toks, int64_t start, int64_t n) {
  auto t = torch::empty({n}, torch::kInt64);
  for (int64_t i = 0; i < n; ++i) t[i] = int64_t(toks[size_t(start + i)]);
  return t;
}

}  // namespace

TEST_CASE("token_bin window_start is a pure function of (seed, step, pos)", "[data]") {
  TempDir tmp;
  const auto toks = ramp(5000, 1000);
  const std::string path = write_tokens(tmp.path / "t.bin", toks, 2);
  TokenBinDataset a(args_for(path, 16), 1234), b(args_for(path, 16), 1234), c(args_for(path, 16), 1235);
  CHECK(a.num_tokens() == 5000);
  CHECK(a.samples_per_epoch() == (5000 - 1) / 16);

  int differ = 0;
  std::set<int64_t> distinct;
  // b is queried in the reverse order: no hidden state may leak between calls.
  for (int64_t step = 9; step >= 0; --step)
    for (int64_t pos = 7; pos >= 0; --pos) {
      const int64_t s = a.window_start(step, pos);
      CHECK(s == b.window_start(step, pos));
      CHECK(s >= 0);
      CHECK(s < 5000 - 16);
      differ += s != c.window_start(step, pos);
      distinct.insert(s);
    }
  // The formula docs/data.md gives, evaluated in Python (so a reference script can rebuild the stream).
  CHECK(a.window_start(0, 0) == 1746);
  CHECK(a.window_start(3, 5) == 3131);
  CHECK(a.window_start(9, 7) == 4685);
  CHECK(differ > 70);           // a different seed is a different stream
  CHECK(distinct.size() > 70);  // (step, pos) pairs do not collapse onto few windows
  CHECK_THROWS(a.window_start(-1, 0));
}

TEST_CASE("token_bin batches: rank split, shift, content", "[data]") {
  TempDir tmp;
  const auto toks = ramp(4096, 50000);
  const std::string path = write_tokens(tmp.path / "t.bin", toks, 2);
  TokenBinDataset ds(args_for(path, 32), 7);
  const int64_t b = 3;

  for (int64_t step : {0, 1, 17}) {
    const Batch full = ds.train_batch(step, 0, 2 * b);
    const Batch r0 = ds.train_batch(step, 0, b);
    const Batch r1 = ds.train_batch(step, b, b);
    REQUIRE(full.x.sizes() == torch::IntArrayRef({2 * b, 32}));
    CHECK(full.x.dtype() == torch::kInt64);
    CHECK(torch::equal(torch::cat({r0.x, r1.x}), full.x));
    CHECK(torch::equal(torch::cat({r0.y, r1.y}), full.y));
    // y is x shifted by one token, and both are the file's tokens at window_start.
    CHECK(torch::equal(full.y.slice(1, 0, 31), full.x.slice(1, 1, 32)));
    for (int64_t p = 0; p < 2 * b; ++p) {
      const int64_t s = ds.window_start(step, p);
      CHECK(torch::equal(full.x[p], tokens_at(toks, s, 32)));
      CHECK(torch::equal(full.y[p], tokens_at(toks, s + 1, 32)));
    }
  }
  CHECK_FALSE(torch::equal(ds.train_batch(0, 0, b).x, ds.train_batch(1, 0, b).x));
  CHECK(ds.train_batch(0, 0, 0).x.size(0) == 0);
  CHECK(ds.file().max_token() == *std::max_element(toks.begin(), toks.end()));
}

TEST_CASE("token_bin reads uint32 files", "[data]") {
  TempDir tmp;
  std::vector<uint32_t> toks(300);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint32_t(70000 + i * 1000003 % 100000);  // > uint16
  const std::string path = write_tokens(tmp.path / "t32.bin", toks, 4);
  TokenBinDataset ds(args_for(path, 10, "uint32"), 0);
  CHECK(ds.num_tokens() == 300);
  const Batch bt = ds.train_batch(5, 0, 4);
  for (int64_t p = 0; p < 4; ++p)
    CHECK(torch::equal(bt.x[p], tokens_at(toks, ds.window_start(5, p), 10)));
  CHECK(ds.file().max_token() == *std::max_element(toks.begin(), toks.end()));

  // The same bytes read as uint16 are twice as many, different tokens.
  TokenFile as16(path, "uint16");
  CHECK(as16.size() == 600);
  std::vector<int64_t> two(2);
  as16.read(0, 2, two.data());
  CHECK(two[0] == int64_t(toks[0] & 0xFFFF));
  CHECK(two[1] == int64_t(toks[0] >> 16));
}

TEST_CASE("token_bin validation batches are fixed windows", "[data]") {
  TempDir tmp;
  const auto toks = ramp(2000, 30000);
  const std::string path = write_tokens(tmp.path / "val.bin", toks, 2);
  TokenBinDataset a(args_for(path, 20), 1), b(args_for(path, 20), 99);
  const int64_t windows = a.samples_per_epoch();
  REQUIRE(windows == (2000 - 1) / 20);

  std::set<int64_t> seen;
  const int64_t B = 4, K = 8;  // K * B well under windows / 2: no window twice
  for (int64_t k = 0; k < K; ++k) {
    const Batch v1 = a.val_batch(k, 0, B);
    CHECK(torch::equal(v1.x, a.val_batch(k, 0, B).x));  // the same every evaluation
    CHECK(torch::equal(v1.x, b.val_batch(k, 0, B).x));  // whatever the seed
    CHECK(torch::equal(v1.y, b.val_batch(k, 0, B).y));
    const Batch r0 = a.val_batch(k, 0, 1), r1 = a.val_batch(k, 1, B - 1);
    CHECK(torch::equal(torch::cat({r0.x, r1.x}), v1.x));
    for (int64_t p = 0; p < B; ++p) {
      const int64_t w = a.val_window(k, p);
      CHECK(w >= 0);
      CHECK(w < windows);
      CHECK(seen.insert(w).second);
      CHECK(torch::equal(v1.x[p], tokens_at(toks, w * 20, 20)));
      CHECK(torch::equal(v1.y[p], tokens_at(toks, w * 20 + 1, 20)));
    }
  }
  // Spread over the file: batch starts at floor(radical_inverse_2(k) * windows) (Python-computed).
  const std::vector<int64_t> starts = {0, 49, 24, 74, 12, 61, 37, 86};
  for (int64_t k = 0; k < 8; ++k) CHECK(a.val_window(k, 0) == starts[size_t(k)]);
  // The last window's target stays inside the file.
  const int64_t last = windows - 1;
  CHECK((last + 1) * 20 + 1 <= 2000);
}

TEST_CASE("token_bin errors name the file", "[data]") {
  TempDir tmp;
  const std::string shorty = write_tokens(tmp.path / "short.bin", ramp(16, 100), 2);
  CHECK_THROWS_WITH(TokenBinDataset(args_for(shorty, 16), 0), Catch::Contains(shorty));
  CHECK_NOTHROW(TokenBinDataset(args_for(shorty, 15), 0));  // 16 tokens = one sample of 15

  const std::string odd = (tmp.path / "odd.bin").string();
  std::ofstream(odd, std::ios::binary) << "abcdef";  // 6 bytes: not uint32 tokens
  CHECK_THROWS_WITH(TokenFile(odd, "uint32"), Catch::Contains(odd));
  CHECK_THROWS_WITH(TokenFile(odd, "int8"), Catch::Contains(odd) && Catch::Contains("int8"));

  const std::string missing = (tmp.path / "missing.bin").string();
  CHECK_THROWS_WITH(TokenBinDataset(args_for(missing, 4), 0), Catch::Contains(missing));

  TokenFile f(shorty, "uint16");
  std::vector<int64_t> buf(4);
  CHECK_THROWS_WITH(f.read(14, 4, buf.data()), Catch::Contains(shorty));
}

TEST_CASE("PrefetchLoader returns the producer's batches in order", "[data]") {
  TempDir tmp;
  const std::string path = write_tokens(tmp.path / "t.bin", ramp(3000, 500), 2);
  TokenBinDataset ds(args_for(path, 8), 3);
  auto producer = [&ds](int64_t step) { return ds.train_batch(step, 2, 3); };

  for (int depth : {0, 1, 3}) {
    INFO("depth " << depth);
    PrefetchLoader loader(producer, 5, depth, torch::kCPU, /*pin_memory=*/true);
    for (int64_t step = 5; step < 15; ++step) {
      CHECK(loader.next_index() == step);
      const Batch got = loader.next();
      const Batch want = ds.train_batch(step, 2, 3);
      CHECK(torch::equal(got.x, want.x));
      CHECK(torch::equal(got.y, want.y));
    }
    CHECK(loader.next_index() == 15);
  }

  // Destroyed with a full queue and the producer blocked on it: no hang, no leak.
  std::atomic<int> produced{0};
  {
    PrefetchLoader loader(
        [&](int64_t i) {
          ++produced;
          return ds.train_batch(i, 0, 1);
        },
        0, 2, torch::kCPU, false);
    loader.next();
  }
  CHECK(produced.load() >= 1);
  CHECK(produced.load() <= 4);  // bounded: depth 2 ahead of one consumed (+1 in flight)
}

TEST_CASE("PrefetchLoader rethrows a producer exception from next()", "[data]") {
  for (int depth : {0, 2}) {
    INFO("depth " << depth);
    PrefetchLoader loader(
        [](int64_t i) -> Batch {
          if (i == 3) throw std::runtime_error("bad sample at index 3");
          return {torch::full({1, 2}, i, torch::kInt64), torch::full({1, 2}, i + 1, torch::kInt64)};
        },
        1, depth, torch::kCPU, false);
    CHECK(loader.next().x[0][0].item<int64_t>() == 1);
    CHECK(loader.next().x[0][0].item<int64_t>() == 2);
    CHECK_THROWS_WITH(loader.next(), Catch::Contains("index 3"));
    CHECK_THROWS_WITH(loader.next(), Catch::Contains("index 3"));  // stays failed
    CHECK(loader.next_index() == 3);
  }
}
