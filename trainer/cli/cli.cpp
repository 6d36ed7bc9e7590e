#include "trainer/cli/cli.h"

#include <torch/torch.h>

#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <iostream>
#include <string>
#include <vector>

#include "data/indexed/config_check.h"
#include "data/prepare.h"
#include "data/tokenizer/tokenize_command.h"
#include "models/common/kernels/kernels.h"
#include "models/registry.h"
#include "trainer/optim/registry.h"
#include "base/config/arg_map.h"
#include "base/config/load.h"
#include "trainer/dist/dist_env.h"
#include "trainer/dist/env_command.h"
#include "trainer/dist/launcher.h"
#include "trainer/dist/process_groups.h"
#include "trainer/eval/eval_command.h"
#include "trainer/interop/generate_command.h"
#include "trainer/interop/merge_command.h"
#include "trainer/pipeline/config_check.h"
#include "trainer/cli/plan_command.h"
#include "trainer/cli/report.h"
#include "trainer/cli/version.h"
#include "trainer/train/trainer.h"

namespace nnstrain::cli {

namespace {

constexpr const char* kUsage = R"(nnstrain: config-driven distributed trainer for transformer language models

  nnstrain [train] --config FILE [--resume [CKPT]] [--print-config] [--debug] [--key.path value ...]
  nnstrain launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] -- ARGS
  nnstrain merge CKPT --out DIR [--hf] [--dtype fp32|bf16|fp16]
  nnstrain generate CKPT|DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] ...
  nnstrain eval CKPT|DIR --tasks FILE... [--limit N] [--batch-size B] [--json OUT]
  nnstrain plan --config FILE [--runtime-ngpus N] [--device NAME] [--memory-budget-gb X] [--explain] [--json]
  nnstrain prepare shakespeare_char [--input PATH] [--out DIR]
  nnstrain prepare text --input FILE --out DIR [--level char|byte]
  nnstrain prepare corpus --tokenizer PATH --input PATH [--input ...] --out PREFIX [--format jsonl|text|alpaca] ...
  nnstrain tokenize --tokenizer PATH [--info] [--input FILE] [--jsonl] [--threads N] ...
  nnstrain report RUN_DIR [--out PNG] [--no-plot]   summary of a run folder and a PNG of its loss curves
  nnstrain env                     print the rank/world this process would use
  nnstrain --version               version, git commit, LibTorch, CUDA/NCCL, CPU capability

Each command takes --help (nnstrain prepare corpus --help too).

--debug keeps LibTorch's C++ backtrace in errors raised while training.
Overrides follow nnScaler: --optimizer.args.lr 3e-4 or --optimizer.args.lr=3e-4.
)";


// glibc hands the top of its heap back to the kernel once 128 KiB or more is
// free there (and tensors of a few MiB get their own mappings), so every step
// re-faults and zeroes the pages of the activations it freed the step before:
// 5-6% of a small CPU run's time (perf: 292k page faults in 150 steps, 65k with
// this). Training keeps what it freed for the next step instead; the peak is
// unchanged, only its release is deferred. Other commands keep glibc's policy.
void keep_freed_host_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed; fixing it also stops the dynamic adjustment
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

int train_main(const std::vector<std::string>& argv) {
  std::string config_file, resume;
  bool print_config = false, debug = false;
  std::vector<std::string> rest;
  for (size_t i = 0; i < argv.size(); ++i) {
    const auto& a = argv[i];
    if (a == "--config" || a.rfind("--config=", 0) == 0) {
      if (a == "--config") {
        if (i + 1 >= argv.size()) { std::cerr << "nnstrain: --config needs a file\n"; return 2; }
        config_file = argv[++i];
      } else {
        config_file = a.substr(9);
      }
    } else if (a == "--resume") {
      resume = "last";
      if (i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0) resume = argv[++i];
    } else if (a.rfind("--resume=", 0) == 0) {
      resume = a.substr(9);
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--debug") {
      debug = true;
    } else if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else {
      rest.push_back(a);
    }
  }
  if (config_file.empty()) {
    std::cerr << "nnstrain: missing --config FILE\n\n" << kUsage;
    return 2;
  }
  dist::DistEnv env;
  try {
    env = dist::read_dist_env();
    config::LoadOptions lo;
    lo.overrides = config::parse_overrides(rest);
    lo.models = models::model_catalog();
    lo.optimizers = optim::optimizer_catalog();
    lo.checks = {parallel::pipeline::check_config_schedule, indexed::check_config_datasets};
    lo.world_size = env.world_size;
    lo.check_files = !print_config;
    const auto args = config::load_trainer_args(config_file, lo);
    if (print_config) {
      std::cout << args.resolved_yaml;
      return 0;
    }
    try {
      models::common::kernels::impl();  // NNSTRAIN_KERNELS checked before anything starts
    } catch (const std::invalid_argument& e) {
      std::cerr << "nnstrain: " << e.what() << "\n";
      return 2;
    }
    keep_freed_host_memory();
    return train::run(args, env, {resume});
  } catch (const config::ConfigError& e) {
    std::cerr << "nnstrain: config error: " << e.what() << "\n";
    return 2;
  } catch (const dist::DistEnvError& e) {
    std::cerr << "nnstrain: launch environment error: " << e.what() << "\n";
    return 2;
  } catch (const train::StepError& e) {
    std::cerr << "nnstrain: " << (debug ? e.detail : std::string(e.what())) << "\n";
    return 1;
  } catch (const dist::CollectiveError& e) {
    // Peers are gone: leave at once, process-group teardown could block on them.
    std::cerr << "nnstrain: " << e.what() << std::endl;
    std::_Exit(1);
  } catch (const std::exception& e) {
    std::cerr << "nnstrain: rank " << env.rank << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const std::string cmd = args.empty() ? "" : args.front();
  auto tail = [&] { return std::vector<std::string>(args.begin() + 1, args.end()); };
  if (cmd == "train") return train_main(tail());
  if (cmd == "launch") return dist::launch_main(tail(), dist::self_executable(argv[0]));
  if (cmd == "prepare") return data::prepare_main(tail());
  if (cmd == "tokenize") return tok::tokenize_main(tail());
  if (cmd == "env") return dist::env_main(tail());
  if (cmd == "plan") return plan_main(tail());
  if (cmd == "merge") return interop::merge_main(tail());
  if (cmd == "generate") return interop::generate_main(tail());
  if (cmd == "eval") return eval::eval_main(tail());
  if (cmd == "report") return report_main(tail());
  if (cmd == "--version") {
    print_version(std::cout);
    return 0;
  }
  if (cmd == "-h" || cmd == "--help" || cmd == "help" || cmd.empty()) {
    std::cout << kUsage;
    return cmd.empty() ? 2 : 0;
  }
  if (cmd.rfind("-", 0) != 0) {
    std::cerr << "nnstrain: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  }
  return train_main(args);
}

}  // namespace nnstrain::cli
