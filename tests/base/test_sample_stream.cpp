// The indexed datasets' sample stream (data/indexed/sample_stream.h), torch-free:
// Megatron-Core's blending, epochs covering every sample once, joins, prompt flags.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "data/indexed/indexed_file.h"
#include "data/indexed/sample_stream.h"

namespace fs = std::filesystem;
using namespace nnstrain::indexed;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nnstrain_stream_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Documents of distinct ids (document d holds ids 1000 * (d + 1) + i), written as
// Megatron files; with `prompts`, each is (prompt of p ids, response) sequences.
std::string write_docs(const fs::path& dir, const std::string& name, const std::vector<int>& lengths, int prompt = 0) {
  const std::string prefix = (dir / name).string();
  Writer w(prefix, DType::int32);
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int32_t> a, b;
    for (int i = 0; i < lengths[d]; ++i) (i < prompt ? a : b).push_back(int32_t(1000 * (d + 1) + i));
    if (prompt) w.add_document(std::vector<const std::vector<int32_t>*>{&a, &b});
    else w.add_document(b);
  }
  w.commit();
  return prefix;
}

}  // namespace

TEST_CASE("blending follows Megatron-Core's build_blending_indices", "[sample_stream]") {
  // Expected: megatron.core.datasets.helpers_cpp.build_blending_indices (megatron-core
  // in scripts/setup.sh's venv) for weights [3, 1, 1.5] normalised, 48 samples.
  const std::vector<int> megatron = {0, 2, 1, 0, 0, 2, 0, 1, 0, 2, 0, 0, 2, 1, 0, 0, 2, 0, 1, 0, 2, 0, 0, 2,
                                     1, 0, 0, 2, 0, 1, 0, 2, 0, 0, 2, 1, 0, 0, 2, 0, 1, 0, 2, 0, 0, 2, 1, 0};
  std::vector<int> ds;
  std::vector<int64_t> idx;
  blend({3, 1, 1.5}, 48, &ds, &idx);
  CHECK(ds == megatron);
  // Each dataset's samples are handed out in order.
  std::map<int, int64_t> next;
  for (size_t i = 0; i < ds.size(); ++i) CHECK(idx[i] == next[ds[i]]++);

  // 200,000 samples at [0.5, 0.3, 0.2]: Megatron gives exactly 100,000 / 60,000 /
  // 40,000, and these datasets and indices around the memoised block boundary.
  blend({0.5, 0.3, 0.2}, 200000, &ds, &idx);
  CHECK(std::count(ds.begin(), ds.end(), 0) == 100000);
  CHECK(std::count(ds.begin(), ds.end(), 1) == 60000);
  CHECK(std::count(ds.begin(), ds.end(), 2) == 40000);
  const std::vector<int> ds_at = {0, 1, 2, 0, 1, 0, 2, 0, 1, 0, 0, 1, 2, 0, 1};
  const std::vector<int64_t> idx_at = {32765, 19659, 13106, 32766, 19660, 32767, 13107, 32768,
                                       19661, 32769, 32770, 19662, 13108, 32771, 19663};
  CHECK(std::vector<int>(ds.begin() + 65530, ds.begin() + 65545) == ds_at);
  CHECK(std::vector<int64_t>(idx.begin() + 65530, idx.begin() + 65545) == idx_at);
}

TEST_CASE("SampleStream::locate equals the whole blend from any starting sample", "[sample_stream]") {
  TempDir tmp;
  std::vector<SampleStream::Source> src;
  for (int i = 0; i < 3; ++i) src.push_back({Reader(write_docs(tmp.path, "d" + std::to_string(i), {40, 50})), 1.0 + i, false});
  src[0].weight = 0.5, src[1].weight = 0.3, src[2].weight = 0.2;
  SampleStream s(src, 8, Join::eos, 7, 1);
  std::vector<int> ds;
  std::vector<int64_t> idx;
  blend({0.5, 0.3, 0.2}, 140000, &ds, &idx);
  for (int64_t first : {int64_t(0), int64_t(5), int64_t(65530), int64_t(131070), int64_t(70000)}) {
    const auto got = s.locate(first, 10);  // a fresh lookup in a later block, then an earlier one
    for (int64_t k = 0; k < 10; ++k) {
      CHECK(got[size_t(k)].first == ds[size_t(first + k)]);
      CHECK(got[size_t(k)].second == idx[size_t(first + k)]);
    }
  }
}

