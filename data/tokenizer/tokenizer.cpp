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
  const unsigned char first = static_cast<unsigned char>(t->content[0]);
  if (!is_first_[first]) {
    is_first_[first] = true;
    ++first_bytes_;
    first_ = first;
  }
  auto& bucket = by_first_[first];
  bucket.push_back(t);
  std::stable_sort(bucket.begin(), bucket.end(),
                   [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
}

bool AddedMatcher::find(std::string_view text, size_t from, size_t& at, const AddedToken*& which) const {
  if (tokens_.empty()) return false;
  const char* const data = text.data();
  for (size_t i = from; i < text.size(); ++i) {
    if (first_bytes_ == 1) {  // GPT-2's and Llama 3's tokens all start with '<'
      const void* hit = std::memchr(data + i, first_, text.size() - i);
      if (!hit) return false;
      i = static_cast<const char*>(hit) - data;
    } else if (!is_first_[static_cast<unsigned char>(data[i])]) {
      continue;
    }
    for (const AddedToken* t : by_first_[static_cast<unsigned char>(data[i])]) {
      const std::string& c = t->content;
      if (c.size() <= text.size() - i && std::memcmp(data + i, c.data(), c.size()) == 0) {
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

namespace {

constexpr size_t kPieceBatch = 256;  // piece ends the pre-tokenizer finds per call

// Pieces of at most 16 bytes (nearly all of a text's) keyed by their bytes in two
// zero-padded words: a lookup is a multiply and two compares, no memcmp, no arena.
// One id (the common case: a whole word is a token) is held in the slot.
class ShortPieceCache {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "key() masks a word's first bytes as its lowest");

 public:
  static constexpr size_t kMaxBytes = 16;
  static constexpr size_t kMaxPieces = 1 << 17;  // then cleared: bounded memory (4 MiB of slots)

  // The two words of p[0, n) (n <= 16); `room`: bytes readable from p (whole words
  // are loaded when there is room, then masked).
  static void key(const char* p, size_t n, size_t room, uint64_t& k0, uint64_t& k1) {
    if (room >= 16) {
      std::memcpy(&k0, p, 8);
      std::memcpy(&k1, p + 8, 8);
    } else {
      char buf[16] = {};
      std::memcpy(buf, p, n);
      std::memcpy(&k0, buf, 8);
      std::memcpy(&k1, buf + 8, 8);
      return;
    }
    if (n <= 8) {
      k0 &= n == 8 ? ~0ULL : ((1ULL << (8 * n)) - 1);
      k1 = 0;
    } else if (n < 16) {
      k1 &= (1ULL << (8 * (n - 8))) - 1;
    }
  }
  // The ids of the piece, or false; a hit sets `ids` and `count`.
  bool find(uint64_t k0, uint64_t k1, uint32_t n, const int32_t*& ids, uint32_t& count) const {
    if (slots_.empty()) return false;
    for (size_t i = index(k0, k1, n);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.meta == 0) return false;
      if (s.k0 == k0 && s.k1 == k1 && (s.meta & 0xFF) == n) {
        count = s.meta >> 8;
        ids = count == 1 ? &s.value : ids_.data() + s.value;
        return true;
      }
    }
  }
  // Starts loading the slot a find will look at first (the table outgrows the L2 cache:
  // a batch of pieces' loads then overlap instead of waiting one after another).
  void prefetch(uint64_t k0, uint64_t k1, uint32_t n) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[index(k0, k1, n)]);
  }
  void put(uint64_t k0, uint64_t k1, uint32_t n, const int32_t* ids, uint32_t count) {
    if (used_ >= kMaxPieces) clear();
    if ((used_ + 1) * 4 >= slots_.size() * 3) grow();
    size_t i = index(k0, k1, n);
    while (slots_[i].meta != 0) i = (i + 1) & mask_;
    Slot& s = slots_[i];
    s.k0 = k0;
    s.k1 = k1;
    s.meta = n | (count << 8);
    if (count == 1) {
      s.value = ids[0];
    } else {
      s.value = static_cast<int32_t>(ids_.size());
      ids_.insert(ids_.end(), ids, ids + count);
    }
    ++used_;
  }
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    ids_.clear();
    used_ = 0;
  }

 private:
  struct Slot {
    uint64_t k0 = 0, k1 = 0;
    uint32_t meta = 0;  // 0: empty; else length (1..16) | id count << 8
    int32_t value = 0;  // the id (count 1) or the offset of the ids in ids_
  };
  size_t index(uint64_t k0, uint64_t k1, uint32_t n) const {
    uint64_t h = (k0 ^ n) * 0x9E3779B97F4A7C15ULL;
    h ^= (k1 + (h >> 29)) * 0xBF58476D1CE4E5B9ULL;
    return (h ^ (h >> 32)) & mask_;
  }
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.empty() ? 4096 : old.size() * 2, Slot{});
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.meta == 0) continue;
      size_t i = index(s.k0, s.k1, s.meta & 0xFF);
      while (slots_[i].meta != 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  std::vector<int32_t> ids_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

}  // namespace

