// The torch-free safetensors reader and writer: round trips, streamed writes,
// slices, and one hostile file per fault the reader must refuse.
#include <catch2/catch.hpp>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "trainer/checkpoint/safetensors.h"

namespace fs = std::filesystem;
using namespace nnstrain::checkpoint;
using Catch::Matchers::Contains;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nnstrain_st_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::vector<uint8_t> le64(uint64_t v) {
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
  return out;
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

// A file byte by byte: length field (the header's own length unless overridden),
// header text, then `data_bytes` bytes of data.
std::string hostile(const TempDir& dir, const std::string& name, const std::string& header,
                    size_t data_bytes, std::optional<uint64_t> length = std::nullopt) {
  std::vector<uint8_t> bytes = le64(length.value_or(header.size()));
  bytes.insert(bytes.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<uint8_t>(i));
  std::string path = dir.file(name);
  write_bytes(path, bytes);
  return path;
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t b, uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
}

// The reader's error for `path`; fails the test if the file is accepted.
std::string fault_of(const std::string& path) {
  try {
    SafetensorsReader reader(path);
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  FAIL("reader accepted hostile file " << path);
  return {};
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed * 17 + (i >> 8));
  return v;
}

bool same_bytes(const uint8_t* got, const std::vector<uint8_t>& want) {
  return want.empty() || std::memcmp(got, want.data(), want.size()) == 0;
}

uint64_t header_length(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  uint8_t b[8];
  f.read(reinterpret_cast<char*>(b), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return n;
}

}  // namespace

TEST_CASE("dtype names and sizes follow the safetensors spelling", "[safetensors]") {
  const std::vector<std::pair<std::string, size_t>> expect = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2}, {"U32", 4}, {"U64", 8}};
  for (const auto& [name, size] : expect) {
    auto d = parse_dtype(name);
    REQUIRE(d);
    CHECK(dtype_name(*d) == name);
    CHECK(dtype_size(*d) == size);
  }
  CHECK_FALSE(parse_dtype("f32"));
  CHECK_FALSE(parse_dtype("F8_E4M3"));
}

TEST_CASE("safetensors round trip of every dtype, 0-d and empty tensors", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Spec> specs = {
      {"w.f64", DType::F64, {3, 2}},   {"w.f32", DType::F32, {2, 3, 4}}, {"w.f16", DType::F16, {5}},
      {"w.bf16", DType::BF16, {2, 2}}, {"i64", DType::I64, {}},          {"i32", DType::I32, {7}},
      {"i16", DType::I16, {1, 3}},     {"i8", DType::I8, {3}},           {"u8", DType::U8, {4, 1}},
      {"mask", DType::BOOL, {2}},      {"u16", DType::U16, {3}},         {"u32", DType::U32, {1}},
      {"u64", DType::U64, {2}},        {"empty", DType::F32, {0, 3}},    {"scalar.f32", DType::F32, {}},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "42"}, {"ünï", "cödé"}};
  std::vector<std::vector<uint8_t>> payload;
  {
    SafetensorsWriter w(path, meta);
    for (const auto& s : specs) w.declare(s.name, s.dtype, s.shape);
    for (size_t i = 0; i < specs.size(); ++i) {
      int64_t numel = std::accumulate(specs[i].shape.begin(), specs[i].shape.end(), int64_t{1},
                                      std::multiplies<int64_t>());
      payload.push_back(pattern(numel * dtype_size(specs[i].dtype), static_cast<uint8_t>(i)));
      if (specs[i].dtype == DType::BOOL)
        for (auto& b : payload.back()) b &= 1;
      w.append(payload.back().data(), payload.back().size());
    }
    w.finish();
  }
  // Data section starts 8-byte aligned, as the reference pads the header.
  const uint64_t n = header_length(path);
  CHECK(n % 8 == 0);
  uint64_t total = 0;
  for (const auto& p : payload) total += p.size();
  CHECK(fs::file_size(path) == 8 + n + total);

  SafetensorsReader r(path);
  CHECK(r.path() == path);
  CHECK(r.metadata() == meta);
  REQUIRE(r.tensors().size() == specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].name);
    // Declaration order is data order, and tensors() lists data order.
    CHECK(r.tensors()[i].name == specs[i].name);
    const TensorInfo& t = r.at(specs[i].name);
    CHECK(&t == r.find(specs[i].name));
    CHECK(t.dtype == specs[i].dtype);
    CHECK(t.shape == specs[i].shape);
    CHECK(t.nbytes() == payload[i].size());
    CHECK(t.end - t.begin == payload[i].size());
    CHECK(same_bytes(r.data(t), payload[i]));
  }
  CHECK(r.at("i64").numel() == 1);
  CHECK(r.at("empty").numel() == 0);
  CHECK(r.find("nope") == nullptr);
  CHECK_THROWS_WITH(r.at("nope"), Contains(path) && Contains("no tensor 'nope'"));

  // A moved reader keeps its mapping valid.
  SafetensorsReader moved(std::move(r));
  CHECK(std::memcmp(moved.data(moved.at("w.f32")), payload[1].data(), payload[1].size()) == 0);
}