TEST_CASE("permute is a bijection for every size", "[sample_stream]") {
  for (uint64_t n : {1ULL, 2ULL, 3ULL, 5ULL, 16ULL, 17ULL, 1000ULL, 4097ULL}) {
    std::set<uint64_t> seen;
    for (uint64_t x = 0; x < n; ++x) seen.insert(permute(x, n, 42));
    CHECK(seen.size() == n);
    CHECK(*seen.rbegin() == n - 1);
  }
  // Different keys give different orders.
  int same = 0;
  for (uint64_t x = 0; x < 1000; ++x) same += permute(x, 1000, 1) == permute(x, 1000, 2);
  CHECK(same < 50);
}

TEST_CASE("an epoch packs every document once, joined with EOS, and covers each sample once", "[sample_stream]") {
  TempDir tmp;
  const std::vector<int> lengths = {5, 9, 3, 12, 7, 1, 8};  // 45 tokens + 7 EOS = 52
  const std::string prefix = write_docs(tmp.path, "docs", lengths);
  const int64_t T = 4, eos = 99;
  SampleStream s({{Reader(prefix), 1.0, false}}, T, Join::eos, eos, 123);
  REQUIRE(s.samples_per_epoch() == (52 - 1) / T);  // 12: the tail that fills no sample is dropped

  // The epoch's stream, rebuilt from its document order: each document then EOS.
  std::vector<int64_t> stream;
  std::set<int64_t> docs;
  for (int64_t p = 0; p < 7; ++p) {
    const int64_t d = s.document_at(0, 0, p);
    docs.insert(d);
    for (int i = 0; i < lengths[size_t(d)]; ++i) stream.push_back(1000 * (d + 1) + i);
    stream.push_back(eos);
  }
  CHECK(docs.size() == 7);
  std::set<int64_t> starts;
  Sample smp;
  for (int64_t j = 0; j < s.samples_per_epoch(); ++j) {
    const int64_t start = s.sample_start(0, j);
    starts.insert(start);
    s.read(0, j, &smp);
    REQUIRE(smp.tokens.size() == size_t(T + 1));
    CHECK(smp.tokens == std::vector<int64_t>(stream.begin() + start, stream.begin() + start + T + 1));
    // Document numbers go up by one after each EOS.
    for (int64_t t = 1; t <= T; ++t)
      CHECK(smp.doc[size_t(t)] == smp.doc[size_t(t - 1)] + (smp.tokens[size_t(t - 1)] == eos ? 1 : 0));
    CHECK(std::count(smp.prompt.begin(), smp.prompt.end(), 1) == 0);
  }
  // Every sample of the epoch exactly once, in a shuffled order.
  CHECK(starts.size() == size_t(s.samples_per_epoch()));
  CHECK(*starts.rbegin() == (s.samples_per_epoch() - 1) * T);
  int in_place = 0;
  for (int64_t j = 0; j < s.samples_per_epoch(); ++j) in_place += s.sample_start(0, j) == j * T;
  CHECK(in_place < s.samples_per_epoch() / 2);
  // The next epoch reorders the documents (7! orders; this seed does) and its samples.
  bool reordered = false;
  for (int64_t p = 0; p < 7; ++p) reordered = reordered || s.document_at(0, 1, p) != s.document_at(0, 0, p);
  CHECK(reordered);
  // The same seed gives the same stream; another seed another.
  SampleStream again({{Reader(prefix), 1.0, false}}, T, Join::eos, eos, 123), other({{Reader(prefix), 1.0, false}}, T, Join::eos, eos, 124);
  Sample a, b;
  int differ = 0;
  for (int64_t j = 0; j < 24; ++j) {
    s.read(0, j, &smp);
    again.read(0, j, &a);
    other.read(0, j, &b);
    CHECK(a.tokens == smp.tokens);
    differ += b.tokens != smp.tokens;
  }
  CHECK(differ > 0);
}

