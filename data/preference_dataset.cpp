#include "data/preference_dataset.h"

#include <algorithm>
#include <stdexcept>

#include <torch/torch.h>

#include "base/config/arg_map.h"
#include "data/splitmix.h"

namespace nnstrain::data {

namespace {
constexpr uint64_t kPairOrder = 0x70726566u;  // "pref"

indexed::Manifest read_preference_manifest(const std::string& path, const std::string& where) {
  try {
    auto m = indexed::read_manifest(path);
    if (m.sequences_per_document != indexed::kPreferenceSequences)
      throw std::runtime_error("not a preference dataset (prepare corpus --format preference writes those)");
    return m;
  } catch (const std::exception& e) {
    throw config::ConfigError(where + ": " + e.what());
  }
}
}  // namespace

PreferenceDataset::PreferenceDataset(const config::PreferenceArgs& args, uint64_t seed, int64_t global_batch,
                                     const std::string& key)
    : args_(args),
      key_(key),
      seed_(seed),
      global_batch_(global_batch),
      manifest_(read_preference_manifest(args.path, key + ".path")),
      reader_([&] {
        try {
          return indexed::Reader(manifest_.prefix);
        } catch (const std::exception& e) {
          throw config::ConfigError(key + ".path: " + e.what());
        }
      }()) {
  pairs_ = reader_.documents();
  if (pairs_ == 0) throw config::ConfigError(key + ".path: " + manifest_.path + " holds no pairs");
  for (int64_t d = 0; d < pairs_; ++d) {
    const int64_t s = reader_.doc_begin(d);
    if (reader_.doc_begin(d + 1) - s != 3)
      throw config::ConfigError(key + ".path: " + manifest_.prefix + ".idx: pair " + std::to_string(d) + " has " +
                                std::to_string(reader_.doc_begin(d + 1) - s) +
                                " sequences, not 3 (prompt, chosen, rejected)");
    if (reader_.seq_length(s) >= (args.pack ? args.seq_len / 2 : args.seq_len))
      throw config::ConfigError(key + ".seq_len: " + std::to_string(args.seq_len) + " tokens leave no completion " +
                                "for pair " + std::to_string(d) + " of " + manifest_.path + " (its prompt has " +
                                std::to_string(reader_.seq_length(s)) +
                                " tokens); raise seq_len or prepare with a shorter --max-prompt-length");
  }
  // Padding is never a target and, right of every real token, never attended to by one.
  pad_id_ = manifest_.eos_id.value_or(0);
}

void PreferenceDataset::check_vocab(int64_t model_vocab) const {
  if (manifest_.vocab_size > model_vocab)
    throw config::ConfigError(key_ + ".path: " + manifest_.path + " was tokenised with a vocabulary of " +
                              std::to_string(manifest_.vocab_size) + " ids, more than the model's " +
                              std::to_string(model_vocab));
  const int64_t mx = reader_.max_token();
  if (mx >= model_vocab)
    throw config::ConfigError(key_ + ".path: '" + manifest_.prefix + ".bin' holds token id " + std::to_string(mx) +
                              ", but the model's vocabulary has " + std::to_string(model_vocab) + " ids");
}

Batch PreferenceDataset::rows(const std::vector<int64_t>& ids) const {
  // Unpacked: rows [0, P) chosen, [P, 2P) rejected, each of seq_len. Packed: row i
  // holds pair i's chosen (document 0) then rejected (document 1), each cut to
  // seq_len / 2, the rest padding (document 2).
  const bool pack = args_.pack;
  const int64_t P = int64_t(ids.size()), T = args_.seq_len, L = pack ? T / 2 : T;
  const int64_t R = pack ? P : 2 * P;
  auto x = torch::full({R, T}, pad_id_, torch::kInt64), y = torch::full({R, T}, kIgnoreTarget, torch::kInt64);
  at::Tensor pos, seg;
  if (pack) pos = torch::zeros({R, T}, torch::kInt64), seg = torch::full({R, T}, 2, torch::kInt64);
  int64_t *px = x.data_ptr<int64_t>(), *py = y.data_ptr<int64_t>();
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < P; ++i) {
    const int64_t s = reader_.doc_begin(ids[size_t(i)]);
    const int64_t prompt = reader_.seq_length(s);
    int64_t at = 0;  // packed: where this document starts in its row
    for (int which = 0; which < 2; ++which) {
      const int64_t comp = reader_.seq_length(s + 1 + which);
      const int64_t n = std::min(prompt + comp, L);  // keep_start
      tokens.resize(size_t(prompt + comp));
      reader_.read(reader_.seq_offset(s), prompt, tokens.data());
      reader_.read(reader_.seq_offset(s + 1 + which), comp, tokens.data() + prompt);
      const int64_t r = pack ? i : which * P + i, o = r * T + (pack ? at : 0);
      for (int64_t t = 0; t < n; ++t) px[o + t] = tokens[size_t(t)];
      // Position t predicts token t + 1: a target where that token is the completion's.
      for (int64_t t = std::max<int64_t>(prompt - 1, 0); t + 1 < n; ++t) py[o + t] = tokens[size_t(t + 1)];
      if (pack) {
        for (int64_t t = 0; t < n; ++t) pos.data_ptr<int64_t>()[o + t] = t, seg.data_ptr<int64_t>()[o + t] = which;
        at += n;
      }
    }
    if (pack)  // the padding's positions run on (it is its own document, never a target)
      for (int64_t t = at; t < T; ++t) pos.data_ptr<int64_t>()[i * T + t] = t - at;
  }
  Batch b;
  b.x = x;
  b.y = y;
  b.positions = pos;
  b.segments = seg;
  b.pair_index = torch::tensor(ids, torch::kInt64);
  return b;
}

Batch PreferenceDataset::train_batch(int64_t step, int64_t first, int64_t count) const {
  std::vector<int64_t> ids(static_cast<size_t>(count));
  const auto N = uint64_t(pairs_);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t g = uint64_t(step) * uint64_t(global_batch_) + uint64_t(first + i);
    const uint64_t epoch = g / N, pos = g % N;
    ids[size_t(i)] = int64_t(args_.shuffle ? indexed::permute(pos, N, splitmix64(splitmix64(seed_ ^ kPairOrder) ^ epoch))
                                           : pos);
  }
  return rows(ids);
}

Batch PreferenceDataset::val_batch(int64_t k, int64_t first, int64_t count) const {
  std::vector<int64_t> ids(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ids[size_t(i)] = (k * global_batch_ + first + i) % pairs_;
  return rows(ids);
}

Batch PreferenceDataset::pairs(int64_t first, int64_t count) const {
  std::vector<int64_t> ids(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ids[size_t(i)] = first + i;
  return rows(ids);
}

}  // namespace nnstrain::data
