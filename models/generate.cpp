#include "models/generate.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "models/model.h"

namespace nnstrain::models {

int64_t sample_next(const at::Tensor& logits_in, const SamplingOptions& opts, at::Generator& gen) {
  auto logits = logits_in.detach().to(torch::kCPU, torch::kFloat).reshape({-1});
  if (opts.temperature <= 0) return logits.argmax().item<int64_t>();
  logits = logits / opts.temperature;
  const auto V = logits.size(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (opts.top_k > 0 && opts.top_k < V) {
    const auto kth = std::get<0>(logits.topk(opts.top_k)).index({opts.top_k - 1});
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (opts.top_p < 1.0) {
    const auto [sorted, order] = logits.sort(/*dim=*/0, /*descending=*/true);
    const auto probs = sorted.softmax(0);
    // Drop a token when the tokens likelier than it already reach top_p; the likeliest always stays.
    const auto drop_sorted = (probs.cumsum(0) - probs) >= opts.top_p;
    const auto drop = torch::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
    logits = logits.masked_fill(drop, neg_inf);
  }
  const auto probs = logits.softmax(0);
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              at::Generator& gen, const std::function<void(int64_t, const at::Tensor&)>& on_token) {
  TORCH_CHECK(!prompt.empty(), "generate: an empty prompt");
  torch::InferenceMode inference;
  const auto device = model.parameters().front().device();
  const int64_t window = model.max_seq_len();
  std::vector<int64_t> seq = prompt;
  std::vector<int64_t> out;
  common::KvCache cache(std::min<int64_t>(window, static_cast<int64_t>(prompt.size()) + opts.max_new_tokens));
  auto as_tensor = [&](std::vector<int64_t>::const_iterator b, std::vector<int64_t>::const_iterator e) {
    std::vector<int64_t> ids(b, e);
    return torch::tensor(ids, torch::kLong).view({1, -1}).to(device);
  };
  for (int64_t step = 0; step < opts.max_new_tokens; ++step) {
    at::Tensor logits;
    const int64_t n = static_cast<int64_t>(seq.size());
    const auto from = seq.end() - std::min(n, window);  // the context, cropped to the window
    if (!opts.kv_cache) {
      logits = model.logits(as_tensor(from, seq.end()));
    } else if (cache.length() > 0 && cache.length() == n - 1 && n <= cache.capacity() &&
               !model.rebuild_cache(cache.length(), n)) {
      logits = model.decode_logits(as_tensor(seq.end() - 1, seq.end()), cache);  // one new token
    } else {
      cache.reset();  // the prompt, a window that slid (positions changed), or the model asks
      logits = model.decode_logits(as_tensor(from, seq.end()), cache);
    }
    const auto last = logits.select(0, 0).select(0, -1);
    const int64_t id = sample_next(last, opts.sampling, gen);
    seq.push_back(id);
    out.push_back(id);
    if (on_token) on_token(id, last);
    if (id == opts.stop_id) break;
  }
  return out;
}

}  // namespace nnstrain::models
