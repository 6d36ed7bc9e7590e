#include "data/tokenizer/unicode.h"

#include <string>

namespace nnstrain::tok {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the word-at-a-time scans take the first byte as the lowest");

size_t utf8_first_invalid(std::string_view text) {
  const auto* begin = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = begin + text.size();
  const auto* p = begin;
  while (p < end) {
    // ASCII eight bytes at a time (most text is mostly ASCII), then straight to the
    // first byte that is not: no byte-by-byte walk over a word's ASCII part.
    while (end - p >= 8) {
      uint64_t w;
      __builtin_memcpy(&w, p, 8);
      const uint64_t high = w & 0x8080808080808080ULL;
      if (high) {
        p += __builtin_ctzll(high) >> 3;  // little-endian: the lowest set bit is the first such byte
        break;
      }
      p += 8;
    }
    if (p >= end) break;
    // A run of multi-byte characters (a non-Latin word) without going back to the words.
    while (p < end && *p >= 0x80) {
      uint32_t cp;
      const int n = utf8_decode(p, end, cp);
      if (n == 0) return static_cast<size_t>(p - begin);
      p += n;
    }
    while (p < end && end - p < 8 && *p < 0x80) ++p;  // the tail's ASCII bytes
  }
  return std::string_view::npos;
}

void utf8_append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace nnstrain::tok
