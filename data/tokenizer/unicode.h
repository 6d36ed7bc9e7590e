// UTF-8 decoding and the three character classes the byte-level BPE pre-tokenizer
// patterns test (\p{L}, \p{N}, \s), from the Unicode 16.0 table that
// gen_unicode_table.py writes into unicode_table.cpp. No LibTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace nnstrain::tok {

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

namespace unicode_table {
extern const unsigned char kStage1[0x110000 >> 8];
extern const unsigned char kBlocks[][64];
}  // namespace unicode_table

inline CharClass char_class(uint32_t cp) {
  const unsigned char* block = unicode_table::kBlocks[unicode_table::kStage1[cp >> 8]];
  return static_cast<CharClass>((block[(cp & 0xFF) >> 2] >> ((cp & 3) * 2)) & 3);
}

// Decodes the code point at p (p < end). Returns its length in bytes, or 0 when the
// bytes there are not well-formed UTF-8 (overlong, surrogate, above U+10FFFF, truncated).
inline int utf8_decode(const unsigned char* p, const unsigned char* end, uint32_t& cp) {
  const unsigned c = p[0];
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  const ptrdiff_t left = end - p;
  if (c >= 0xC2 && c <= 0xDF) {
    if (left < 2 || (p[1] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x1F) << 6) | (p[1] & 0x3F);
    return 2;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    if (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    if (cp < 0x10000 || cp > 0x10FFFF) return 0;
    return 4;
  }
  return 0;
}

// Offset of the first byte that does not start a well-formed UTF-8 sequence, or
// std::string_view::npos when the whole text is valid.
size_t utf8_first_invalid(std::string_view text);

// Appends the UTF-8 encoding of cp (<= U+10FFFF, not a surrogate).
void utf8_append(uint32_t cp, std::string& out);

}  // namespace nnstrain::tok
