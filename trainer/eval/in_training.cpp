#include "trainer/eval/in_training.h"

#include <chrono>
#include <filesystem>

#include "base/config/arg_map.h"
#include "base/log.h"
#include "models/model.h"

namespace fs = std::filesystem;

namespace nnstrain::eval {

namespace {

// eval.tokenizer, else the Hugging Face folder the model starts from, else the
// meta.json beside a char/byte-level dataset (what nnstrain eval finds for a checkpoint).
std::string find_tokenizer(const config::TrainerArgs& a) {
  if (!a.eval.tokenizer.empty()) return a.eval.tokenizer;
  if (!a.model.init_from.empty())
    for (const char* f : {"tokenizer.json", "encoder.json"})
      if (fs::exists(fs::path(a.model.init_from) / f)) return (fs::path(a.model.init_from) / f).string();
  if (a.dataset.type != "indexed" && !a.dataset.train_args.path.empty()) {
    const auto meta = fs::path(a.dataset.train_args.path).parent_path() / "meta.json";
    if (fs::exists(meta)) return meta.string();
  }
  throw config::ConfigError(
      "eval.tokenizer: not given, and neither model.init_from nor the dataset's folder holds a tokenizer; "
      "give a tokenizer.json, folder or meta.json");
}

}  // namespace

InTrainingEval::InTrainingEval(const config::TrainerArgs& args, Backend be) : be_(std::move(be)) {
  every_ = args.eval.every_n_train_steps;
  opts_.batch_size = args.eval.batch_size;
  try {
    for (const auto& f : args.eval.tasks) tasks_.push_back(load_task(f, args.eval.limit));
  } catch (const TaskError& e) {
    throw config::ConfigError(std::string("eval.tasks: ") + e.what());
  }
  const auto tok = find_tokenizer(args);
  try {
    codec_ = load_text_codec(tok);
  } catch (const std::exception& e) {
    throw config::ConfigError("eval.tokenizer: " + tok + ": " + e.what());
  }
}

int64_t InTrainingEval::documents() const {
  int64_t n = 0;
  for (const auto& t : tasks_) n += int64_t(t.docs.size());
  return n;
}

nlohmann::json InTrainingEval::run(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool was_training = be_.model->is_training();
  be_.model->eval();
  std::vector<TaskResult> results;
  try {
    results = evaluate(tasks_, *codec_, be_, opts_);
  } catch (...) {
    if (was_training) be_.model->train();
    throw;
  }
  if (was_training) be_.model->train();
  nlohmann::json rec = {{"step", step}};
  for (const auto& r : results) {
    for (const auto& [m, v] : r.metrics) rec["eval_" + r.name + "/" + m] = v;
    if (r.truncated && !warned_truncation_ && be_.progress) {
      warned_truncation_ = true;
      log::warn("eval: " + r.name + ": " + std::to_string(r.truncated) + " of " + std::to_string(r.requests) +
                " requests cut from the left to the model's " + std::to_string(be_.model->max_seq_len()) +
                " tokens (first: " + r.first_truncated + ")");
    }
  }
  rec["eval_seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rec;
}

}  // namespace nnstrain::eval
