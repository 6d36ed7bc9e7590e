// Untrusted input cannot hurt a run: bounded YAML (size, alias-expanded nodes,
// key and scalar length, short quotes in messages), bounded JSON, and file names
// from checkpoint metadata that never leave their folder. Fast and torch-free;
// the binary-level cases are tests/integration/test_hostile_inputs.py.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "trainer/checkpoint/manifest.h"
#include "base/config/load.h"
#include "data/indexed/config_check.h"
#include "trainer/pipeline/config_check.h"
#include "base/text.h"

namespace fs = std::filesystem;
using namespace nnstrain;
using Catch::Matchers::Contains;

namespace {

struct Scratch {
  fs::path dir;
  Scratch() {
    static std::atomic<int> counter{0};
    dir = fs::temp_directory_path() /
          ("nnstrain_test_untrusted_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  }
};

constexpr const char* kMinimal =
    "model: {type: gpt}\ndataset: {train_args: {path: t.bin, seq_len: 8}}\nmax_train_steps: 1\n";

// Loads `text` as a config; returns the ConfigError message ("" if it loaded) and the seconds taken.
std::pair<std::string, double> load(const Scratch& s, const std::string& text) {
  config::LoadOptions opts;
  opts.check_files = false;
  opts.checks = {parallel::pipeline::check_config_schedule, indexed::check_config_datasets};
  const auto path = s.write("c.yaml", text);
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    config::load_trainer_args(path, opts);
  } catch (const config::ConfigError& e) {
    msg = e.what();
  }
  return {msg, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

// A billion-laughs YAML: `levels` anchors, each a list of ten aliases of the previous.
std::string alias_bomb(int levels, const std::string& where) {
  std::string y = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n";
  for (int i = 1; i < levels; ++i) {
    const std::string p = "*a" + std::to_string(i - 1);
    y += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [" + p;
    for (int k = 1; k < 10; ++k) y += ", " + p;
    y += "]\n";
  }
  std::string indented;
  for (size_t start = 0; start < y.size();) {
    const size_t end = y.find('\n', start);
    indented += "  " + y.substr(start, end - start + 1);
    start = end + 1;
  }
  return where + ":\n" + indented;
}

}  // namespace

TEST_CASE("yaml: an alias bomb is refused by the node limit, wherever it sits", "[untrusted][config]") {
  Scratch s;
  // 10^9 nodes once expanded, a few hundred bytes on disk: in vars (which nnstrain
  // takes whole) and in a mapping it reads key by key.
  for (const std::string where : {"vars", "lr_scheduler"}) {
    const auto [msg, secs] = load(s, std::string(kMinimal) + alias_bomb(9, where));
    INFO(msg);
    CHECK_THAT(msg, Contains("YAML nodes with aliases expanded") && Contains(where) && Contains("(line "));
    CHECK(msg.size() < 400);
  }
}

TEST_CASE("yaml: a config just under the node limit still loads", "[untrusted][config]") {
  Scratch s;
  // 10^4 expanded nodes: legitimate anchors keep working.
  const auto [msg, secs] = load(s, std::string(kMinimal) + alias_bomb(4, "vars"));
  CHECK(msg.empty());
}

// `levels` variables, each a list holding the previous one twice: 2^levels nodes once
// substituted, from a few hundred bytes that hold no alias at all.
std::string vars_bomb(int levels) {
  std::string y = "vars:\n  v0: [lol, lol]\n";
  for (int i = 1; i < levels; ++i) {
    const std::string ref = "$(vars.v" + std::to_string(i - 1) + ")";
    y += "  v" + std::to_string(i) + ": [" + ref + ", " + ref + "]\n";
  }
  return y;
}

TEST_CASE("yaml: variables substituted into a bomb are refused by the node and length limits",
          "[untrusted][config]") {
  Scratch s;
  SECTION("nodes: each variable a list of two references to the one before") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + vars_bomb(30));
    INFO(msg);
    CHECK_THAT(msg, Contains("vars.v") && Contains("more than 10000 YAML nodes built substituting variables"));
    CHECK(msg.size() < 400);
  }
  SECTION("a string doubled by each variable") {
    std::string y = "vars:\n  s0: lollollol\n";
    for (int i = 1; i < 30; ++i)
      y += "  s" + std::to_string(i) + ": $(vars.s" + std::to_string(i - 1) + ")$(vars.s" + std::to_string(i - 1) + ")\n";
    const auto [msg, secs] = load(s, std::string(kMinimal) + y);
    INFO(msg);
    CHECK_THAT(msg, Contains("longer than the limit of 16384 bytes once variables are substituted"));
    CHECK(msg.size() < 400);
  }
  SECTION("a variable that refers to itself twice (found by fuzz_config: it ran for minutes)") {
    std::ifstream in(std::string(NNSTRAIN_SOURCE_DIR) + "/tests/fuzz/regressions/config/vars-self-reference-bomb",
                     std::ios::binary);
    REQUIRE(in);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto [msg, secs] = load(s, text);
    INFO(msg);
    CHECK_THAT(msg, Contains("vars.betas") && Contains("substitut"));
  }
  SECTION("under the limit, the same construction resolves") {
    config::LoadOptions opts;
    opts.check_files = false;
    opts.checks = {parallel::pipeline::check_config_schedule, indexed::check_config_datasets};
    const auto args = config::load_trainer_args_from_text(
        std::string(kMinimal) + vars_bomb(8) + "  name: $(vars.base)-b\n  base: a\nrun_dir: $(vars.name)\n",
        "vars.yaml", opts);
    CHECK(args.run_dir == "a-b");
  }
}

TEST_CASE("yaml: long keys and values, big files: refused with a short quote", "[untrusted][config]") {
  Scratch s;
  const std::string big(300000, 'k');
  SECTION("an explicit key") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + "? " + big + "\n: 1\n");
    CHECK_THAT(msg, Contains("is longer than the limit of 256 bytes"));
    CHECK_THAT(msg, Contains("(300000 bytes)"));
    CHECK(msg.size() < 400);
  }
  SECTION("a plain key in a mapping nnstrain reads") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + "optimizer:\n  " + big.substr(0, 1000) + ": 1\n");
    CHECK_THAT(msg, Contains("is longer than the limit of 256 bytes"));
    CHECK(msg.size() < 400);
  }
  SECTION("a value") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + "run_dir: " + big + "\n");
    CHECK_THAT(msg, Contains("run_dir"));
    CHECK_THAT(msg, Contains("longer than the limit of 16384 bytes"));
    CHECK(msg.size() < 400);
  }
  SECTION("a file over the size limit") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + "# " + std::string(2 << 20, 'x') + "\n");
    CHECK_THAT(msg, Contains("over the limit of 1048576 bytes"));
  }
  SECTION("nesting") {
    const auto [msg, secs] = load(s, std::string(kMinimal) + "vars: " + std::string(100, '[') + std::string(100, ']') + "\n");
    CHECK_THAT(msg, Contains("nested deeper than the limit of 64"));
  }
}