TEST_CASE("safetensors file with no tensors is valid", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("none.safetensors");
  {
    SafetensorsWriter w(path);
    w.finish();
  }
  SafetensorsReader r(path);
  CHECK(r.tensors().empty());
  CHECK(r.metadata().empty());
  CHECK(fs::file_size(path) == 8 + header_length(path));
}

TEST_CASE("safetensors streamed writes in chunks of any size", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("stream.safetensors");
  // 10 MB: bigger than the writer's 8 MiB buffer, so both paths run.
  const std::vector<int64_t> big_shape = {2'500'000};
  auto a = pattern(3 * 4, 1), big = pattern(10'000'000, 2), c = pattern(5 * 2, 3);
  std::vector<uint8_t> all;
  for (const auto* v : {&a, &big, &c}) all.insert(all.end(), v->begin(), v->end());
  {
    SafetensorsWriter w(path, {{"k", "v"}});
    w.declare("a", DType::I32, {3});
    w.declare("big", DType::F32, big_shape);
    w.declare("c", DType::BF16, {5});
    // Chunks straddle tensor boundaries; the 9 MiB one bypasses the buffer.
    std::vector<size_t> chunks = {1, 0, 5, size_t{9} << 20};
    size_t pos = 0;
    for (size_t ch : chunks) {
      w.append(all.data() + pos, ch);
      pos += ch;
    }
    while (pos < all.size()) {
      size_t ch = std::min<size_t>(100'003, all.size() - pos);
      w.append(all.data() + pos, ch);
      pos += ch;
    }
    w.finish();
  }
  SafetensorsReader r(path);
  REQUIRE(r.tensors().size() == 3);
  CHECK(r.at("big").shape == big_shape);
  CHECK(std::memcmp(r.data(r.at("a")), a.data(), a.size()) == 0);
  CHECK(std::memcmp(r.data(r.at("big")), big.data(), big.size()) == 0);
  CHECK(std::memcmp(r.data(r.at("c")), c.data(), c.size()) == 0);
  CHECK(r.metadata().at("k") == "v");
}

TEST_CASE("safetensors writer refuses misuse and removes unfinished files", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  std::vector<uint8_t> bytes(64, 7);
  {
    SafetensorsWriter w(path);
    w.declare("a", DType::F32, {2});
    CHECK_THROWS_WITH(w.declare("a", DType::F32, {2}), Contains(path) && Contains("'a' declared twice"));
    CHECK_THROWS_WITH(w.declare("__metadata__", DType::F32, {2}), Contains("__metadata__"));
    CHECK_THROWS_WITH(w.declare("neg", DType::F32, {2, -1}), Contains("invalid shape [2, -1]"));
    w.declare("b", DType::U8, {3});
    w.append(bytes.data(), 4);
    CHECK_THROWS_WITH(w.declare("late", DType::F32, {1}), Contains(path) && Contains("declare every tensor first"));
    CHECK_THROWS_WITH(w.append(bytes.data(), 8), Contains(path) && Contains("exceeds the declared data"));
    w.append(bytes.data(), 5);
    CHECK_THROWS_WITH(w.finish(), Contains(path) && Contains("tensor 'b' is incomplete"));
    CHECK(fs::exists(path));
  }
  CHECK_FALSE(fs::exists(path));  // the destructor removed the partial file

  CHECK_THROWS_WITH(SafetensorsWriter(dir.file("no/such/dir/x.safetensors")),
                    Contains("no/such/dir/x.safetensors") && Contains("cannot create"));
}

TEST_CASE("safetensors read_slice copies 2-D blocks", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("slice2.safetensors");
  const int64_t R = 5, C = 7;
  std::vector<float> v(R * C);
  std::iota(v.begin(), v.end(), 0.f);
  {
    SafetensorsWriter w(path);
    w.declare("m", DType::F32, {R, C});
    w.append(v.data(), v.size() * sizeof(float));
    w.finish();
  }
  SafetensorsReader r(path);
  const TensorInfo& m = r.at("m");
  auto check = [&](std::vector<int64_t> off, std::vector<int64_t> sz) {
    std::vector<float> out(sz[0] * sz[1], -1.f);
    r.read_slice(m, off, sz, out.data());
    for (int64_t i = 0; i < sz[0]; ++i)
      for (int64_t j = 0; j < sz[1]; ++j) {
        INFO("block " << off[0] << "," << off[1] << " " << sz[0] << "x" << sz[1] << " at " << i << "," << j);
        REQUIRE(out[i * sz[1] + j] == v[(off[0] + i) * C + off[1] + j]);
      }
  };
  check({1, 2}, {3, 4});  // interior block
  check({1, 0}, {3, C});  // whole rows: one contiguous run
  check({0, 6}, {R, 1});  // a column
  check({0, 0}, {R, C});  // everything
  float sentinel = 123.f;
  r.read_slice(m, {2, 3}, {0, 2}, &sentinel);  // empty block writes nothing
  CHECK(sentinel == 123.f);
  std::vector<float> sink(64);
  CHECK_THROWS_WITH(r.read_slice(m, {4, 0}, {2, 1}, sink.data()),
                    Contains(path) && Contains("tensor 'm'") && Contains("out of range in dim 0"));
  CHECK_THROWS_WITH(r.read_slice(m, {0}, {1}, sink.data()), Contains("one entry per dim"));
  CHECK_THROWS_WITH(r.read_slice(m, {-1, 0}, {1, 1}, sink.data()), Contains("out of range"));
}

TEST_CASE("safetensors read_slice copies every 3-D block and 0-d tensors", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("slice3.safetensors");
  const std::vector<int64_t> shape = {3, 4, 2};
  std::vector<int16_t> v(24);
  std::iota(v.begin(), v.end(), int16_t{-5});
  const double scalar = 2.75;
  {
    SafetensorsWriter w(path);
    w.declare("t", DType::I16, shape);
    w.declare("s", DType::F64, {});
    w.append(v.data(), v.size() * 2);
    w.append(&scalar, 8);
    w.finish();
  }
  SafetensorsReader r(path);
  const TensorInfo& t = r.at("t");
  int blocks = 0;
  // Exhaustively: every offset and size along every dim.
  for (int64_t o0 = 0; o0 < 3; ++o0)
    for (int64_t s0 = 1; o0 + s0 <= 3; ++s0)
      for (int64_t o1 = 0; o1 < 4; ++o1)
        for (int64_t s1 = 1; o1 + s1 <= 4; ++s1)
          for (int64_t o2 = 0; o2 < 2; ++o2)
            for (int64_t s2 = 1; o2 + s2 <= 2; ++s2) {
              std::vector<int16_t> out(s0 * s1 * s2 + 1, 999);
              r.read_slice(t, {o0, o1, o2}, {s0, s1, s2}, out.data());
              size_t k = 0;
              for (int64_t i = 0; i < s0; ++i)
                for (int64_t j = 0; j < s1; ++j)
                  for (int64_t l = 0; l < s2; ++l, ++k)
                    REQUIRE(out[k] == v[((o0 + i) * 4 + o1 + j) * 2 + o2 + l]);
              REQUIRE(out[k] == 999);  // nothing written past the block
              ++blocks;
            }
  CHECK(blocks == 6 * 10 * 3);
  double got = 0;
  r.read_slice(r.at("s"), {}, {}, &got);
  CHECK(got == scalar);
}

TEST_CASE("fsync_dir syncs a folder and names one it cannot open", "[safetensors]") {
  TempDir dir;
  CHECK_NOTHROW(fsync_dir(dir.path.string()));
  CHECK_THROWS_WITH(fsync_dir(dir.file("missing")), Contains(dir.file("missing")));
}

// ---- hostile files: one fault each; the message names the file and the fault ----

TEST_CASE("safetensors fault: file shorter than 8 bytes", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("short.safetensors");
  write_bytes(path, {1, 0, 0, 0, 0});
  CHECK_THAT(fault_of(path), Contains(path) && Contains("shorter than 8 bytes"));
  write_bytes(path, {});
  CHECK_THAT(fault_of(path), Contains(path) && Contains("file is 0 bytes"));
}

TEST_CASE("safetensors fault: header length beyond the file", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "len.safetensors", "{}", 0, 1000);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("header length 1000 exceeds the file"));
  const std::string huge = hostile(dir, "huge.safetensors", "{}", 0, ~uint64_t{0});
  CHECK_THAT(fault_of(huge), Contains(huge) && Contains("exceeds the file"));
}

