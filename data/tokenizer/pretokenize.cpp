#include "data/tokenizer/pretokenize.h"

#include <algorithm>

#include "data/tokenizer/unicode.h"

namespace nnstrain::tok {

namespace {

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// ASCII classes, so the common case needs no table lookup.
struct AsciiTable {
  CharClass cls[128];
  constexpr AsciiTable() : cls() {
    for (int c = 0; c < 128; ++c) {
      CharClass k = kOther;
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) k = kLetter;
      else if (c >= '0' && c <= '9') k = kNumber;
      else if (c == ' ' || (c >= 0x09 && c <= 0x0D)) k = kSpace;
      cls[c] = k;
    }
  }
};
constexpr AsciiTable kAscii;

struct Char {
  uint32_t cp;
  uint32_t len;
  CharClass cls;
};

// Reads characters of valid UTF-8 text.
class Text {
 public:
  explicit Text(std::string_view t)
      : p_(reinterpret_cast<const unsigned char*>(t.data())), n_(t.size()) {}
  size_t size() const { return n_; }
  Char at(size_t i) const {
    const unsigned c = p_[i];
    if (c < 0x80) return {c, 1, kAscii.cls[c]};
    uint32_t cp = 0;
    int len = utf8_decode(p_ + i, p_ + n_, cp);
    if (len == 0) {  // callers validate first; stay safe if not: one byte of "other"
      return {0xFFFD, 1, kOther};
    }
    return {cp, static_cast<uint32_t>(len), char_class(cp)};
  }
  // End of the run of characters of class `k` starting at i.
  size_t run(size_t i, CharClass k) const {
    while (i < n_) {
      const unsigned c = p_[i];
      if (c < 0x80) {
        if (kAscii.cls[c] != k) break;
        ++i;
        continue;
      }
      const Char ch = at(i);
      if (ch.cls != k) break;
      i += ch.len;
    }
    return i;
  }
  unsigned char byte(size_t i) const { return p_[i]; }

 private:
  const unsigned char* p_;
  size_t n_;
};

bool is_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// \s+(?!\S) then \s+, for a whitespace run starting at i: the run, less its last
// character when more than one and something other than whitespace follows.
size_t whitespace_piece(const Text& t, size_t i) {
  size_t last = i, k = i;
  while (k < t.size()) {
    const Char ch = t.at(k);
    if (ch.cls != kSpace) break;
    last = k;
    k += ch.len;
  }
  if (k == t.size() || last == i) return k;
  return last;
}

inline __attribute__((always_inline)) size_t gpt2_piece(const Text& t, size_t i) {
  const size_t n = t.size();
  const Char c0 = t.at(i);
  if (c0.cp == '\'' && i + 1 < n) {
    const unsigned char b1 = t.byte(i + 1);
    if (b1 == 's' || b1 == 't' || b1 == 'm' || b1 == 'd') return i + 2;
    if (i + 2 < n) {
      const unsigned char b2 = t.byte(i + 2);
      if ((b1 == 'r' && b2 == 'e') || (b1 == 'v' && b2 == 'e') || (b1 == 'l' && b2 == 'l')) return i + 3;
    }
  }
  if (c0.cp == ' ' && i + 1 < n) {  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    const Char c1 = t.at(i + 1);
    if (c1.cls != kSpace) return t.run(i + 1 + c1.len, c1.cls);
  }
  if (c0.cls != kSpace) return t.run(i + c0.len, c0.cls);
  return whitespace_piece(t, i);
}

inline __attribute__((always_inline)) size_t llama3_piece(const Text& t, size_t i) {
  const size_t n = t.size();
  const Char c0 = t.at(i);
  if (c0.cp == '\'' && i + 1 < n) {  // contractions, case-insensitive (U+017F folds to s)
    const Char c1 = t.at(i + 1);
    const uint32_t l1 = c1.cp | (c1.cp < 0x80 ? 0x20 : 0);
    if (l1 == 's' || l1 == 't' || l1 == 'm' || l1 == 'd' || c1.cp == 0x17F) return i + 1 + c1.len;
    if (c1.len == 1 && i + 2 < n) {
      const unsigned char l2 = t.byte(i + 2) | 0x20;
      if ((l1 == 'r' && l2 == 'e') || (l1 == 'v' && l2 == 'e') || (l1 == 'l' && l2 == 'l')) return i + 3;
    }
  }
  if (c0.cls == kLetter) return t.run(i + c0.len, kLetter);
  if (c0.cls != kNumber && !is_newline(c0.cp) && i + c0.len < n) {  // [^\r\n\p{L}\p{N}]?\p{L}+
    const Char c1 = t.at(i + c0.len);
    if (c1.cls == kLetter) return t.run(i + c0.len + c1.len, kLetter);
  }
  if (c0.cls == kNumber) {  // \p{N}{1,3}
    size_t j = i + c0.len;
    for (int k = 1; k < 3 && j < n; ++k) {
      const Char c = t.at(j);
      if (c.cls != kNumber) break;
      j += c.len;
    }
    return j;
  }
  size_t others = std::string_view::npos;  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  if (c0.cls == kOther) {
    others = t.run(i + c0.len, kOther);
  } else if (c0.cp == ' ' && i + 1 < n) {
    const Char c1 = t.at(i + 1);
    if (c1.cls == kOther) others = t.run(i + 1 + c1.len, kOther);
  }
  if (others != std::string_view::npos) {
    while (others < n && (t.byte(others) == '\r' || t.byte(others) == '\n')) ++others;
    return others;
  }
  // Whitespace. \s*[\r\n]+: up to and including the run's last newline.
  size_t k = i, after_newline = 0;
  while (k < n) {
    const Char ch = t.at(k);
    if (ch.cls != kSpace) break;
    k += ch.len;
    if (is_newline(ch.cp)) after_newline = k;
  }
  if (after_newline) return after_newline;
  return whitespace_piece(t, i);
}

}  // namespace

