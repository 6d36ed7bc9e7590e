#include "trainer/eval/eval_command.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/dist/device.h"
#include "trainer/dist/dist_env.h"
#include "trainer/dist/process_groups.h"
#include "trainer/eval/evaluator.h"
#include "trainer/eval/report_table.h"
#include "trainer/interop/model_source.h"

namespace fs = std::filesystem;

namespace nnstrain::eval {

namespace {

constexpr const char* kUsage = R"(usage: nnstrain eval SOURCE --tasks FILE [FILE ...] [options]

  SOURCE  a checkpoint folder saved under any plan, a run's save_dir (its latest checkpoint),
          a merged folder (nnstrain merge) or a Hugging Face folder (config.json + model.safetensors)

  --tasks FILE ...       task descriptions (YAML in lm-evaluation-harness's task keys over local
                         JSON-lines files; docs/eval.md): multiple_choice, loglikelihood_rolling,
                         generate_until
  --limit N              the first N documents of each task (default: all)
  --batch-size B         requests per forward (default 8)
  --json OUT             the scores (and every document's) as JSON
  --tokenizer PATH       a tokenizer.json or folder with one, or a dataset's meta.json (default: the
                         Hugging Face folder's, or the meta.json beside a checkpoint's training data)
  --device cpu|cuda|auto (default auto)

Under `nnstrain launch` or torchrun the documents are split over the ranks (data parallel)
and the scores are those of one process. Every rank holds the whole model: --tp, --pp and --cp
are refused (score a tp- or pp-split model in training, with the eval: section; docs/eval.md).
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string source, json, tokenizer, device = "auto";
  std::vector<std::string> tasks;
  int64_t limit = 0, batch = 8;
};

int64_t parse_int(const std::string& opt, const std::string& v, int64_t lo) {
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size()) throw UsageError(opt + ": '" + v + "' is not an integer");
  if (x < lo) throw UsageError(opt + ": " + v + " is below " + std::to_string(lo));
  return x;
}

bool parse(const std::vector<std::string>& args, Options& o) {
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "-h" || a == "--help") return false;
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) throw UsageError(a + " needs a value");
      return args[++i];
    };
    // Each rank loads the whole model (interop::load_model_source); a split one
    // needs a sharded loader this command does not have. Refused, never ignored.
    if (a == "--tp" || a == "--pp" || a == "--cp" || a.rfind("--tp=", 0) == 0 || a.rfind("--pp=", 0) == 0 ||
        a.rfind("--cp=", 0) == 0)
      throw UsageError(a.substr(0, 4) + ": nnstrain eval does not split the model (every rank holds it whole and the "
                       "ranks split the documents)" +
                       (a.rfind("--cp", 0) != 0 ? "; a tensor- or pipeline-parallel run scores its tasks in training (eval:)"
                                                 : ""));
    if (a == "--tasks") {
      o.tasks.push_back(value());
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) o.tasks.push_back(args[++i]);
    } else if (a == "--limit") o.limit = parse_int(a, value(), 1);
    else if (a == "--batch-size") o.batch = parse_int(a, value(), 1);
    else if (a == "--json") o.json = value();
    else if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--device") {
      o.device = value();
      if (o.device != "cpu" && o.device != "cuda" && o.device != "auto")
        throw UsageError("--device: '" + o.device + "' is not cpu, cuda or auto");
    } else if (a.rfind("-", 0) == 0 || !o.source.empty()) throw UsageError("unexpected argument '" + a + "'");
    else o.source = a;
  }
  if (o.source.empty()) throw UsageError("need SOURCE: a checkpoint, save_dir, merged or Hugging Face folder");
  if (o.tasks.empty()) throw UsageError("need --tasks FILE ...");
  return true;
}

int run(const Options& o) {
  const auto env = dist::read_dist_env();
  // The task files are read (and refused) before the model loads.
  std::vector<Task> tasks;
  for (const auto& f : o.tasks) tasks.push_back(load_task(f, o.limit));
  auto src = interop::load_model_source(o.source);
  const std::string tok = !o.tokenizer.empty() ? o.tokenizer : src.tokenizer.value_or("");
  if (tok.empty()) throw UsageError("no tokenizer for " + o.source + "; give --tokenizer PATH");
  std::unique_ptr<TextCodec> codec;
  try {
    codec = load_text_codec(tok);
  } catch (const std::exception& e) {
    throw UsageError(std::string("--tokenizer: ") + e.what());
  }
  const auto device = dist::bind_device(o.device, env);
  src.model->to(device, torch::kFloat);
  src.model->eval();
  std::unique_ptr<dist::Runtime> rt;
  Backend be;
  be.model = src.model.get();
  be.device = device;
  be.progress = env.rank == 0;
  if (env.world_size > 1) {
    dist::RuntimeOptions ro;
    ro.cuda = device.is_cuda();
    rt = std::make_unique<dist::Runtime>(env, ro);
    be.dp_rank = rt->dp.rank;
    be.dp_size = rt->dp.size();
    auto* r = rt.get();
    be.dp_sum = [r](at::Tensor& t) { r->all_reduce(r->dp, t, "eval scores all-reduce"); };
  }
  if (env.rank == 0)
    std::cerr << "nnstrain eval: " << src.what << " on " << device << " (" << env.world_size
              << (env.world_size > 1 ? " ranks, documents split" : " process") << "); tokenizer " << codec->what << "\n";
  EvalOptions eo;
  eo.batch_size = o.batch;
  eo.per_doc = !o.json.empty();
  const auto results = evaluate(tasks, *codec, be, eo);
  if (rt) rt->shutdown();
  if (env.rank != 0) return 0;
  print_results(std::cout, results);
  for (const auto& r : results)
    if (r.truncated)
      std::cerr << "nnstrain eval: " << r.name << ": " << r.truncated << " of " << r.requests
                << " requests cut from the left to the model's " << src.model->max_seq_len() << " tokens (first: "
                << r.first_truncated << ")\n";
  if (!o.json.empty()) {
    std::ofstream out(o.json);
    if (!out) throw UsageError("--json: cannot write " + o.json);
    out << to_json(results).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  return 0;
}

}  // namespace

int eval_main(const std::vector<std::string>& args) {
  Options o;
  try {
    if (!parse(args, o)) {
      std::cout << kUsage;
      return 0;
    }
    return run(o);
  } catch (const UsageError& e) {
    std::cerr << "nnstrain eval: " << e.what() << " (see nnstrain eval --help)\n";
    return 2;
  } catch (const interop::ModelSourceError& e) {
    std::cerr << "nnstrain eval: " << e.what() << "\n";
    return 2;
  } catch (const TaskError& e) {
    std::cerr << "nnstrain eval: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    std::cerr << "nnstrain eval: error: " << m.substr(0, m.find('\n')) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::string m = e.what();
    std::cerr << "nnstrain eval: error: " << m.substr(0, m.find('\n')) << "\n";
    return 1;
  }
}

}  // namespace nnstrain::eval
