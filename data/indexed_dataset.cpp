#include "data/indexed_dataset.h"

#include <stdexcept>

#include <torch/torch.h>

#include "base/config/arg_map.h"
#include "data/splitmix.h"

namespace nnstrain::data {

IndexedDataset::IndexedDataset(const config::IndexedArgs& args, uint64_t seed, int64_t global_batch,
                               const std::string& key)
    : args_(args), key_(key), global_batch_(global_batch) {
  const auto join = args.join == "bos" ? indexed::Join::bos : args.join == "none" ? indexed::Join::none : indexed::Join::eos;
  std::vector<indexed::SampleStream::Source> sources;
  int64_t join_id = 0;
  for (size_t i = 0; i < args.datasets.size(); ++i) {
    const std::string where = key + ".datasets[" + std::to_string(i) + "].path";
    try {
      manifests_.push_back(indexed::read_manifest(args.datasets[i].path));
      readers_.emplace_back(manifests_.back().prefix);
    } catch (const std::exception& e) {
      throw config::ConfigError(where + ": " + e.what());
    }
    const auto& m = manifests_.back();
    if (m.sequences_per_document == indexed::kPreferenceSequences)
      throw config::ConfigError(where + ": " + m.path + " is a preference dataset (prompt, chosen, rejected): "
                                "train on it with dataset.type preference and an alignment: section (docs/alignment.md)");
    // The over-long rule (prepare corpus --max-tokens / --overlong) holds each
    // conversation within one attention window only if the window is as long:
    // training shorter would cut conversations mid-turn, which the rule exists to prevent.
    if (args.document_mask && m.max_tokens > args.seq_len)
      throw config::ConfigError(key + ".seq_len: " + std::to_string(args.seq_len) + " is shorter than the " +
                                std::to_string(m.max_tokens) + " tokens " + m.path +
                                " allows a conversation (prepare corpus --max-tokens); prepare it again with "
                                "--max-tokens " + std::to_string(args.seq_len) + " or raise seq_len");
    const auto& id = join == indexed::Join::eos ? m.eos_id : m.bos_id;
    if (join != indexed::Join::none) {
      if (!id) throw config::ConfigError(key + ".join: " + args.join + ": the tokenizer of " + m.path + " has no such token");
      join_id = *id;
    }
    sources.push_back({readers_.back(), args.datasets[i].weight, args.mask_prompt && m.sequences_per_document != 1});
  }
  try {
    stream_ = std::make_unique<indexed::SampleStream>(sources, args.seq_len, join, join_id, seed);
  } catch (const std::runtime_error& e) {
    throw config::ConfigError(key + ".seq_len: " + e.what());
  }
}

void IndexedDataset::check_vocab(int64_t model_vocab) const {
  for (size_t i = 0; i < manifests_.size(); ++i) {
    const std::string where = key_ + ".datasets[" + std::to_string(i) + "].path";
    const auto& m = manifests_[i];
    if (m.vocab_size > model_vocab)
      throw config::ConfigError(where + ": " + m.path + " was tokenised with a vocabulary of " +
                                std::to_string(m.vocab_size) + " ids (" + m.tokenizer_path +
                                "), more than the model's " + std::to_string(model_vocab) +
                                "; raise model.args' vocab_size");
    const int64_t mx = readers_[i].max_token();
    if (mx >= model_vocab)
      throw config::ConfigError(where + ": '" + m.prefix + ".bin' holds token id " + std::to_string(mx) +
                                ", but the model's vocabulary has " + std::to_string(model_vocab) + " ids (0.." +
                                std::to_string(model_vocab - 1) + "); model.args' vocab_size or the data is wrong");
  }
}

Batch IndexedDataset::samples(int64_t first, int64_t count) const {
  const int64_t T = seq_len();
  auto x = torch::empty({count, T}, torch::kInt64), y = torch::empty({count, T}, torch::kInt64);
  at::Tensor pos, seg;
  if (args_.document_mask) pos = torch::empty({count, T}, torch::kInt64), seg = torch::empty({count, T}, torch::kInt64);
  int64_t *px = x.data_ptr<int64_t>(), *py = y.data_ptr<int64_t>();
  indexed::Sample s;
  const auto where = stream_->locate(first, count);
  for (int64_t b = 0; b < count; ++b) {
    stream_->read(size_t(where[size_t(b)].first), where[size_t(b)].second, &s);
    for (int64_t t = 0; t < T; ++t) {
      px[b * T + t] = s.tokens[size_t(t)];
      // The prompt is context, never a target; under document masking neither is
      // the next document's first token (its context is masked away).
      const bool skip = s.prompt[size_t(t + 1)] || (args_.document_mask && s.doc[size_t(t + 1)] != s.doc[size_t(t)]);
      py[b * T + t] = skip ? -100 : s.tokens[size_t(t + 1)];
    }
    if (args_.document_mask) {
      int64_t *pp = pos.data_ptr<int64_t>() + b * T, *ps = seg.data_ptr<int64_t>() + b * T;
      int64_t start = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (t > 0 && s.doc[size_t(t)] != s.doc[size_t(t - 1)]) start = t;
        pp[t] = t - start;
        ps[t] = s.doc[size_t(t)];
      }
    }
  }
  return {x, y, pos, seg};
}

Batch IndexedDataset::train_batch(int64_t step, int64_t first, int64_t count) const {
  if (step < 0 || first < 0 || count < 0)
    throw std::out_of_range(key_ + ": bad batch slice step=" + std::to_string(step) + " first=" + std::to_string(first) +
                            " count=" + std::to_string(count));
  return samples(step * global_batch_ + first, count);
}

Batch IndexedDataset::val_batch(int64_t k, int64_t first, int64_t count) const {
  if (k < 0 || first < 0 || count < 0) throw std::out_of_range(key_ + ": bad validation batch");
  const uint64_t n = uint64_t(samples_per_epoch());
  const uint64_t start = van_der_corput_index(uint64_t(k), n);
  // Positions wrap around one epoch of the stream; gathered one sample at a time.
  std::vector<Batch> parts;
  for (int64_t p = first; p < first + count; ++p) parts.push_back(samples(int64_t((start + uint64_t(p)) % n), 1));
  auto cat = [&](auto get) {
    std::vector<at::Tensor> t;
    for (auto& b : parts) t.push_back(get(b));
    return t.empty() || !t[0].defined() ? at::Tensor() : torch::cat(t, 0);
  };
  if (parts.empty()) return samples(0, 0);
  return {cat([](Batch& b) { return b.x; }), cat([](Batch& b) { return b.y; }),
          cat([](Batch& b) { return b.positions; }), cat([](Batch& b) { return b.segments; })};
}

}  // namespace nnstrain::data