bool pattern_from_regex(const std::string& regex, Pattern& out) {
  if (regex == kGpt2Regex) {
    out = Pattern::gpt2;
    return true;
  }
  if (regex == kLlama3Regex) {
    out = Pattern::llama3;
    return true;
  }
  return false;
}

const char* pattern_name(Pattern p) {
  switch (p) {
    case Pattern::gpt2: return "gpt2";
    case Pattern::llama3: return "llama3";
    default: return "none";
  }
}

const char* pattern_regex(Pattern p) {
  switch (p) {
    case Pattern::gpt2: return kGpt2Regex;
    case Pattern::llama3: return kLlama3Regex;
    default: return "";
  }
}

size_t piece_end(Pattern p, std::string_view text, size_t i) {
  switch (p) {
    case Pattern::gpt2: return gpt2_piece(Text(text), i);
    case Pattern::llama3: return llama3_piece(Text(text), i);
    default: return text.size();
  }
}

size_t piece_ends(Pattern p, std::string_view text, size_t i, size_t* ends, size_t max) {
  const Text t(text);
  const size_t n = text.size();
  size_t k = 0;
  switch (p) {
    case Pattern::gpt2:
      for (; k < max && i < n; ++k) ends[k] = i = gpt2_piece(t, i);
      break;
    case Pattern::llama3:
      for (; k < max && i < n; ++k) ends[k] = i = llama3_piece(t, i);
      break;
    default:
      if (i < n && max > 0) ends[k++] = n;
  }
  return k;
}

void pretokenize(Pattern p, std::string_view text, std::vector<size_t>& ends) {
  for (size_t i = 0; i < text.size();) {
    i = piece_end(p, text, i);
    ends.push_back(i);
  }
}

std::vector<size_t> safe_cuts(Pattern p, std::string_view text, size_t min_gap) {
  std::vector<size_t> cuts;
  if (p == Pattern::none) return cuts;  // the whole text is one piece
  const Text t(text);
  min_gap = std::max<size_t>(min_gap, 2);
  size_t from = min_gap;
  while (from < text.size()) {
    const size_t nl = text.find('\n', from - 1);
    if (nl == std::string_view::npos || nl + 1 >= text.size()) break;
    // A '\n' that ends a whitespace run (something else follows) is a piece of its
    // own under gpt2 (\s+(?!\S) stops before it, \s+ takes it alone) and ends a
    // piece under llama3 (\s*[\r\n]+ or [^\s\p{L}\p{N}]+[\r\n]* stop after it);
    // whatever precedes or follows it is then scanned the same in a part as in the
    // whole (neither pattern looks behind, and a run ending at a part's end ends
    // where it ended in the whole).
    if (t.at(nl + 1).cls != kSpace) {
      const size_t cut = p == Pattern::gpt2 ? nl : nl + 1;
      cuts.push_back(cut);
      from = cut + min_gap;
    } else {
      from = nl + 2;
    }
  }
  return cuts;
}

}  // namespace nnstrain::tok
