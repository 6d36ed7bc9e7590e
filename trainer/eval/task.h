// Evaluation tasks as local files: a YAML description in lm-evaluation-harness's
// own task-config keys (output_type, doc_to_text / doc_to_target / doc_to_choice
// as Jinja templates or field names, target_delimiter, fewshot_delimiter,
// num_fewshot, generation_kwargs, filter_list, metric_list) over JSON-lines
// files (dataset_path: json, dataset_kwargs.data_files), so one file runs in
// both nnstrain and the harness. Loading it builds every document's prompt as
// the harness does: the few-shot examples drawn by its sampler for the same
// seed, the context strings, the continuations. Torch-free; docs/eval.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nnstrain::eval {

// A fault in a task file: the message names the file (and line).
struct TaskError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Kind { multiple_choice, loglikelihood_rolling, generate_until };
const char* kind_name(Kind k);

struct RegexFilter {
  std::string pattern;
  int64_t group_select = 0;
  std::string fallback = "[invalid]";
};

struct ExactMatchOptions {
  bool ignore_case = false, ignore_punctuation = false, ignore_numbers = false;
  std::vector<std::string> regexes_to_ignore;
};

// One document's requests and what scores them.
struct DocRequests {
  std::string where;  // "file:line"
  std::string context;
  // multiple_choice: one continuation per choice (target_delimiter + choice), the
  // choices themselves (their lengths normalise acc_norm / acc_bytes) and the gold index.
  std::vector<std::string> continuations, choices;
  int64_t gold = -1;
  // loglikelihood_rolling: the whole text, its words and bytes.
  std::string text;
  int64_t words = 0, bytes = 0;
  // generate_until: the target string.
  std::string target;
};

struct Task {
  std::string name, file;  // task:, the YAML's path
  Kind kind = Kind::multiple_choice;
  std::vector<std::string> metrics;  // acc, acc_norm, acc_bytes; word_perplexity, ...; exact_match
  int64_t num_fewshot = 0;
  uint64_t fewshot_seed = 1234;  // the harness's default fewshot_random_seed
  // generate_until
  std::vector<std::string> until;
  int64_t max_gen_toks = 256;
  std::optional<RegexFilter> regex;
  ExactMatchOptions exact;
  std::vector<DocRequests> docs;  // in file order, --limit applied
};

// Reads a task YAML and its documents; `limit` > 0 keeps the first `limit`
// documents (the harness's --limit). Throws TaskError naming the file and line.
Task load_task(const std::string& yaml_path, int64_t limit);

// The regex filter then exact match, as the harness's RegexFilter and exact_match.
std::string apply_filter(const Task& t, const std::string& generated);
bool exact_match(const Task& t, const std::string& prediction, const std::string& reference);

}  // namespace nnstrain::eval
