#include "data/tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <ctime>
#include <thread>

#include "data/tokenizer/tokenizer_impl.h"
#include "data/tokenizer/unicode.h"

namespace nnstrain::tok {

SpecialPolicy parse_special_policy(const std::string& s) {
  if (s == "text") return SpecialPolicy::text;
  if (s == "special") return SpecialPolicy::special;
  if (s == "error") return SpecialPolicy::error;
  throw TokenizerError("special-token policy '" + s + "': expected text, special or error");
}

const char* special_policy_name(SpecialPolicy p) {
  switch (p) {
    case SpecialPolicy::special: return "special";
    case SpecialPolicy::error: return "error";
    default: return "text";
  }
}

// ---------------------------------------------------------------- added tokens

void AddedMatcher::add(const AddedToken* t) {
  if (t->content.empty()) return;
  tokens_.push_back(t);
  auto& bucket = by_first_[static_cast<unsigned char>(t->content[0])];
  bucket.push_back(t);
  std::stable_sort(bucket.begin(), bucket.end(),
                   [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
}

bool AddedMatcher::find(std::string_view text, size_t from, size_t& at, const AddedToken*& which) const {
  for (size_t i = from; i < text.size(); ++i) {
    const auto& bucket = by_first_[static_cast<unsigned char>(text[i])];
    if (bucket.empty()) continue;
    for (const AddedToken* t : bucket) {
      const std::string& c = t->content;
      if (c.size() <= text.size() - i && std::memcmp(text.data() + i, c.data(), c.size()) == 0) {
        at = i;
        which = t;
        return true;
      }
    }
  }
  return false;
}

void Tokenizer::Impl::finish() {
  int32_t max_id = bpe.max_id();
  for (const auto& a : added) max_id = std::max(max_id, a.id);
  added_content.assign(max_id + 1, std::string());
  raw_matcher = AddedMatcher();
  normalized_matcher = AddedMatcher();
  for (const auto& a : added) {
    added_content[a.id] = a.content;
    (a.normalized ? normalized_matcher : raw_matcher).add(&a);
    // A cut (safe_cuts) must not fall inside a match or its stripped whitespace.
    if (a.lstrip || a.rstrip || a.content.find('\n') != std::string::npos) cuttable = false;
  }
  if (add_prefix_space) cuttable = false;
}

// ---------------------------------------------------------------- encoding

struct EncodeCache::Impl {
  const void* owner = nullptr;
  // piece -> (offset, count) in ids: 32 bits do, as the cache holds at most
  // kCacheMaxPieces pieces of at most kCachedPieceMax bytes.
  StringMap<std::pair<uint32_t, uint32_t>> pieces;
  std::vector<int32_t> ids;
  std::string scratch;
};

EncodeCache::EncodeCache() : impl_(std::make_unique<Impl>()) {}
EncodeCache::~EncodeCache() = default;

namespace {

constexpr size_t kCacheMaxPieces = 1 << 18;
constexpr size_t kCachedPieceMax = 64;  // longer pieces are rare; not worth the memory

struct Segment {
  size_t begin, end;
  const AddedToken* token;  // null: text
};

size_t utf8_back(std::string_view s, size_t i) {  // start of the character before i
  do --i;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
  return i;
}

bool space_at(std::string_view s, size_t i, size_t& len) {
  uint32_t cp = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const int n = utf8_decode(p + i, p + s.size(), cp);
  len = n > 0 ? n : 1;
  return n > 0 && char_class(cp) == kSpace;
}

// Hugging Face's AddedVocabulary::find_matches: matches, less special ones under the
// text policy, with lstrip/rstrip taking the whitespace beside them.
void split_added(std::string_view text, size_t base, const AddedMatcher& m, SpecialPolicy policy,
                 std::vector<Segment>& out) {
  size_t pos = 0, start_offset = 0, at = 0;
  const AddedToken* tok = nullptr;
  while (m.find(text, pos, at, tok)) {
    size_t stop = at + tok->content.size();
    pos = stop;
    if (tok->special && policy == SpecialPolicy::text) continue;
    if (tok->special && policy == SpecialPolicy::error)
      throw TokenizerError("special token '" + tok->content + "' in the text at byte " + std::to_string(base + at) +
                           " (special-token policy: error)");
    size_t start = at;
    if (tok->lstrip) {
      while (start > start_offset) {
        const size_t prev = utf8_back(text, start);
        size_t len;
        if (!space_at(text, prev, len)) break;
        start = prev;
      }
    }
    if (tok->rstrip) {
      size_t len;
      while (stop < text.size() && space_at(text, stop, len)) stop += len;
      pos = stop;
    }
    if (start_offset < start) out.push_back({start_offset, start, nullptr});
    out.push_back({start, stop, tok});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), nullptr});
}

// `base`: where `text` starts in the caller's text (for error messages).
void encode_text(const Tokenizer::Impl& t, std::string_view text, size_t base, EncodeCache::Impl& c,
                 std::vector<int32_t>& out) {
  if (text.empty()) return;
  size_t shift = 0;  // the prefix space is not in the caller's text
  if (t.add_prefix_space && text[0] != ' ') {
    c.scratch.assign(1, ' ');
    c.scratch.append(text.data(), text.size());
    text = c.scratch;
    shift = 1;
  }
  // One piece at a time (size_t offsets, no list of the pieces): a text of any
  // size, however many pieces it has.
  for (size_t begin = 0, end; begin < text.size(); begin = end) {
    end = piece_end(t.pattern, text, begin);
    const std::string_view piece = text.substr(begin, end - begin);
    if (piece.size() > BpeModel::kMaxPiece)
      throw TokenizerError("a pre-tokenized piece of " + std::to_string(piece.size()) + " bytes at byte " +
                           std::to_string(base + begin - std::min(begin, shift)) + ": BPE encodes pieces of at most " +
                           std::to_string(BpeModel::kMaxPiece) + " bytes (2^31 - 1)");
    if (piece.size() > kCachedPieceMax) {
      t.bpe.encode(piece, out);
      continue;
    }
    if (const auto* hit = c.pieces.find(piece)) {
      out.insert(out.end(), c.ids.begin() + hit->first, c.ids.begin() + hit->first + hit->second);
      continue;
    }
    const size_t first = out.size();
    t.bpe.encode(piece, out);
    if (c.pieces.size() >= kCacheMaxPieces) {
      c.pieces.clear();
      c.ids.clear();
    }
    c.pieces.put(piece, {static_cast<uint32_t>(c.ids.size()), static_cast<uint32_t>(out.size() - first)});
    c.ids.insert(c.ids.end(), out.begin() + first, out.end());
  }
}

void encode_body(const Tokenizer::Impl& t, std::string_view text, size_t base, SpecialPolicy policy,
                 EncodeCache::Impl& c, std::vector<int32_t>& out) {
  if (const size_t bad = utf8_first_invalid(text); bad != std::string_view::npos)
    throw TokenizerError("text is not valid UTF-8 at byte " + std::to_string(base + bad));
  if (c.owner != &t) {  // a cache serves one tokenizer
    c.pieces.clear();
    c.ids.clear();
    c.owner = &t;
  }
  if (t.raw_matcher.empty() && t.normalized_matcher.empty()) {
    encode_text(t, text, base, c, out);
    return;
  }
  std::vector<Segment> first, second;
  split_added(text, base, t.raw_matcher, policy, first);
  for (const Segment& s : first) {
    if (s.token) {
      out.push_back(s.token->id);
      continue;
    }
    const std::string_view part = text.substr(s.begin, s.end - s.begin);
    second.clear();
    split_added(part, base + s.begin, t.normalized_matcher, policy, second);
    for (const Segment& s2 : second) {
      if (s2.token) out.push_back(s2.token->id);
      else encode_text(t, part.substr(s2.begin, s2.end - s2.begin), base + s.begin + s2.begin, c, out);
    }
  }
}

uint64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Runs work(i, worker) for i in [0, n) on up to `threads` threads (the caller's
// included); worker < threads names the thread, for per-thread state. Records in
// `busiest_ns` (if given) the largest CPU time one thread spent: the work's
// critical path, which shows the balance even where other work shares the cores.
template <class F>
void parallel_for(size_t n, int threads, F&& work, std::atomic<uint64_t>* busiest_ns = nullptr) {
  const size_t k = std::max<size_t>(1, std::min<size_t>(n, threads > 0 ? threads : 1));
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto run = [&](size_t worker) {
    const uint64_t t0 = busiest_ns ? thread_cpu_ns() : 0;
    try {
      for (size_t i; !failed && (i = next++) < n;) work(i, worker);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
    if (busiest_ns) {
      const uint64_t spent = thread_cpu_ns() - t0;
      for (uint64_t seen = *busiest_ns; spent > seen && !busiest_ns->compare_exchange_weak(seen, spent);) {
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t w = 1; w < k; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// Work items of about equal bytes, so every thread gets about the same share
// whatever the documents' sizes (items of a fixed document count left two threads
// three uneven items on a 10 MB batch of 64 KB documents). Items per thread:
// enough that the last one to finish holds the others up little; bytes per item:
// enough that taking an item costs nothing beside encoding it.
size_t item_bytes(uint64_t total, int threads) {
  constexpr uint64_t kItemsPerThread = 16, kMinItem = 64 << 10;
  return std::max<uint64_t>(kMinItem, total / (kItemsPerThread * std::max(threads, 1)));
}

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, SpecialPolicy policy, bool add_special) const {
  EncodeCache cache;
  std::vector<int32_t> out;
  encode(text, policy, add_special, cache, out);
  return out;
}

void Tokenizer::encode(std::string_view text, SpecialPolicy policy, bool add_special, EncodeCache& cache,
                       std::vector<int32_t>& out) const {
  if (add_special) out.insert(out.end(), impl_->prefix.begin(), impl_->prefix.end());
  encode_body(*impl_, text, 0, policy, cache.impl(), out);
  if (add_special) out.insert(out.end(), impl_->suffix.begin(), impl_->suffix.end());
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& docs,
                                                          SpecialPolicy policy, bool add_special, int threads,
                                                          EncodeProgress* progress) const {
  std::vector<std::vector<int32_t>> out(docs.size());
  uint64_t total = 0;
  for (const auto& d : docs) total += d.size();
  const size_t target = item_bytes(total, threads);
  std::vector<size_t> starts{0};  // item i: documents [starts[i], starts[i + 1])
  for (size_t i = 0, bytes = 0; i < docs.size(); ++i) {
    bytes += docs[i].size() + 1;  // + 1: empty documents cost something too
    if (bytes >= target && i + 1 < docs.size()) {
      starts.push_back(i + 1);
      bytes = 0;
    }
  }
  starts.push_back(docs.size());
  const size_t items = starts.size() - 1;
  const int k = static_cast<int>(std::max<size_t>(1, std::min<size_t>(items, std::max(threads, 1))));
  std::vector<EncodeCache> caches(k);
  if (progress) progress->parts += items;
  parallel_for(items, k, [&](size_t b, size_t worker) {
    uint64_t bytes = 0;
    for (size_t i = starts[b]; i < starts[b + 1]; ++i) {
      encode(docs[i], policy, add_special, caches[worker], out[i]);
      bytes += docs[i].size();
    }
    if (progress) {
      progress->bytes += bytes;
      progress->docs += starts[b + 1] - starts[b];
    }
  }, progress ? &progress->busiest_thread_cpu_ns : nullptr);
  return out;
}

std::vector<int32_t> Tokenizer::encode_large(std::string_view text, SpecialPolicy policy, int threads,
                                             EncodeProgress* progress) const {
  std::vector<size_t> cuts;
  if (impl_->cuttable && threads > 1) cuts = safe_cuts(impl_->pattern, text, item_bytes(text.size(), threads));
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(text.size());
  const size_t parts = cuts.size() - 1;
  const int k = static_cast<int>(std::max<size_t>(1, std::min<size_t>(parts, std::max(threads, 1))));
  std::vector<EncodeCache> caches(k);  // one per thread, kept across its parts: a cache only saves work
  std::vector<std::vector<int32_t>> out(parts);
  if (progress) progress->parts += parts;
  parallel_for(parts, k, [&](size_t i, size_t worker) {
    encode_body(*impl_, text.substr(cuts[i], cuts[i + 1] - cuts[i]), cuts[i], policy, caches[worker].impl(), out[i]);
    if (progress) progress->bytes += cuts[i + 1] - cuts[i];
  }, progress ? &progress->busiest_thread_cpu_ns : nullptr);
  if (progress) progress->docs += 1;
  size_t total = 0;
  for (const auto& o : out) total += o.size();
  std::vector<int32_t> ids;
  ids.reserve(total);
  for (const auto& o : out) ids.insert(ids.end(), o.begin(), o.end());
  return ids;
}

// ---------------------------------------------------------------- decoding, queries

std::string Tokenizer::decode(const int32_t* ids, size_t n) const {
  const Impl& t = *impl_;
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id >= 0 && static_cast<size_t>(id) < t.added_content.size() && !t.added_content[id].empty()) {
      out += t.added_content[id];
    } else if (t.bpe.has_id(id)) {
      out += t.bpe.bytes(id);
    } else {
      throw TokenizerError("decode: token id " + std::to_string(id) + " is not in the vocabulary (" +
                           std::to_string(vocab_size()) + " ids)");
    }
  }
  return out;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->added_content.size()); }

std::optional<int32_t> Tokenizer::token_id(std::string_view text) const {
  for (const auto& a : impl_->added)
    if (a.content == text) return a.id;
  const int32_t id = impl_->bpe.find(text);
  if (id >= 0) return id;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::bos_id() const {
  if (!impl_->prefix.empty()) return impl_->prefix.front();
  for (const char* name : {"<|begin_of_text|>", "<s>"})
    if (auto id = token_id(name)) return id;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::eos_id() const {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
    if (auto id = token_id(name)) return id;
  return std::nullopt;
}

const std::vector<int32_t>& Tokenizer::template_prefix() const { return impl_->prefix; }
const std::vector<int32_t>& Tokenizer::template_suffix() const { return impl_->suffix; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
Pattern Tokenizer::pattern() const { return impl_->pattern; }
const std::string& Tokenizer::kind() const { return impl_->kind; }
const std::string& Tokenizer::sha256() const { return impl_->sha256; }

std::string Tokenizer::describe() const {
  const Impl& t = *impl_;
  std::string s = t.kind + " (" + t.source + "): byte-level BPE, pattern " + pattern_name(t.pattern) + ", " +
                  std::to_string(vocab_size()) + " ids, " + std::to_string(t.bpe.merges()) + " merges, " +
                  std::to_string(t.added.size()) + " added tokens";
  if (t.bpe.ignore_merges()) s += ", ignore_merges";
  if (auto b = bos_id()) s += ", bos " + std::to_string(*b);
  if (auto e = eos_id()) s += ", eos " + std::to_string(*e);
  return s;
}

}  // namespace nnstrain::tok
