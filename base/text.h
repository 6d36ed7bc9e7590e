// Text for messages. Untrusted text (a config key, a file name from a manifest) is quoted as
// at most a short, printable prefix, so a 10 MB key cannot become a 10 MB error.
#pragma once

#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

namespace nnstrain::util {

// "'abc'", or "'abcdef...' (1234 bytes)" when longer than max_chars; control bytes become '?'.
inline std::string quote_prefix(const std::string& text, size_t max_chars = 48) {
  size_t n = text.size() < max_chars ? text.size() : max_chars;
  // Do not cut a UTF-8 sequence in two: back up to its first byte.
  if (n < text.size())
    while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  std::string out = "'";
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c < 0x20 || c == 0x7f) ? '?' : static_cast<char>(c);
  }
  if (n < text.size()) return out + "...' (" + std::to_string(text.size()) + " bytes)";
  return out + "'";
}

// v with digits decimals ("3.14"), as printf's "%.*f" writes it.
inline std::string fixed(double v, int digits) {
  std::ostringstream out;
  out.precision(digits);
  out << std::fixed << v;
  return out.str();
}

// The items with sep between them ("0, 1, 2"), for messages and tables.
template <typename T>
std::string join(const std::vector<T>& items, const std::string& sep) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? sep : "") << items[i];
  return out.str();
}

}  // namespace nnstrain::util