TEST_CASE("yaml: messages quote a short prefix of long offending text", "[untrusted][config]") {
  Scratch s;
  const std::string long_key(200, 'q');  // under the key limit, far over a readable quote
  const auto [msg, secs] = load(s, std::string(kMinimal) + "optimizer: {" + long_key + ": 1}\n");
  CHECK_THAT(msg, Contains("unknown key 'qqqq"));
  CHECK_THAT(msg, Contains("...' (200 bytes)"));
  CHECK(msg.find(long_key) == std::string::npos);

  std::string many;
  for (int i = 0; i < 100; ++i) many += "stray" + std::to_string(i) + ": 1\n";
  const auto [msg2, secs2] = load(s, std::string(kMinimal) + many);
  CHECK_THAT(msg2, Contains("and 80 more unknown keys"));
}

TEST_CASE("quote_prefix: short, printable, whole UTF-8 characters", "[untrusted]") {
  CHECK(util::quote_prefix("abc") == "'abc'");
  CHECK(util::quote_prefix("a\nb") == "'a?b'");
  CHECK(util::quote_prefix(std::string(100, 'x'), 4) == "'xxxx...' (100 bytes)");
  CHECK(util::quote_prefix("\xc3\xa9\xc3\xa9", 3) == "'\xc3\xa9...' (4 bytes)");  // not half an é
}