TEST_CASE("safetensors fault: header over the 100 MB limit", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "big.safetensors", "{}", 0, 100'000'001);
  fs::resize_file(path, 8 + 100'000'001);  // sparse: costs no disk
  CHECK_THAT(fault_of(path), Contains(path) && Contains("over the 100000000-byte limit"));
}

TEST_CASE("safetensors fault: invalid JSON", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "json.safetensors", "{\"a\": {\"dtype\": ", 0);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("not valid JSON"));
  const std::string arr = hostile(dir, "arr.safetensors", "[1, 2]  ", 0);
  CHECK_THAT(fault_of(arr), Contains(arr) && Contains("not a JSON object"));
  const std::string empty = hostile(dir, "empty.safetensors", "", 0);
  CHECK_THAT(fault_of(empty), Contains(empty) && Contains("not valid JSON"));
}

TEST_CASE("safetensors fault: header not valid UTF-8", "[safetensors]") {
  TempDir dir;
  std::string header = "{" + entry("a", "F32", "[1]", 0, 4) + ",\"__metadata__\":{\"k\":\"\xC3\x28\"}}";
  const std::string path = hostile(dir, "utf8.safetensors", header, 4);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("not valid UTF-8"));
}

TEST_CASE("safetensors fault: duplicate names", "[safetensors]") {
  TempDir dir;
  std::string header = "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("a", "F32", "[2]", 8, 16) + "}";
  const std::string path = hostile(dir, "dup.safetensors", header, 16);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("duplicate tensor name 'a'"));
  std::string key = "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  const std::string inner = hostile(dir, "dupkey.safetensors", key, 4);
  CHECK_THAT(fault_of(inner), Contains(inner) && Contains("duplicate key 'dtype' in the entry of tensor 'a'"));
  std::string meta = "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}";
  const std::string m = hostile(dir, "dupmeta.safetensors", meta, 0);
  CHECK_THAT(fault_of(m), Contains(m) && Contains("duplicate key 'k' in __metadata__"));
}

