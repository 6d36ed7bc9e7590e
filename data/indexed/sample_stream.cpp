#include "data/indexed/sample_stream.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "data/splitmix.h"

namespace nnstrain::indexed {

namespace fs = std::filesystem;
using data::splitmix64;

namespace {
constexpr int64_t kBlock = 65536;  // blend counts memoised every kBlock samples
constexpr size_t kEpochsCached = 4;
constexpr uint64_t kDocOrder = 0x646f6373ULL, kSampleOrder = 0x73616d70ULL;

std::string ends_with_manifest(const std::string& p) {
  static const std::string suffix = ".manifest.json";
  return p.size() > suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0 ? p
                                                                                                    : p + suffix;
}

// Megatron-Core's choice for sample i: the largest w_d * max(i, 1) - given_d, ties to the lowest d.
int pick(const std::vector<double>& w, const std::vector<int64_t>& given, int64_t i) {
  const double x = std::max(static_cast<double>(i), 1.0);
  int best = 0;
  double best_err = w[0] * x - static_cast<double>(given[0]);
  for (size_t d = 1; d < w.size(); ++d) {
    const double err = w[d] * x - static_cast<double>(given[d]);
    if (err > best_err) best_err = err, best = static_cast<int>(d);
  }
  return best;
}

std::vector<double> normalised(const std::vector<double>& w) {
  double sum = 0;
  for (double v : w) sum += v;
  std::vector<double> out;
  for (double v : w) out.push_back(v / sum);
  return out;
}
}  // namespace

Manifest read_manifest(const std::string& path) {
  Manifest m;
  m.path = ends_with_manifest(path);
  std::error_code ec;
  if (!fs::is_regular_file(m.path, ec))
    throw std::runtime_error("no dataset manifest '" + m.path +
                             "' (an indexed dataset is PREFIX.bin/.idx with PREFIX.manifest.json, as `nnstrain "
                             "prepare corpus` writes them)");
  std::ifstream in(m.path, std::ios::binary);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
    const std::string bin = j.at("bin").get<std::string>(), idx = j.at("idx").get<std::string>();
    // The files must be plain names beside the manifest: a manifest never points outside its folder.
    for (const auto& name : {bin, idx})
      if (name.empty() || fs::path(name).filename().string() != name || name == "." || name == "..")
        throw std::runtime_error("'" + name + "' is not a file name beside the manifest");
    if (bin.size() < 5 || idx.size() < 5 || bin.substr(bin.size() - 4) != ".bin" ||
        idx.substr(idx.size() - 4) != ".idx" || bin.substr(0, bin.size() - 4) != idx.substr(0, idx.size() - 4))
      throw std::runtime_error("bin '" + bin + "' and idx '" + idx + "' are not PREFIX.bin and PREFIX.idx");
    m.prefix = (fs::path(m.path).parent_path() / bin.substr(0, bin.size() - 4)).string();
    const auto& t = j.at("tokenizer");
    m.tokenizer_sha256 = t.at("sha256").get<std::string>();
    m.tokenizer_path = t.value("path", "");
    m.vocab_size = t.at("vocab_size").get<int64_t>();
    if (!t.at("eos_id").is_null()) m.eos_id = t.at("eos_id").get<int64_t>();
    if (!t.at("bos_id").is_null()) m.bos_id = t.at("bos_id").get<int64_t>();
    const auto& spd = j.at("sequences_per_document");
    if (spd.is_string() && spd.get<std::string>() == "preference") {
      m.sequences_per_document = kPreferenceSequences;  // prompt, chosen, rejected (data/preference_dataset.h)
    } else if (spd.is_string() && spd.get<std::string>() == "alternating") {
      m.sequences_per_document = 0;
    } else {
      m.sequences_per_document = spd.get<int>();
      if (m.sequences_per_document != 1 && m.sequences_per_document != 2)
        throw std::runtime_error("sequences_per_document " + std::to_string(m.sequences_per_document) +
                                 " (1, 2 or \"alternating\" expected)");
    }
    if (j.contains("settings") && j["settings"].is_object()) {
      const auto& st = j["settings"];
      if (st.contains("max_tokens") && st["max_tokens"].is_number_integer())
        m.max_tokens = std::max<int64_t>(0, st["max_tokens"].get<int64_t>());
      m.chat_template_sha256 = st.value("chat_template_sha256", "");
      m.chat_template_source = st.value("chat_template_source", "");
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("dataset manifest '" + m.path + "': " + e.what());
  }
  return m;
}

uint64_t permute(uint64_t x, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  int bits = 64 - __builtin_clzll(n - 1);
  bits += bits & 1;  // two equal halves
  if (bits < 2) bits = 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  do {  // cycle-walk: a bijection of [0, 2^bits) restricted to [0, n)
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = splitmix64(key ^ (round * 0x9e3779b97f4a7c15ULL) ^ r) & mask;
      const uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}

void blend(const std::vector<double>& weights, int64_t n, std::vector<int>* dataset,
           std::vector<int64_t>* dataset_sample) {
  const auto w = normalised(weights);
  std::vector<int64_t> given(w.size(), 0);
  dataset->resize(size_t(n));
  dataset_sample->resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int d = pick(w, given, i);
    (*dataset)[size_t(i)] = d;
    (*dataset_sample)[size_t(i)] = given[size_t(d)]++;
  }
}

SampleStream::SampleStream(std::vector<Source> sources, int64_t seq_len, Join join, int64_t join_id, uint64_t seed)
    : seq_len_(seq_len), join_(join), join_id_(join_id), seed_(seed) {
  if (sources.empty()) throw std::invalid_argument("indexed dataset: no datasets");
  if (seq_len <= 0) throw std::invalid_argument("indexed dataset: seq_len must be positive");
  std::vector<double> w;
  for (auto& s : sources) {
    Src src{s.reader, s.weight, s.prompts, {}, 0, 0};
    const auto& r = src.reader;
    const int64_t D = r.documents();
    src.doc_len.resize(size_t(D));
    for (int64_t d = 0; d < D; ++d) {
      int64_t n = 0;
      for (int64_t q = r.doc_begin(d); q < r.doc_begin(d + 1); ++q) n += r.seq_length(q);
      src.doc_len[size_t(d)] = n;
      src.epoch_tokens += n + (join == Join::none ? 0 : 1);
    }
    src.samples = src.epoch_tokens > 0 ? (src.epoch_tokens - 1) / seq_len : 0;
    if (src.samples < 1)
      throw std::runtime_error("indexed dataset '" + r.prefix() + "': " + std::to_string(src.epoch_tokens) +
                               " tokens (documents and join tokens), too few for one sample of seq_len " +
                               std::to_string(seq_len) + " (needs seq_len + 1)");
    w.push_back(s.weight);
    src_.push_back(std::move(src));
  }
  weights_ = normalised(w);
  blend_counts_.push_back(std::vector<int64_t>(src_.size(), 0));
}

int64_t SampleStream::samples_per_epoch() const {
  int64_t n = 0;
  for (const auto& s : src_) n += s.samples;
  return n;
}

uint64_t SampleStream::key(size_t i, int64_t e, uint64_t what) const {
  return splitmix64(splitmix64(splitmix64(seed_ ^ what) ^ uint64_t(i)) ^ uint64_t(e));
}

int64_t SampleStream::document_at(size_t i, int64_t e, int64_t p) const {
  const auto D = uint64_t(src_[i].doc_len.size());
  return int64_t(permute(uint64_t(p), D, key(i, e, kDocOrder)));
}

std::shared_ptr<const std::vector<int64_t>> SampleStream::epoch_offsets(size_t i, int64_t e) const {
  const auto id = std::make_pair(i, e);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = epochs_.find(id);
    if (it != epochs_.end()) return it->second;
  }
  const auto& s = src_[i];
  const int64_t D = int64_t(s.doc_len.size()), join = join_ == Join::none ? 0 : 1;
  auto off = std::make_shared<std::vector<int64_t>>(size_t(D + 1), 0);
  for (int64_t p = 0; p < D; ++p) (*off)[size_t(p + 1)] = (*off)[size_t(p)] + s.doc_len[size_t(document_at(i, e, p))] + join;
  std::lock_guard<std::mutex> lock(mu_);
  epochs_[id] = off;
  epoch_lru_.push_back(id);
  if (epoch_lru_.size() > kEpochsCached) {
    epochs_.erase(epoch_lru_.front());
    epoch_lru_.erase(epoch_lru_.begin());
  }
  return off;
}