TEST_CASE("BOS joins go before each document, none joins nothing", "[sample_stream]") {
  TempDir tmp;
  const std::string prefix = write_docs(tmp.path, "docs", {3, 4});
  SampleStream bos({{Reader(prefix), 1.0, false}}, 8, Join::bos, 77, 5);
  REQUIRE(bos.samples_per_epoch() == 1);  // 3 + 4 + 2 BOS = 9 tokens: one sample of 8 + 1
  Sample smp;
  bos.read(0, 0, &smp);
  const int64_t d0 = bos.document_at(0, 0, 0), d1 = bos.document_at(0, 0, 1);
  std::vector<int64_t> want = {77};
  for (int i = 0; i < (d0 == 0 ? 3 : 4); ++i) want.push_back(1000 * (d0 + 1) + i);
  want.push_back(77);
  for (int i = 0; i < (d1 == 0 ? 3 : 4); ++i) want.push_back(1000 * (d1 + 1) + i);
  CHECK(smp.tokens == want);
  // The BOS belongs to the document it starts.
  const int64_t n0 = d0 == 0 ? 3 : 4;
  for (int64_t t = 0; t < 9; ++t) CHECK(smp.doc[size_t(t)] == (t <= n0 ? 0 : 1));

  SampleStream none({{Reader(prefix), 1.0, false}}, 6, Join::none, 0, 5);
  REQUIRE(none.samples_per_epoch() == 1);  // 7 tokens
  none.read(0, 0, &smp);
  CHECK(std::count(smp.tokens.begin(), smp.tokens.end(), 0) == 0);
  CHECK(smp.tokens.size() == 7);
  // A dataset too small for one sample is refused, naming it.
  CHECK_THROWS_WITH(SampleStream({{Reader(prefix), 1.0, false}}, 9, Join::none, 0, 5),
                    Catch::Contains("too few for one sample") && Catch::Contains("docs"));
}

TEST_CASE("instruction documents flag their prompt tokens", "[sample_stream]") {
  TempDir tmp;
  const std::vector<int> lengths = {6, 8, 5, 9, 7, 6};
  const int prompt = 3;  // the first 3 ids of every document are its prompt
  const std::string prefix = write_docs(tmp.path, "alpaca", lengths, prompt);
  SampleStream s({{Reader(prefix), 1.0, true}}, 5, Join::eos, 99, 9);
  SampleStream off({{Reader(prefix), 1.0, false}}, 5, Join::eos, 99, 9);
  Sample smp, plain;
  int64_t flagged = 0;
  for (int64_t j = 0; j < s.samples_per_epoch(); ++j) {
    s.read(0, j, &smp);
    off.read(0, j, &plain);
    CHECK(plain.tokens == smp.tokens);
    for (size_t t = 0; t < smp.tokens.size(); ++t) {
      const int64_t id = smp.tokens[t];
      const bool is_prompt = id != 99 && id % 1000 < prompt;
      CHECK(bool(smp.prompt[t]) == is_prompt);
      CHECK(plain.prompt[t] == 0);
      flagged += smp.prompt[t];
    }
  }
  CHECK(flagged > 0);
}

TEST_CASE("read_manifest resolves the files beside it and refuses paths leaving its folder", "[sample_stream]") {
  TempDir tmp;
  const std::string prefix = write_docs(tmp.path, "corpus", {4, 4});
  auto write = [&](const nlohmann::json& j) { std::ofstream(prefix + ".manifest.json") << j.dump(); };
  nlohmann::json m = {{"bin", "corpus.bin"}, {"idx", "corpus.idx"}, {"sequences_per_document", 2},
                      {"tokenizer", {{"path", "tok"}, {"sha256", "ab"}, {"vocab_size", 5000}, {"eos_id", 3}, {"bos_id", nullptr}}}};
  write(m);
  for (const std::string& p : {prefix, prefix + ".manifest.json"}) {
    const auto got = read_manifest(p);
    CHECK(got.prefix == prefix);
    CHECK(got.eos_id == std::optional<int64_t>(3));
    CHECK(!got.bos_id);
    CHECK(got.vocab_size == 5000);
    CHECK(got.sequences_per_document == 2);
  }
  for (const char* bad : {"../corpus.bin", "/etc/corpus.bin", "sub/corpus.bin", ".."}) {
    m["bin"] = bad;
    write(m);
    CHECK_THROWS_WITH(read_manifest(prefix), Catch::Contains("not a file name beside the manifest"));
  }
  CHECK_THROWS_WITH(read_manifest(prefix + "x"), Catch::Contains("no dataset manifest"));
}