TEST_CASE("safetensors fault: unknown dtype", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "dtype.safetensors", "{" + entry("w", "F7", "[2]", 0, 8) + "}", 8);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("tensor 'w' has unknown dtype 'F7'"));
}

TEST_CASE("safetensors fault: malformed entry fields", "[safetensors]") {
  TempDir dir;
  const std::string neg = hostile(dir, "neg.safetensors", "{" + entry("w", "F32", "[2,-1]", 0, 0) + "}", 0);
  CHECK_THAT(fault_of(neg), Contains(neg) && Contains("tensor 'w' shape entry must be non-negative"));
  const std::string flt = hostile(dir, "flt.safetensors", "{" + entry("w", "F32", "[2.0]", 0, 8) + "}", 8);
  CHECK_THAT(fault_of(flt), Contains(flt) && Contains("must be a non-negative integer, not a float"));
  const std::string miss = hostile(dir, "miss.safetensors", "{\"w\":{\"dtype\":\"F32\",\"shape\":[]}}", 0);
  CHECK_THAT(fault_of(miss), Contains(miss) && Contains("tensor 'w' lacks 'data_offsets'"));
  const std::string extra = hostile(
      dir, "extra.safetensors",
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4],\"strides\":[]}}", 4);
  CHECK_THAT(fault_of(extra), Contains(extra) && Contains("unexpected key 'strides'"));
  const std::string back = hostile(dir, "back.safetensors", "{" + entry("w", "U8", "[0]", 4, 0) + "}", 4);
  CHECK_THAT(fault_of(back), Contains(back) && Contains("end before they begin"));
  const std::string deep = hostile(dir, "deep.safetensors", "{\"w\":{\"shape\":[[[[1]]]]}}", 0);
  CHECK_THAT(fault_of(deep), Contains(deep) && Contains("nests deeper"));
}