std::vector<std::pair<int, int64_t>> SampleStream::locate(int64_t first, int64_t n) const {
  std::vector<std::pair<int, int64_t>> out;
  if (first < 0 || n < 0) throw std::out_of_range("indexed dataset: negative sample index");
  if (src_.size() == 1) {
    for (int64_t g = first; g < first + n; ++g) out.emplace_back(0, g);
    return out;
  }
  std::vector<int64_t> given;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t block = size_t(first / kBlock);
    while (blend_counts_.size() <= block) {
      auto c = blend_counts_.back();
      const int64_t start = int64_t(blend_counts_.size() - 1) * kBlock;
      for (int64_t g = start; g < start + kBlock; ++g) ++c[size_t(pick(weights_, c, g))];
      blend_counts_.push_back(std::move(c));
    }
    given = blend_counts_[block];
  }
  for (int64_t g = first / kBlock * kBlock; g < first + n; ++g) {
    const int d = pick(weights_, given, g);
    if (g >= first) out.emplace_back(d, given[size_t(d)]);
    ++given[size_t(d)];
  }
  return out;
}

int64_t SampleStream::sample_start(size_t i, int64_t j) const {
  const int64_t S = src_[i].samples, e = j / S, k = j % S;
  return int64_t(permute(uint64_t(k), uint64_t(S), key(i, e, kSampleOrder))) * seq_len_;
}

