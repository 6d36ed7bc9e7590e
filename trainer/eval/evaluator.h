// Scoring tasks (task.h) on a model as lm-evaluation-harness's Hugging Face
// backend scores them: each (context, continuation) pair tokenised whole and
// split at the context's tokens (trailing spaces of the context moved to the
// continuation), the input cut from the left to the model's length, the
// continuation's log-probabilities summed (fp32) with its greedy check;
// loglikelihood_rolling over the harness's disjoint rolling windows; greedy
// generation (KV cache where the model is whole) up to the stop sequences.
// Requests are sorted by length and batched; data-parallel ranks split them
// and sum the results; tensor-parallel ranks of one replica run the same
// batches (the model's logits() gathers the vocabulary); pipeline ranks run
// each batch through their stages and get the last stage's sums back.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/eval/task.h"
#include "trainer/eval/text_codec.h"

namespace nnstrain::models {
class CausalLM;
}

namespace nnstrain::eval {

// How the evaluator reaches the model under a plan.
struct Backend {
  models::CausalLM* model = nullptr;
  c10::Device device{c10::kCPU};
  int dp_rank = 0, dp_size = 1;
  std::function<void(at::Tensor&)> dp_sum;  // in-place sum over the data-parallel replicas (null: one)
  std::function<void()> before_forward, after_forwards;  // ZeRO-3: gather / release the parameters
  bool kv_cache = true;       // false under tensor parallelism (decode_logits is whole-model only)
  int64_t seq_multiple = 1;   // input lengths padded to a multiple (sequence parallelism splits T)
  bool progress = false;      // this rank draws the progress bar (stderr)
  // false in training: tensors a forward caches (ZeRO-3's gathered weights, rope
  // tables) must stay usable by the next backward, so no-grad only.
  bool inference_mode = true;
  // Pipeline parallelism: no rank holds the whole model, so logits() cannot
  // run. staged_forward(x, reduce, like) runs x [B, W] through the stages,
  // applies `reduce` to the last stage's logits [B, W, vocab] and returns its
  // result (a few numbers a request, shaped and typed as `like`) on every
  // rank. Null: reduce(model->logits(x)) here.
  using Reduce = std::function<at::Tensor(const at::Tensor& logits)>;
  std::function<at::Tensor(const at::Tensor& x, const Reduce& reduce, const at::Tensor& like)> staged_forward;
};

struct EvalOptions {
  int64_t batch_size = 8;
  bool per_doc = false;  // keep every document's scores in the results
};

struct TaskResult {
  std::string name, kind, file;
  int64_t docs = 0, requests = 0;
  int64_t truncated = 0;        // requests cut from the left to the model's length
  std::string first_truncated;  // file:line of the first
  std::vector<std::pair<std::string, double>> metrics;
  double seconds = 0;
  nlohmann::json per_doc = nlohmann::json::array();
};

std::vector<TaskResult> evaluate(const std::vector<Task>& tasks, const TextCodec& codec, Backend& be,
                                 const EvalOptions& opts);

nlohmann::json to_json(const std::vector<TaskResult>& results);

}  // namespace nnstrain::eval
