// The configuration layer: TrainerArgs YAML -> typed structs, overrides, vars,
// and the error messages (key path + line) a user sees for a bad file.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "data/indexed/config_check.h"
#include "trainer/pipeline/config_check.h"

namespace fs = std::filesystem;
using namespace nnstrain::config;

namespace {

// A scratch folder removed at the end of the test.
struct TempDir {
  fs::path dir;
  TempDir() {
    static std::atomic<int> counter{0};
    dir = fs::temp_directory_path() /
          ("nnstrain_test_config_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = dir / name;
    std::ofstream(p) << text;
    return p.string();
  }
  // A token file of `tokens` uint16 tokens.
  std::string data(const std::string& name, size_t tokens = 100) const {
    const fs::path p = dir / name;
    std::ofstream out(p, std::ios::binary);
    for (size_t i = 0; i < tokens; ++i) {
      const uint16_t t = static_cast<uint16_t>(i % 65);
      out.write(reinterpret_cast<const char*>(&t), sizeof t);
    }
    return p.string();
  }
};

// Stands in for a real model's config and parser.
struct FakeModelConfig : ModelConfig {
  int64_t n_layer = 0, n_head = 0, n_embd = 0;
  double dropout = 0;
  bool bias = true;
};

ModelCatalog fake_catalog() {
  ModelCatalog c;
  c.names = {"gpt", "llama"};
  c.parse = [](const std::string& type, ArgMap& a) {
    auto cfg = std::make_shared<FakeModelConfig>();
    cfg->n_layer = a.get_int("n_layer", 2, 1);
    cfg->n_head = a.get_int("n_head", 2, 1);
    cfg->n_embd = a.get_int("n_embd", 32, 1);
    if (cfg->n_embd % cfg->n_head != 0)
      a.fail("n_embd", std::to_string(cfg->n_embd) + " is not a multiple of n_head");
    cfg->dropout = a.get_float("dropout", 0.0, 0.0, 1.0);
    cfg->bias = a.get_bool("bias", type == "gpt");
    return cfg;
  };
  return c;
}

LoadOptions options() {
  LoadOptions o;
  o.models = fake_catalog();
  o.checks = {nnstrain::parallel::pipeline::check_config_schedule, nnstrain::indexed::check_config_datasets};
  return o;
}

const FakeModelConfig& model_config(const TrainerArgs& t) {
  REQUIRE(t.model.args);
  return dynamic_cast<const FakeModelConfig&>(*t.model.args);
}

// The smallest valid file; the bad-input cases below edit one line of it, so the
// line numbers they assert are the ones shown here.
std::string minimal(const std::string& train_path) {
  return "model:\n"                      // 1
         "  type: gpt\n"                 // 2
         "  args:\n"                     // 3
         "    n_layer: 2\n"              // 4
         "    n_head: 2\n"               // 5
         "    n_embd: 32\n"              // 6
         "dataset:\n"                    // 7
         "  train_args:\n"               // 8
         "    path: " + train_path + "\n"  // 9
         "    seq_len: 8\n"              // 10
         "micro_batch_size: 4\n"         // 11
         "max_train_steps: 10\n";        // 12
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

// The message of the ConfigError that loading `text` throws ("" if none).
std::string load_error(const TempDir& tmp, const std::string& text, LoadOptions opts = options()) {
  const std::string file = tmp.write("bad.yaml", text);
  try {
    load_trainer_args(file, opts);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string source_config(const std::string& name) {
  return std::string(NNSTRAIN_SOURCE_DIR) + "/tests/base/configs/" + name;
}

}  // namespace

// ---- good input -------------------------------------------------------------

TEST_CASE("config: a complete file loads with its values and defaults", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.overrides = {{"dataset.train_args.path", tmp.data("train.bin")},
                    {"dataset.val_args.path", tmp.data("val.bin")}};
  const TrainerArgs t = load_trainer_args(source_config("good.yaml"), opts);

  CHECK(t.config_file == source_config("good.yaml"));
  CHECK(t.run_dir == "runs/shakespeare_char");
  CHECK(t.compute_config.plan_ngpus == 1);
  CHECK(t.compute_config.runtime_ngpus == 1);  // from world_size
  CHECK(t.compute_config.device == "cpu");
  CHECK(t.compute_config.collective_timeout_s == 600.0);  // default
  CHECK(t.pas_policy == "dp");
  CHECK(t.model.type == "gpt");
  CHECK(model_config(t).n_layer == 6);
  CHECK(model_config(t).n_embd == 384);
  CHECK(model_config(t).dropout == Approx(0.2));
  CHECK(model_config(t).bias);  // the parser's default
  CHECK(t.optimizer.lr == 1e-3);
  CHECK(t.optimizer.beta1 == 0.9);
  CHECK(t.optimizer.beta2 == 0.99);
  CHECK(t.optimizer.weight_decay == 0.1);
  CHECK(t.optimizer.clip_gnorm == 1.0);
  CHECK(t.lr_scheduler.type == "cosine");
  CHECK(t.lr_scheduler.warmup_steps == 100);
  CHECK(t.lr_scheduler.min_lr == 1e-4);
  CHECK(t.dataset.train_args.path == (tmp.dir / "train.bin").string());
  CHECK(t.dataset.train_args.seq_len == 64);
  REQUIRE(t.dataset.val_args);
  CHECK(t.dataset.val_args->seq_len == 64);  // defaults to train's
  CHECK(t.dataset.val_args->dtype == "uint16");
  CHECK(t.checkpoint.save_dir == "runs/shakespeare_char/ckpt");
  CHECK(t.checkpoint.every_n_train_steps == 500);
  CHECK(t.checkpoint.save_on_end);
  CHECK(t.precision == "32-true");  // fp32, stored canonically
  CHECK(t.micro_batch_size == 12);
  CHECK(t.global_batch_size == 12);
  CHECK(t.max_train_steps == 2000);
  CHECK(t.val_every_n_train_steps == 250);
  CHECK(t.seed == 1337);
  REQUIRE(t.log.size() == 2);
  CHECK(t.log[0].type == "console");
  CHECK(t.log[1].type == "jsonl");
  CHECK(t.log[1].path == "runs/shakespeare_char/metrics.jsonl");
}

TEST_CASE("config: defaults of a minimal file", "[config]") {
  TempDir tmp;
  const TrainerArgs t = load_trainer_args(tmp.write("tiny.yaml", minimal(tmp.data("t.bin"))), options());
  CHECK(t.run_dir == "runs/tiny");  // runs/<config file stem>
  CHECK(t.pas_policy == "autodist");
  CHECK(t.optimizer.type == "adamw");
  CHECK(t.optimizer.beta2 == 0.999);
  CHECK(t.grad_accumulation_steps == 1);
  CHECK(t.global_batch_size == 4);  // micro 4 x dp 1 x accumulation 1
  CHECK_FALSE(t.dataset.val_args);
  REQUIRE(t.log.size() == 3);  // console, jsonl, tensorboard
  CHECK(t.log[1].path == (fs::path("runs/tiny") / "metrics.jsonl").string());
  CHECK(t.log[2].type == "tensorboard");
  CHECK(t.log[2].path == (fs::path("runs/tiny") / "tensorboard").string());
  CHECK_FALSE(t.profile.enabled());
  CHECK_FALSE(t.memory_snapshot);
}

TEST_CASE("config: profile window and its checks", "[config]") {
  TempDir tmp;
  const std::string file = tmp.write("tiny.yaml", minimal(tmp.data("t.bin")) + "profile: {steps: [3, 5]}\n");
  const TrainerArgs t = load_trainer_args(file, options());
  CHECK(t.profile.from == 3);
  CHECK(t.profile.to == 5);
  CHECK(t.profile.dir == (fs::path("runs/tiny") / "profile").string());
  LoadOptions bad = options();
  bad.overrides = {{"profile.steps", "[5, 3]"}};
  CHECK_THROWS_WITH(load_trainer_args(file, bad), Catch::Contains("profile.steps"));
  bad.overrides = {{"profile.steps", "[2.5, 3]"}};
  CHECK_THROWS_WITH(load_trainer_args(file, bad), Catch::Contains("whole step numbers"));
  bad.overrides = {{"profile.stesp", "[1, 2]"}};
  CHECK_THROWS_WITH(load_trainer_args(file, bad), Catch::Contains("profile.stesp"));
}

TEST_CASE("config: the launch size fills runtime_ngpus and the batch derives accumulation", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.world_size = 4;
  opts.reject_unimplemented = false;
  const std::string text = minimal(tmp.data("t.bin")) + "global_batch_size: 32\n";
  const TrainerArgs t = load_trainer_args(tmp.write("dp.yaml", text), opts);
  CHECK(t.compute_config.runtime_ngpus == 4);
  CHECK(t.grad_accumulation_steps == 2);  // 32 / (micro 4 x dp 4)
  CHECK(t.global_batch_size == 32);
}

TEST_CASE("config: overrides in both forms, parsed as YAML, creating maps", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.overrides = parse_overrides({"--optimizer.args.lr", "3e-4", "--micro_batch_size=8",
                                    "--optimizer.args.betas", "[0.9,0.95]", "--checkpoint.save_dir=out/ck",
                                    "--model.args.n_layer", "3", "--checkpoint.resume_from="});
  REQUIRE(opts.overrides.size() == 6);
  CHECK(opts.overrides[1] == std::make_pair(std::string("micro_batch_size"), std::string("8")));
  const TrainerArgs t = load_trainer_args(tmp.write("o.yaml", minimal(tmp.data("t.bin"))), opts);
  CHECK(t.optimizer.lr == 3e-4);
  CHECK(t.micro_batch_size == 8);
  CHECK(t.optimizer.beta2 == 0.95);
  CHECK(t.checkpoint.save_dir == "out/ck");  // checkpoint: was not in the file
  CHECK(t.checkpoint.resume_from == "");
  CHECK(model_config(t).n_layer == 3);
}

TEST_CASE("config: parse_overrides rejects a key without a value and stray tokens", "[config]") {
  CHECK_THROWS_WITH(parse_overrides({"--optimizer.args.lr"}), Catch::Contains("optimizer.args.lr") &&
                                                                  Catch::Contains("has no value"));
  CHECK_THROWS_WITH(parse_overrides({"--seed", "--max_train_steps=3"}), Catch::Contains("--seed has no value"));
  CHECK_THROWS_WITH(parse_overrides({"seed", "3"}), Catch::Contains("unexpected argument 'seed'"));
}

TEST_CASE("config: an override of an unknown key is reported as from the command line", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.overrides = {{"optimizer.args.lrr", "0.1"}};
  const std::string msg = load_error(tmp, minimal(tmp.data("t.bin")), opts);
  CHECK_THAT(msg, Catch::Contains("optimizer.args.lrr (command line): unknown key 'lrr'") &&
                      Catch::Contains("did you mean 'lr'?"));

  opts.overrides = {{"micro_batch_size", "many"}};
  CHECK_THAT(load_error(tmp, minimal(tmp.data("t.bin")), opts),
             Catch::Contains("micro_batch_size (command line): expected an integer, got 'many'"));
}

TEST_CASE("config: vars substitute typed and interpolated, and can be overridden", "[config]") {
  TempDir tmp;
  const std::string text = "vars:\n"
                           "  block: 16\n"
                           "  name: tiny\n"
                           "  tag: $(vars.name)-$(vars.block)\n"  // vars may use vars
                           "  betas: [0.8, 0.9]\n"
                           "run_dir: runs/$(vars.tag)\n" +
                           replace(minimal(tmp.data("t.bin")), "seq_len: 8", "seq_len: $(vars.block)") +
                           "optimizer: {args: {betas: $(vars.betas)}}\n";
  const std::string file = tmp.write("v.yaml", text);
  TrainerArgs t = load_trainer_args(file, options());
  CHECK(t.dataset.train_args.seq_len == 16);  // a whole reference is read as an integer
  CHECK(t.run_dir == "runs/tiny-16");         // inside a string it interpolates
  CHECK(t.optimizer.beta1 == 0.8);            // a list variable as a whole value

  LoadOptions opts = options();
  opts.overrides = {{"vars.block", "32"}};
  t = load_trainer_args(file, opts);
  CHECK(t.dataset.train_args.seq_len == 32);
  CHECK(t.run_dir == "runs/tiny-32");
}

TEST_CASE("config: an unknown variable names the key that uses it", "[config]") {
  TempDir tmp;
  const std::string text = "vars: {block: 16}\n" +  // line 1, so minimal's lines move down by one
                           replace(minimal(tmp.data("t.bin")), "seq_len: 8", "seq_len: $(vars.blok)");
  const std::string msg = load_error(tmp, text);
  CHECK_THAT(msg, Catch::Contains("dataset.train_args.seq_len (line 11)") &&
                      Catch::Contains("unknown variable $(vars.blok)") && Catch::Contains("did you mean 'block'?"));
}

TEST_CASE("config: precision accepts nnScaler's spellings and stores the canonical one", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.reject_unimplemented = false;
  const std::string base = minimal(tmp.data("t.bin"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"fp32", "32-true"}, {"fp16", "16-true"}, {"bf16", "bf16-true"}, {"bf16-mixed", "bf16-mixed"}};
  for (const auto& [given, canonical] : cases) {
    opts.overrides = {{"precision", given}};
    const TrainerArgs t = load_trainer_args(tmp.write("p.yaml", base), opts);
    CHECK(t.precision == canonical);
    CHECK_THAT(t.resolved_yaml, Catch::Contains("precision: " + canonical));
  }
}

TEST_CASE("config: resolved_yaml holds every key and loads back to the same result", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.overrides = {{"dataset.train_args.path", tmp.data("train.bin")},
                    {"dataset.val_args.path", tmp.data("val.bin")},
                    {"optimizer.args.lr", "3e-4"}};
  const TrainerArgs a = load_trainer_args(source_config("good.yaml"), opts);
  // Defaults, model args (the parser's defaults too), substituted vars.
  CHECK_THAT(a.resolved_yaml, Catch::Contains("collective_timeout_s: 600.0") &&
                                  Catch::Contains("bias: true") && Catch::Contains("seq_len: 64") &&
                                  Catch::Contains("lr: 0.0003") && Catch::Contains("runtime_ngpus: 1") &&
                                  Catch::Contains("save_dir: runs/shakespeare_char/ckpt") &&
                                  !Catch::Contains("$("));

  const std::string file = tmp.write("resolved.yaml", a.resolved_yaml);
  const TrainerArgs b = load_trainer_args(file, options());
  CHECK(b.resolved_yaml == a.resolved_yaml);
  CHECK(b.run_dir == a.run_dir);
  CHECK(b.optimizer.lr == a.optimizer.lr);
  CHECK(b.optimizer.beta2 == a.optimizer.beta2);
  CHECK(b.lr_scheduler.min_lr == a.lr_scheduler.min_lr);
  CHECK(b.dataset.train_args.path == a.dataset.train_args.path);
  CHECK(b.dataset.val_args->seq_len == a.dataset.val_args->seq_len);
  CHECK(b.checkpoint.keep_last_n_checkpoints == a.checkpoint.keep_last_n_checkpoints);
  CHECK(b.precision == a.precision);
  CHECK(b.global_batch_size == a.global_batch_size);
  CHECK(b.seed == a.seed);
  CHECK(b.log.size() == a.log.size());
  CHECK(b.log[1].path == a.log[1].path);
  CHECK(model_config(b).n_embd == model_config(a).n_embd);
  CHECK(model_config(b).dropout == model_config(a).dropout);
}

// ---- bad input: each message names the key path and its line ----------------

TEST_CASE("config: unknown keys at any level, with did-you-mean", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.check_files = false;
  const std::string file = source_config("typo.yaml");
  std::string msg;
  try {
    load_trainer_args(file, opts);
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Catch::Contains(file + ": optimzer (line 4): unknown key 'optimzer' (did you mean 'optimizer'?)"));
  CHECK_THAT(msg, Catch::Contains("dataset.train_arg (line 8): unknown key 'train_arg' (did you mean 'train_args'?)"));

  // Nothing close: the known keys are listed instead.
  msg = load_error(tmp, minimal(tmp.data("t.bin")) + "zzz: 1\n");
  CHECK_THAT(msg, Catch::Contains("zzz (line 13): unknown key 'zzz'; known keys here: ") &&
                      Catch::Contains("micro_batch_size"));
}

TEST_CASE("config: unknown model arg is reported with its path", "[config]") {
  TempDir tmp;
  const std::string msg = load_error(tmp, replace(minimal(tmp.data("t.bin")), "n_head: 2", "n_heads: 2"));
  CHECK_THAT(msg, Catch::Contains("model.args.n_heads (line 5): unknown key 'n_heads' (did you mean 'n_head'?)"));
}

TEST_CASE("config: a model parser's own check names the model arg", "[config]") {
  TempDir tmp;
  const std::string msg = load_error(tmp, replace(minimal(tmp.data("t.bin")), "n_embd: 32", "n_embd: 33"));
  CHECK_THAT(msg, Catch::Contains("model.args.n_embd (line 6): 33 is not a multiple of n_head"));
}

TEST_CASE("config: wrong type", "[config]") {
  TempDir tmp;
  const std::string file = (tmp.dir / "bad.yaml").string();
  CHECK(load_error(tmp, replace(minimal(tmp.data("t.bin")), "n_head: 2", "n_head: four")) ==
        file + ": model.args.n_head (line 5): expected an integer, got 'four'");
  CHECK_THAT(load_error(tmp, minimal(tmp.data("t.bin")) + "optimizer: {args: {betas: 0.9}}\n"),
             Catch::Contains("optimizer.args.betas (line 13): expected a list of numbers"));
  CHECK_THAT(load_error(tmp, minimal(tmp.data("t.bin")) + "dataloader: {pin_memory: maybe}\n"),
             Catch::Contains("dataloader.pin_memory (line 13): expected true or false, got 'maybe'"));
  CHECK_THAT(load_error(tmp, minimal(tmp.data("t.bin")) + "compute_config: 4\n"),
             Catch::Contains("compute_config (line 13): expected a mapping"));
}

TEST_CASE("config: missing required keys", "[config]") {
  TempDir tmp;
  const std::string base = minimal(tmp.data("t.bin"));
  CHECK_THAT(load_error(tmp, replace(base, "    seq_len: 8\n", "")),
             Catch::Contains("dataset.train_args.seq_len (not set; dataset.train_args is at line 8): "
                             "required key is missing"));
  CHECK_THAT(load_error(tmp, replace(base, "  type: gpt\n", "")),
             Catch::Contains("model.type (not set; model is at line 1): required key is missing"));
  CHECK_THAT(load_error(tmp, replace(base, "max_train_steps: 10\n", "max_train_steps: 0\n")),
             Catch::Contains("max_train_steps (line 12): one of max_train_steps or max_epochs must be > 0"));
}

TEST_CASE("config: out-of-range values", "[config]") {
  TempDir tmp;
  LoadOptions multi = options();
  multi.reject_unimplemented = false;
  const std::string base = minimal(tmp.data("t.bin"));
  CHECK_THAT(load_error(tmp, base + "optimizer: {args: {lr: 0}}\n"),
             Catch::Contains("optimizer.args.lr (line 13): must be > 0, got 0.0"));
  CHECK_THAT(load_error(tmp, base + "optimizer:\n  args:\n    betas: [0.9, 1.0]\n"),
             Catch::Contains("optimizer.args.betas (line 15): each beta must be in [0, 1), got 1.0"));
  CHECK_THAT(load_error(tmp, replace(base, "micro_batch_size: 4", "micro_batch_size: 0")),
             Catch::Contains("micro_batch_size (line 11): must be >= 1, got 0"));
  CHECK_THAT(load_error(tmp, replace(base, "seq_len: 8", "seq_len: -1")),
             Catch::Contains("dataset.train_args.seq_len (line 10): must be >= 1, got -1"));
  CHECK_THAT(load_error(tmp, base + "pas_policy: hybrid\ncompute_config: {plan_ngpus: 2, runtime_ngpus: 3}\n", multi),
             Catch::Contains("compute_config.runtime_ngpus (line 14): 3 is not a multiple of plan_ngpus 2"));
  // autodist: plan_ngpus only bounds tp; without a global batch nnScaler's reading needs the multiple.
  CHECK(load_error(tmp, base + "global_batch_size: 12\ncompute_config: {plan_ngpus: 2, runtime_ngpus: 3}\n",
                   multi).empty());
  CHECK_THAT(load_error(tmp, base + "compute_config: {plan_ngpus: 2, runtime_ngpus: 3}\n", multi),
             Catch::Contains("global_batch_size (not set): is not given, and runtime_ngpus 3 is not a multiple of "
                             "compute_config.plan_ngpus 2"));
  CHECK_THAT(load_error(tmp, base + "compute_config: {runtime_ngpus: 6, zero_ngroups: 4}\n", multi),
             Catch::Contains("compute_config.zero_ngroups (line 13): 4 does not divide the data-parallel size 6"));
  CHECK_THAT(load_error(tmp, base + "pas_policy: dp\ncompute_config: {plan_ngpus: 2, runtime_ngpus: 2}\n", multi),
             Catch::Contains("pas_policy (line 13): dp keeps a whole model on every rank, but "
                             "compute_config.plan_ngpus 2 asks to split one over 2 ranks"));
  CHECK_THAT(load_error(tmp, base + "precision: fp64\n"),
             Catch::Contains("precision (line 13): 'fp64' is not one of: 32-true, 16-true, bf16-true, 16-mixed, "
                             "bf16-mixed, fp32, fp16, bf16"));
  CHECK_THAT(load_error(tmp, base + "pas_policy: dpp\n"),
             Catch::Contains("pas_policy (line 13): 'dpp' is not one of: dp, tp, hybrid, autodist (did you mean 'dp'?)"));
}

TEST_CASE("config: runtime_ngpus that disagrees with the launch names both", "[config]") {
  TempDir tmp;
  LoadOptions opts = options();
  opts.world_size = 4;
  opts.reject_unimplemented = false;
  CHECK_THAT(load_error(tmp, minimal(tmp.data("t.bin")) + "compute_config:\n  runtime_ngpus: 2\n", opts),
             Catch::Contains("compute_config.runtime_ngpus (line 14): is 2 but the job was launched with 4"));
}

TEST_CASE("config: global batch size inconsistent with micro x dp x accumulation", "[config]") {
  TempDir tmp;
  const std::string base = minimal(tmp.data("t.bin"));
  CHECK_THAT(load_error(tmp, base + "pas_policy: hybrid\ngrad_accumulation_steps: 2\nglobal_batch_size: 10\n"),
             Catch::Contains("global_batch_size (line 15): 10 != micro_batch_size 4 x dp 1 (runtime_ngpus 1 / "
                             "plan_ngpus 1) x grad_accumulation_steps 2 = 8"));
  // Under autodist dp is the plan's: only what no dp can mend is refused at load.
  CHECK_THAT(load_error(tmp, base + "grad_accumulation_steps: 2\nglobal_batch_size: 10\n"),
             Catch::Contains("global_batch_size (line 14): 10 is not a multiple of micro_batch_size 4 x "
                             "grad_accumulation_steps 2 = 8 (global = micro x dp x accumulation, dp the plan's"));
  // Without an explicit accumulation it is derived, so only divisibility can fail.
  CHECK_THAT(load_error(tmp, base + "global_batch_size: 10\n"),
             Catch::Contains("global_batch_size (line 13): 10 is not a multiple of micro_batch_size 4"));
}

TEST_CASE("config: data file missing", "[config]") {
  TempDir tmp;
  const std::string missing = (tmp.dir / "nope.bin").string();
  CHECK_THAT(load_error(tmp, minimal(missing)),
             Catch::Contains("dataset.train_args.path (line 9): data file not found: " + missing));
  CHECK_THAT(load_error(tmp, minimal(tmp.data("short.bin", 5))),
             Catch::Contains("dataset.train_args.path (line 9)") && Catch::Contains("holds 5 tokens; seq_len 8"));
  LoadOptions no_check = options();
  no_check.check_files = false;
  CHECK(load_error(tmp, minimal(missing), no_check).empty());
}

TEST_CASE("config: unknown model type lists the registered ones", "[config]") {
  TempDir tmp;
  CHECK_THAT(load_error(tmp, replace(minimal(tmp.data("t.bin")), "type: gpt", "type: gtp")),
             Catch::Contains("model.type (line 2): unknown model type 'gtp' (did you mean 'gpt'?); "
                             "registered: gpt, llama"));
}

TEST_CASE("config: duplicate keys and YAML syntax errors carry lines", "[config]") {
  TempDir tmp;
  const std::string base = minimal(tmp.data("t.bin"));
  CHECK_THAT(load_error(tmp, base + "micro_batch_size: 8\n"),
             Catch::Contains("micro_batch_size (line 11): duplicate key (also at line 13)"));
  CHECK_THAT(load_error(tmp, base + "optimizer: {args: [1, 2}\n"),
             Catch::Contains("(line 13): YAML syntax error"));
}

TEST_CASE("config: precision, reduce_dtype and loss_scaler", "[config]") {
  TempDir tmp;
  const std::string base = minimal(tmp.data("t.bin"));
  for (const char* p : {"32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed", "fp32", "bf16", "fp16"})
    CHECK(load_error(tmp, base + "precision: " + p + "\n").empty());
  CHECK_THAT(load_error(tmp, base + "precision: bf16-mixed\ncompute_config: {reduce_dtype: fp16}\n"),
             Catch::Contains("compute_config.reduce_dtype (line 14): reduce_dtype fp16 does not fit precision bf16-mixed"));
  CHECK(load_error(tmp, base + "precision: bf16-mixed\ncompute_config: {reduce_dtype: bf16}\n").empty());
  CHECK_THAT(load_error(tmp, base + "compute_config: {reduce_dtype: bf16}\n"),
             Catch::Contains("reduce_dtype bf16 does not fit precision 32-true"));
  CHECK_THAT(load_error(tmp, base + "precision: bf16-mixed\nloss_scaler: {init_scale: 1024}\n"),
             Catch::Contains("loss_scaler (line 14): a loss scaler is used by the fp16 precisions"));
  CHECK(load_error(tmp, base + "precision: 16-mixed\nloss_scaler: {init_scale: 1024, growth_interval: 10}\n").empty());
  CHECK_THAT(load_error(tmp, base + "precision: 16-mixed\nloss_scaler: {backoff_factor: 1.5}\n"),
             Catch::Contains("loss_scaler.backoff_factor"));
}

TEST_CASE("config: keys that contradict each other", "[config]") {
  TempDir tmp;
  const std::string base = minimal(tmp.data("t.bin"));
  CHECK_THAT(load_error(tmp, base + "val_every_n_train_steps: 5\n"),
             Catch::Contains("val_every_n_train_steps (line 13): validation needs dataset.val_args"));
  CHECK_THAT(load_error(tmp, base + "optimizer: {args: {lr: 0.001}}\nlr_scheduler: {type: cosine, args: {min_lr: 0.01}}\n"),
             Catch::Contains("lr_scheduler.args.min_lr (line 14): 0.01 is above optimizer.args.lr 0.001"));
  // The default type, constant, never decays: a floor or decay length would do nothing.
  CHECK_THAT(load_error(tmp, base + "lr_scheduler: {args: {min_lr: 0.0001}}\n"),
             Catch::Contains("lr_scheduler.args.min_lr (line 13): 0.0001 does nothing under lr_scheduler.type constant"));
  CHECK_THAT(load_error(tmp, base + "checkpoint:\n  every_n_train_steps: 5\n"),
             Catch::Contains("checkpoint.every_n_train_steps (line 14): periodic checkpoints need checkpoint.save_dir"));
  CHECK_THAT(load_error(tmp, base + "compute_config: {backend: nccl, device: cpu}\n"),
             Catch::Contains("compute_config.backend (line 13): nccl needs CUDA devices"));
}

TEST_CASE("config: ArgMap::where and has, as a model parser sees them", "[config]") {
  TempDir tmp;
  std::vector<std::string> seen;
  LoadOptions opts = options();
  opts.models.parse = [&](const std::string&, ArgMap& a) {
    seen = {a.where("n_head"), a.where("dropout"), a.has("n_layer") ? "has" : "-", a.has("bias") ? "has" : "-"};
    a.get_int("n_layer");
    a.get_int("n_head");
    a.get_int("n_embd");
    a.get_float("dropout", 0.0, 0.0, 1.0);
    return std::make_shared<FakeModelConfig>();
  };
  load_trainer_args(tmp.write("w.yaml", minimal(tmp.data("t.bin"))), opts);
  REQUIRE(seen.size() == 4);
  CHECK(seen[0] == "model.args.n_head (line 5)");
  CHECK(seen[1] == "model.args.dropout (not set; model.args is at line 3)");
  CHECK(seen[2] == "has");
  CHECK(seen[3] == "-");

  CHECK_THAT(load_error(tmp, replace(minimal(tmp.data("t.bin")), "n_embd: 32", "n_embd: 32\n    dropout: 1.5"), opts),
             Catch::Contains("model.args.dropout (line 7): must be between 0.0 and 1.0, got 1.5"));
}

TEST_CASE("config: context parallelism's keys, and the combinations it cannot split", "[config]") {
  TempDir tmp;
  LoadOptions multi = options();
  multi.world_size = 4;
  multi.reject_unimplemented = false;
  const std::string base = minimal(tmp.data("t.bin"));
  // cp 2 of 4 ranks: dp 2, so a global batch of 16 is 2 accumulation steps of micro 4.
  const TrainerArgs t = load_trainer_args(
      tmp.write("cp.yaml", base + "global_batch_size: 16\ncompute_config: {context_parallel_size: 2, cp_comm_type: "
                                  "all_gather, cp_load_balance: none}\n"),
      multi);
  CHECK(t.compute_config.context_parallel_size == 2);
  CHECK(t.compute_config.cp_comm_type == "all_gather");
  CHECK(t.compute_config.cp_load_balance == "none");
  CHECK(t.grad_accumulation_steps == 2);
  const TrainerArgs d = load_trainer_args(tmp.write("cp1.yaml", base), multi);
  CHECK(d.compute_config.context_parallel_size == 1);
  CHECK(d.compute_config.cp_comm_type == "p2p");
  CHECK(d.compute_config.cp_load_balance == "zigzag");

  LoadOptions six = options();  // runtime_ngpus given: a one-process load (plan) takes it as is
  six.reject_unimplemented = false;
  CHECK_THAT(load_error(tmp, base + "compute_config: {runtime_ngpus: 6, context_parallel_size: 3}\n", six),
             Catch::Contains("dataset.train_args.seq_len (line 10): 8 does not split over "
                             "compute_config.context_parallel_size 3 with compute_config.cp_load_balance zigzag: it "
                             "must be a multiple of 2 x context_parallel_size (6)"));
  CHECK(load_error(tmp, base + "compute_config: {context_parallel_size: 4, cp_load_balance: none}\n", multi).empty());
  CHECK_THAT(load_error(tmp, base + "pas_policy: hybrid\ncompute_config: {runtime_ngpus: 6, plan_ngpus: 2, "
                                    "context_parallel_size: 2}\n", six),
             Catch::Contains("compute_config.context_parallel_size (line 14): 2 x plan_ngpus 2 does not divide "
                             "runtime_ngpus 6"));
  // autodist: plan_ngpus bounds tp, so tp 1 x cp 2 x dp 3 is open to it.
  CHECK(load_error(tmp, base + "global_batch_size: 12\ncompute_config: {runtime_ngpus: 6, plan_ngpus: 2, "
                               "context_parallel_size: 2, cp_load_balance: none}\n", six).empty());
  CHECK_THAT(load_error(tmp, base + "compute_config: {cp_comm_type: ring}\n", multi),
             Catch::Contains("compute_config.cp_comm_type (line 13): 'ring' is not one of: p2p, all_gather"));
  // Training splits sequences now: cp > 1 loads, and what it does not support yet is refused naming the keys.
  LoadOptions run = multi;
  run.reject_unimplemented = true;
  CHECK(load_error(tmp, base + "compute_config: {context_parallel_size: 2}\n", run).empty());
  const auto graphs = load_error(tmp, base + "compute_config: {context_parallel_size: 2, cuda_graphs: true}\n", run);
  CHECK_THAT(graphs, Catch::Contains("compute_config.cuda_graphs") &&
                         Catch::Contains("not supported with compute_config.context_parallel_size 2 yet"));
}

TEST_CASE("config: the pipeline's batch and schedule are checked at load", "[config][pipeline]") {
  TempDir tmp;
  LoadOptions four = options();
  four.world_size = 4;
  // A fixed policy: dp is known at load (under autodist the planner checks these per candidate).
  const std::string base = minimal(tmp.data("t.bin")) + "pas_policy: hybrid\n";
  // pp 2 of 4 ranks: dp 2; a global batch of 32 is 4 micro-batches of 4 per step, one pipeline flush.
  const TrainerArgs t = load_trainer_args(
      tmp.write("pp.yaml", base + "global_batch_size: 32\ncompute_config: {pas_config: {pp_size: 2, "
                                  "pipeline_nmicros: 4, pipeline_scheduler: zbv}}\n"),
      four);
  CHECK(t.grad_accumulation_steps == 4);
  CHECK(t.compute_config.pipeline.nmicros == 4);
  // pipeline_nmicros alone sets the accumulation: global = micro x nmicros x dp.
  const TrainerArgs u = load_trainer_args(
      tmp.write("pp2.yaml", base + "compute_config: {pas_config: {pp_size: 2, pipeline_nmicros: 3}}\n"), four);
  CHECK(u.grad_accumulation_steps == 3);
  CHECK(u.global_batch_size == 24);
  CHECK_THAT(load_error(tmp, base + "global_batch_size: 32\ncompute_config: {pas_config: {pp_size: 2, "
                                    "pipeline_nmicros: 8}}\n", four),
             Catch::Contains("compute_config.pas_config.pipeline_nmicros (line 15): 8 micro-batches per pipeline "
                             "flush, but the step has 4 (grad_accumulation_steps; global_batch_size = micro_batch_size "
                             "x pipeline_nmicros x dp 2"));
  CHECK_THAT(load_error(tmp, base + "grad_accumulation_steps: 3\ncompute_config: {pas_config: {pp_size: 2, "
                                    "pipeline_scheduler: 1f1b_interleaved}}\n", four),
             Catch::Contains("compute_config.pas_config.pipeline_scheduler (line 15): ") &&
                 Catch::Contains("needs pipeline_nmicros a multiple of pp_size"));
  CHECK_THAT(load_error(tmp, base + "compute_config: {pas_config: {pp_size: 2, pipeline_nstages: 3}}\n", four),
             Catch::Contains("pipeline_scheduler 1f1b with pp_size 2, pipeline_nstages 3") &&
                 Catch::Contains("one stage per rank"));
  // ZeRO-2/3 compose with the pipeline (each stage shards over its dp group).
  CHECK(load_error(tmp, base + "compute_config: {use_zero: 2, pas_config: {pp_size: 2}}\n", four).empty());
  CHECK(load_error(tmp, base + "compute_config: {use_zero: 3, pas_config: {pp_size: 2}}\n", four).empty());
}

TEST_CASE("config: a module's check the config needs is never skipped", "[config][pipeline]") {
  // The schedule and manifest checks come from trainer/ and data/ through LoadOptions::checks
  // (base/ names neither). Left unset where a config needs one, loading is a programming
  // error, not a silent pass.
  TempDir tmp;
  LoadOptions bare = options();
  bare.checks = {};
  bare.world_size = 2;
  const std::string base = minimal(tmp.data("t.bin")) + "pas_policy: hybrid\n";
  const auto pp = tmp.write("pp.yaml", base + "compute_config: {pas_config: {pp_size: 2}}\n");
  CHECK_THROWS_WITH(load_trainer_args(pp, bare), Catch::Contains("checks.pipeline_schedule is not set"));
  const std::string indexed = "model: {type: gpt}\nmax_train_steps: 1\ndataset:\n  type: indexed\n"
                              "  train_args: {datasets: [{path: " + (tmp.dir / "none").string() + "}], seq_len: 8}\n";
  CHECK_THROWS_WITH(load_trainer_args(tmp.write("ix.yaml", indexed), bare),
                    Catch::Contains("checks.indexed_datasets is not set"));
  // Handed in, the same configs reach the checks (the manifest is missing here).
  LoadOptions full = options();
  full.world_size = 2;
  CHECK(load_trainer_args(pp, full).compute_config.pipeline.pp_size == 2);
  CHECK_THAT(load_error(tmp, indexed), Catch::Contains("dataset.train_args.datasets[0].path"));
  // A config that needs neither loads without them.
  bare.world_size = 1;
  CHECK(load_trainer_args(tmp.write("plain.yaml", minimal(tmp.data("t.bin"))), bare).max_train_steps == 10);
}