void SampleStream::read(size_t i, int64_t j, Sample* out) const {
  if (i >= src_.size() || j < 0) throw std::out_of_range("indexed dataset: bad sample");
  const auto& s = src_[i];
  const int64_t e = j / s.samples, need = seq_len_ + 1;
  const auto off = epoch_offsets(i, e);
  int64_t pos = sample_start(i, j);
  int64_t p = int64_t(std::upper_bound(off->begin(), off->end(), pos) - off->begin()) - 1;
  out->tokens.assign(size_t(need), 0);
  out->prompt.assign(size_t(need), 0);
  out->doc.assign(size_t(need), 0);
  const int64_t lead = join_ == Join::bos ? 1 : 0;  // the join token before (BOS) or after (EOS) the document
  int64_t filled = 0;
  int32_t docno = 0;
  std::vector<int64_t> buf;
  std::vector<uint8_t> context;
  while (filled < need) {
    if (p >= int64_t(s.doc_len.size())) throw std::logic_error("indexed dataset: sample past its epoch");
    const int64_t d = document_at(i, e, p);
    const int64_t len = s.doc_len[size_t(d)], unit = (*off)[size_t(p + 1)] - (*off)[size_t(p)];
    int64_t u = pos - (*off)[size_t(p)];
    const int64_t u_end = std::min(unit, u + (need - filled));
    // Document tokens [a, b) of this unit's piece, read sequence by sequence.
    const int64_t a = std::clamp<int64_t>(u - lead, 0, len), b = std::clamp<int64_t>(u_end - lead, 0, len);
    buf.resize(size_t(b - a));
    context.assign(size_t(b - a), 0);
    {
      const auto& r = s.reader;
      // Sequences 0, 2, ... of a document of two or more are context.
      const bool alternating = s.prompts && r.doc_begin(d + 1) - r.doc_begin(d) >= 2;
      int64_t at = 0;  // document token index where sequence q starts
      for (int64_t q = r.doc_begin(d); q < r.doc_begin(d + 1) && at < b; ++q) {
        const int64_t ql = r.seq_length(q), lo = std::max(a, at), hi = std::min(b, at + ql);
        if (hi > lo) {
          r.read(r.seq_offset(q) + (lo - at), hi - lo, buf.data() + (lo - a));
          if (alternating && (q - r.doc_begin(d)) % 2 == 0) std::fill_n(context.begin() + (lo - a), hi - lo, 1);
        }
        at += ql;
      }
    }
    for (; u < u_end; ++u, ++filled) {
      const int64_t t = u - lead;  // document token index, or -1 / len for the join token
      const bool is_join = t < 0 || t >= len;
      out->tokens[size_t(filled)] = is_join ? join_id_ : buf[size_t(t - a)];
      out->prompt[size_t(filled)] = !is_join && context[size_t(t - a)];
      out->doc[size_t(filled)] = docno;
    }
    ++docno;
    pos = (*off)[size_t(p + 1)];
    ++p;
  }
}

}  // namespace nnstrain::indexed