TEST_CASE("safetensors fault: shape and offsets size mismatch", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "size.safetensors", "{" + entry("w", "F32", "[3]", 0, 8) + "}", 8);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("tensor 'w' size mismatch") &&
                                 Contains("span 8 bytes but shape [3] of F32 needs 12"));
  // A shape whose byte count overflows 64 bits cannot slip through.
  const std::string ovf = hostile(
      dir, "ovf.safetensors", "{" + entry("w", "F64", "[4294967296,4294967296]", 0, 0) + "}", 0);
  CHECK_THAT(fault_of(ovf), Contains(ovf) && Contains("size mismatch"));
}

TEST_CASE("safetensors fault: overlapping offsets", "[safetensors]") {
  TempDir dir;
  std::string header = "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}";
  const std::string path = hostile(dir, "overlap.safetensors", header, 12);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("tensors 'a' and 'b' overlap"));
}

TEST_CASE("safetensors fault: out-of-bounds offsets", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "oob.safetensors", "{" + entry("w", "F32", "[2]", 64, 72) + "}", 8);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("tensor 'w' data_offsets [64, 72] are out of bounds"));
}

TEST_CASE("safetensors fault: hole between tensors", "[safetensors]") {
  TempDir dir;
  std::string header = "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 12, 20) + "}";
  const std::string path = hostile(dir, "hole.safetensors", header, 20);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("hole in the data section: bytes [8, 12) before tensor 'b'"));
  const std::string first = hostile(dir, "first.safetensors", "{" + entry("a", "U8", "[4]", 4, 8) + "}", 8);
  CHECK_THAT(fault_of(first), Contains(first) && Contains("hole") && Contains("[0, 4)"));
}

TEST_CASE("safetensors fault: trailing bytes", "[safetensors]") {
  TempDir dir;
  const std::string path = hostile(dir, "trail.safetensors", "{" + entry("w", "F32", "[2]", 0, 8) + "}", 12);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("4 trailing bytes after the last tensor"));
}

TEST_CASE("safetensors fault: truncated data", "[safetensors]") {
  TempDir dir;
  std::string header = "{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 8, 16) + "}";
  const std::string path = hostile(dir, "trunc.safetensors", header, 12);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("file is truncated") &&
                                 Contains("describes 16 data bytes but only 12"));
  // A valid file cut short is caught the same way.
  const std::string good = dir.file("good.safetensors");
  {
    SafetensorsWriter w(good);
    w.declare("x", DType::F64, {16});
    std::vector<double> v(16, 1.5);
    w.append(v.data(), 128);
    w.finish();
  }
  REQUIRE_NOTHROW(SafetensorsReader(good));
  fs::resize_file(good, fs::file_size(good) - 1);
  CHECK_THAT(fault_of(good), Contains(good) && Contains("truncated"));
}

TEST_CASE("safetensors fault: bad metadata type", "[safetensors]") {
  TempDir dir;
  std::string header = "{\"__metadata__\":{\"step\":42}," + entry("w", "U8", "[1]", 0, 1) + "}";
  const std::string path = hostile(dir, "meta.safetensors", header, 1);
  CHECK_THAT(fault_of(path), Contains(path) && Contains("__metadata__ value of 'step' must be a string, not an integer"));
  const std::string arr = hostile(dir, "meta2.safetensors", "{\"__metadata__\":[\"a\"]}", 0);
  CHECK_THAT(fault_of(arr), Contains(arr) && Contains("__metadata__ must be an object"));
}
