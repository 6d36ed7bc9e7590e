// sha256, `nnstrain prepare` and the Megatron index files it writes (torch-free).
#include <unistd.h>

#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "data/indexed/indexed_file.h"
#include "data/prepare.h"
#include "data/sha256.h"

namespace fs = std::filesystem;
using nnstrain::data::prepare_main;
using nnstrain::data::sha256_hex;

namespace {

const std::string kShakespeare =
    std::string(NNSTRAIN_SOURCE_DIR) + "/../shared/data/tinyshakespeare/input.txt";

// A fresh temporary folder, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nnstrain_prepare_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out << bytes;
}

std::vector<uint16_t> read_u16(const fs::path& p) {
  const std::string b = slurp(p);
  std::vector<uint16_t> v(b.size() / 2);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = uint16_t(uint8_t(b[2 * i]) | (uint16_t(uint8_t(b[2 * i + 1])) << 8));
  return v;
}

struct Run {
  int rc;
  std::string out, err;
};
Run run_prepare(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  int rc = prepare_main(args, out, err);
  return {rc, out.str(), err.str()};
}

}  // namespace

TEST_CASE("sha256 matches the FIPS 180-2 test vectors", "[prepare]") {
  CHECK(sha256_hex(std::string("abc")) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex(std::string()) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex(std::string("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(sha256_hex(million) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

  // Incremental updates that straddle block boundaries give the same digest.
  nnstrain::data::Sha256 h;
  for (size_t i = 0; i < million.size(); i += 37) h.update(million.data() + i, std::min<size_t>(37, million.size() - i));
  CHECK(h.hex_digest() == sha256_hex(million));

  TempDir tmp;
  spit(tmp.path / "abc.txt", "abc");
  CHECK(nnstrain::data::sha256_file_hex((tmp.path / "abc.txt").string()) == sha256_hex(std::string("abc")));
  CHECK_THROWS_WITH(nnstrain::data::sha256_file_hex((tmp.path / "missing").string()),
                    Catch::Contains("missing"));
}

TEST_CASE("prepare shakespeare_char reproduces nanoGPT's split", "[prepare]") {
  // CI always has ../shared beside the checkout: a missing corpus is a broken setup, not a skip.
  if (!fs::exists(kShakespeare)) FAIL(kShakespeare << " is absent (the shared data folder beside the checkout)");
  TempDir tmp;
  const fs::path out = tmp.path / "sc";
  Run r = run_prepare({"shakespeare_char", "--input", kShakespeare, "--out", out.string()});
  INFO(r.out << r.err);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Catch::Contains("train.bin") && Catch::Contains("1003854"));

  const auto meta = nlohmann::json::parse(slurp(out / "meta.json"));
  CHECK(meta.at("vocab_size") == 65);
  CHECK(meta.at("itos").size() == 65);
  CHECK(meta.at("source_sha256") == nnstrain::data::kShakespeareSha256);
  CHECK(meta.at("train_tokens") == 1003854);
  CHECK(meta.at("val_tokens") == 111540);

  const auto train = read_u16(out / "train.bin");
  const auto val = read_u16(out / "val.bin");
  CHECK(train.size() == 1003854);
  CHECK(val.size() == 111540);
  CHECK(fs::file_size(out / "train.bin") == 2 * 1003854);

  // Vocabulary is sorted: newline first, 'z' last.
  CHECK(meta["itos"][0] == "\n");
  CHECK(meta["itos"][64] == "z");
  std::string decoded;
  for (size_t i = 0; i < 13; ++i) decoded += meta["itos"][train[i]].get<std::string>();
  CHECK(decoded == "First Citizen");

  // Train then val is the corpus, char for char.
  const std::string text = slurp(kShakespeare);
  std::string all;
  for (uint16_t t : train) all += meta["itos"][t].get<std::string>();
  for (uint16_t t : val) all += meta["itos"][t].get<std::string>();
  CHECK(all == text);

  // A rerun leaves the outputs alone and says so.
  const auto mtime = fs::last_write_time(out / "train.bin");
  Run again = run_prepare({"shakespeare_char", "--input", kShakespeare, "--out", out.string()});
  CHECK(again.rc == 0);
  CHECK_THAT(again.out, Catch::Contains("up to date"));
  CHECK(fs::last_write_time(out / "train.bin") == mtime);

  // No temporary files are left behind.
  for (const auto& e : fs::directory_iterator(out))
    CHECK_THAT(e.path().filename().string(), !Catch::Contains(".tmp"));
}

TEST_CASE("prepare shakespeare_char refuses a corrupted copy", "[prepare]") {
  // CI always has ../shared beside the checkout: a missing corpus is a broken setup, not a skip.
  if (!fs::exists(kShakespeare)) FAIL(kShakespeare << " is absent (the shared data folder beside the checkout)");
  TempDir tmp;
  std::string text = slurp(kShakespeare);
  text[1000] = text[1000] == 'x' ? 'y' : 'x';
  const fs::path bad = tmp.path / "input.txt";
  spit(bad, text);
  Run r = run_prepare({"shakespeare_char", "--input", bad.string(), "--out", (tmp.path / "o").string()});
  CHECK(r.rc == 1);
  CHECK_THAT(r.err, Catch::Contains("sha256 mismatch") && Catch::Contains(bad.string()) &&
                        Catch::Contains(nnstrain::data::kShakespeareSha256) &&
                        Catch::Contains(sha256_hex(text)));
  CHECK_FALSE(fs::exists(tmp.path / "o" / "train.bin"));
}

TEST_CASE("prepare text at byte and char level", "[prepare]") {
  TempDir tmp;
  // Includes a two-byte UTF-8 character: one char token, two byte tokens.
  const std::string text = "hello world, h\xC3\xA9llo again\n0123456789";
  spit(tmp.path / "t.txt", text);

  SECTION("byte level") {
    Run r = run_prepare({"text", "--input", (tmp.path / "t.txt").string(), "--out",
                         (tmp.path / "b").string(), "--level", "byte", "--val-fraction", "0.25"});
    INFO(r.out << r.err);
    REQUIRE(r.rc == 0);
    const auto meta = nlohmann::json::parse(slurp(tmp.path / "b" / "meta.json"));
    CHECK(meta.at("vocab_size") == 256);
    CHECK(meta.at("level") == "byte");
    const auto train = read_u16(tmp.path / "b" / "train.bin");
    const auto val = read_u16(tmp.path / "b" / "val.bin");
    const size_t n_train = size_t(double(text.size()) * 0.75);
    REQUIRE(train.size() == n_train);
    REQUIRE(val.size() == text.size() - n_train);
    for (size_t i = 0; i < text.size(); ++i)
      CHECK((i < n_train ? train[i] : val[i - n_train]) == uint8_t(text[i]));
  }
  SECTION("char level") {
    Run r = run_prepare({"text", "--input", (tmp.path / "t.txt").string(), "--out=" + (tmp.path / "c").string()});
    INFO(r.out << r.err);
    REQUIRE(r.rc == 0);
    const auto meta = nlohmann::json::parse(slurp(tmp.path / "c" / "meta.json"));
    const auto train = read_u16(tmp.path / "c" / "train.bin");
    const auto val = read_u16(tmp.path / "c" / "val.bin");
    CHECK(train.size() + val.size() == text.size() - 1);  // \xC3\xA9 is one character
    std::string all;
    for (uint16_t t : train) all += meta["itos"][t].get<std::string>();
    for (uint16_t t : val) all += meta["itos"][t].get<std::string>();
    CHECK(all == text);
    CHECK(meta["itos"].back() == "\xC3\xA9");  // highest code point sorts last
  }
}

TEST_CASE("prepare usage errors exit with status 2", "[prepare]") {
  TempDir tmp;
  Run unknown = run_prepare({"wikitext", "--out", tmp.path.string()});
  CHECK(unknown.rc == 2);
  CHECK_THAT(unknown.err, Catch::Contains("unknown dataset 'wikitext'"));

  const std::string missing = (tmp.path / "nope.txt").string();
  Run miss = run_prepare({"text", "--input", missing, "--out", (tmp.path / "o").string()});
  CHECK(miss.rc == 2);
  CHECK_THAT(miss.err, Catch::Contains(missing));

  Run miss2 = run_prepare({"shakespeare_char", "--input", missing, "--out", (tmp.path / "o").string()});
  CHECK(miss2.rc == 2);
  CHECK_THAT(miss2.err, Catch::Contains(missing));

  Run bad_opt = run_prepare({"text", "--input", missing, "--bogus", "1"});
  CHECK(bad_opt.rc == 2);
  CHECK_THAT(bad_opt.err, Catch::Contains("--bogus"));

  spit(tmp.path / "t.txt", "some text here");
  Run bad_frac = run_prepare({"text", "--input", (tmp.path / "t.txt").string(), "--out",
                              (tmp.path / "o").string(), "--val-fraction", "1.5"});
  CHECK(bad_frac.rc == 2);
  CHECK_THAT(bad_frac.err, Catch::Contains("--val-fraction"));
}

// The Megatron index arrays start at byte 34 (after the header), so none of them is
// aligned for its type: every accessor reads them by value (data/indexed/indexed_file.cpp:
// load_unaligned). Run under -fsanitize=undefined this test reports any read through
// a misaligned int32_t* or int64_t*; it also checks what each accessor returns, for
// both dtypes and 1 to 3 sequences (arrays at every offset mod 8).
TEST_CASE("indexed files: every index array read back at its misaligned offset", "[prepare][indexed]") {
  using namespace nnstrain::indexed;
  TempDir tmp;
  for (DType dtype : {DType::uint16, DType::int32}) {
    for (int n_docs = 1; n_docs <= 3; ++n_docs) {
      INFO(dtype_name(dtype) << ", " << n_docs << " documents");
      const std::string prefix = (tmp.path / ("d" + std::to_string(n_docs) + dtype_name(dtype))).string();
      std::vector<std::vector<int32_t>> docs;
      {
        Writer w(prefix, dtype);
        for (int d = 0; d < n_docs; ++d) {
          docs.push_back({});
          for (int i = 0; i <= 2 * d + 1; ++i) docs.back().push_back(100 * (d + 1) + i);
          w.add_document(docs.back());
        }
        w.commit();
      }
      const Reader r(prefix);
      REQUIRE(r.sequences() == n_docs);
      REQUIRE(r.documents() == n_docs);
      int64_t offset = 0;
      for (int d = 0; d < n_docs; ++d) {
        CHECK(r.doc_begin(d) == d);
        CHECK(r.seq_length(d) == static_cast<int32_t>(docs[d].size()));
        CHECK(r.seq_offset(d) == offset);
        std::vector<int64_t> got(docs[d].size());
        r.read(offset, static_cast<int64_t>(got.size()), got.data());
        CHECK(std::equal(got.begin(), got.end(), docs[d].begin()));
        offset += static_cast<int64_t>(docs[d].size());
      }
      CHECK(r.doc_begin(n_docs) == n_docs);
      CHECK(r.tokens() == offset);
      CHECK(r.max_token() == docs.back().back());
    }
  }
}