struct EncodeCache::Impl {
  const void* owner = nullptr;
  ShortPieceCache short_pieces;
  // Longer pieces: piece -> (offset, count) in ids: 32 bits do, as the cache holds at
  // most kCacheMaxPieces pieces of at most kCachedPieceMax bytes.
  StringMap<std::pair<uint32_t, uint32_t>> pieces;
  std::vector<int32_t> ids;
  std::string scratch;
  std::vector<size_t> ends;  // a batch of piece ends (pretokenize.h: piece_ends)
  uint64_t k0[kPieceBatch], k1[kPieceBatch];  // the batch's short pieces' keys
  void clear() {
    short_pieces.clear();
    pieces.clear();
    ids.clear();
  }
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
  // Pieces a batch at a time (size_t offsets, no list of a long text's pieces): a
  // text of any size, however many pieces it has.
  const char* const data = text.data();
  const size_t size = text.size();
  std::vector<size_t>& ends = c.ends;
  ends.resize(kPieceBatch);
  for (size_t begin = 0; begin < size;) {
    const size_t got = piece_ends(t.pattern, text, begin, ends.data(), kPieceBatch);
    // The short pieces' keys first, their slots prefetched; then the lookups.
    for (size_t e = 0, b = begin; e < got; b = ends[e++]) {
      const size_t len = ends[e] - b;
      if (len < 2 || len > ShortPieceCache::kMaxBytes) continue;
      ShortPieceCache::key(data + b, len, size - b, c.k0[e], c.k1[e]);
      c.short_pieces.prefetch(c.k0[e], c.k1[e], static_cast<uint32_t>(len));
    }
    for (size_t e = 0; e < got; ++e) {
      const size_t end = ends[e];
      const size_t len = end - begin;
      const char* p = data + begin;
      if (len <= ShortPieceCache::kMaxBytes) {
        if (len == 1) {  // a single byte is its byte's token
          out.push_back(t.bpe.byte_id(static_cast<unsigned char>(*p)));
          begin = end;
          continue;
        }
        const uint64_t k0 = c.k0[e], k1 = c.k1[e];
        const int32_t* hit;
        uint32_t count;
        if (c.short_pieces.find(k0, k1, static_cast<uint32_t>(len), hit, count)) {
          if (count == 1) {
            out.push_back(*hit);
          } else {
            const size_t at = out.size();
            out.resize(at + count);
            std::memcpy(out.data() + at, hit, count * sizeof(int32_t));
          }
        } else {
          const size_t first = out.size();
          t.bpe.encode(std::string_view(p, len), out);
          c.short_pieces.put(k0, k1, static_cast<uint32_t>(len), out.data() + first,
                             static_cast<uint32_t>(out.size() - first));
        }
        begin = end;
        continue;
      }
      const std::string_view piece(p, len);
      begin = end;
      if (piece.size() > BpeModel::kMaxPiece)
        throw TokenizerError("a pre-tokenized piece of " + std::to_string(piece.size()) + " bytes at byte " +
                             std::to_string(base + (p - data) - std::min<size_t>(p - data, shift)) +
                             ": BPE encodes pieces of at most " + std::to_string(BpeModel::kMaxPiece) +
                             " bytes (2^31 - 1)");
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
}

void encode_body(const Tokenizer::Impl& t, std::string_view text, size_t base, SpecialPolicy policy,
                 EncodeCache::Impl& c, std::vector<int32_t>& out) {
  if (const size_t bad = utf8_first_invalid(text); bad != std::string_view::npos)
    throw TokenizerError("text is not valid UTF-8 at byte " + std::to_string(base + bad));
  if (c.owner != &t) {  // a cache serves one tokenizer
    c.clear();
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
    // Room for the ids of most text (GPT-2 on the multilingual corpus: 0.57 ids a
    // byte), so the vector rarely grows by copying; at most 1 GiB held in advance.
    out[i].reserve(std::min<size_t>((cuts[i + 1] - cuts[i]) / 3 * 2 + 16, size_t(1) << 28));
    encode_body(*impl_, text.substr(cuts[i], cuts[i + 1] - cuts[i]), cuts[i], policy, caches[worker].impl(), out[i]);
    if (progress) progress->bytes += cuts[i + 1] - cuts[i];
  }, progress ? &progress->busiest_thread_cpu_ns : nullptr);
  if (progress) progress->docs += 1;
  if (parts == 1) return std::move(out[0]);
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