TEST_CASE("json: nesting and size bounds", "[untrusted][checkpoint]") {
  CHECK_THROWS_WITH(checkpoint::parse_json_bounded(std::string(100, '[') + std::string(100, ']'), "x.json"),
                    Contains("x.json: JSON nests deeper than 64 levels"));
  CHECK(checkpoint::parse_json_bounded(std::string(10, '[') + std::string(10, ']'), "x.json").is_array());
  CHECK_THROWS_WITH(checkpoint::parse_json_bounded("{\"a\": tru}", "x.json"), Contains("x.json: not valid JSON"));
}

TEST_CASE("manifest: shard names must be plain names, refused before any file is opened", "[untrusted][checkpoint]") {
  auto manifest = [](const std::string& file) {
    nlohmann::json spec = {{"name", "model/w"}, {"dtype", "F32"}, {"global_shape", {2}}, {"offsets", {0}},
                           {"shape", {2}}, {"replica_ranks", {0}}};
    return nlohmann::json{{"format", "nnstrain-checkpoint"}, {"version", 1}, {"files", {{file, {spec}}}},
                          {"state", nlohmann::json::object()}, {"rank_states", nlohmann::json::object()}}
        .dump();
  };
  CHECK(checkpoint::parse_manifest(manifest("rank-00000.safetensors"), "m.json").files.size() == 1);
  for (const std::string bad : {"/etc/passwd", "../../etc/passwd", "..", ".", "", "sub/rank-00000.safetensors"}) {
    INFO(bad);
    CHECK_THROWS_WITH(checkpoint::parse_manifest(manifest(bad), "m.json"),
                      Contains("m.json: shard file") && Contains("only plain file names inside the folder"));
  }
  CHECK_THROWS_WITH(checkpoint::parse_manifest(manifest(std::string("a\0b", 3)), "m.json"), Contains("NUL"));
}

TEST_CASE("manifest: a ShardSpec with a huge or negative shape is refused, not overflowed", "[untrusted][checkpoint]") {
  nlohmann::json spec = {{"name", "w"}, {"dtype", "F32"}, {"global_shape", {int64_t{1} << 40, int64_t{1} << 40}},
                         {"offsets", {0, 0}}, {"shape", {1, 1}}};
  CHECK_THROWS_WITH(spec.get<sharding::ShardSpec>(), Contains("negative or too large"));
  spec["global_shape"] = {4, -1};
  CHECK_THROWS_WITH(spec.get<sharding::ShardSpec>(), Contains("negative or too large"));
  spec["global_shape"] = {4.7e96, 1};  // fuzz_manifest's first find: a float cast to int64 (UB)
  CHECK_THROWS_WITH(spec.get<sharding::ShardSpec>(), Contains("not an integer"));
  spec["global_shape"] = {INT64_MAX, 1};
  spec["offsets"] = {INT64_MAX, 0};
  spec["shape"] = {1, 1};  // offsets + shape would overflow
  CHECK_THROWS(spec.get<sharding::ShardSpec>());
}

TEST_CASE("confined_path: a symbolic link may not leave the folder", "[untrusted][checkpoint]") {
  Scratch s;
  fs::create_directories(s.dir / "ckpt");
  s.write("outside.bin", "decoy");
  std::ofstream(s.dir / "ckpt" / "inside.bin") << "x";
  fs::create_symlink(s.dir / "outside.bin", s.dir / "ckpt" / "escape.bin");
  fs::create_symlink("inside.bin", s.dir / "ckpt" / "alias.bin");
  fs::create_symlink(s.dir / "missing", s.dir / "ckpt" / "dangling.bin");
  const auto dir = (s.dir / "ckpt").string();
  CHECK(checkpoint::confined_path(dir, "inside.bin", "f") == dir + "/inside.bin");
  CHECK(checkpoint::confined_path(dir, "alias.bin", "f") == dir + "/alias.bin");
  CHECK_THROWS_WITH(checkpoint::confined_path(dir, "escape.bin", "f"), Contains("is a symbolic link to") && Contains("outside"));
  CHECK_THROWS_WITH(checkpoint::confined_path(dir, "dangling.bin", "f"), Contains("does not resolve"));
  CHECK_THROWS_WITH(checkpoint::confined_path(dir, "../outside.bin", "f"), Contains("contains '/'"));
}
