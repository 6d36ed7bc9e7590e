#include "data/chat/jinja_lexer.h"

#include <cctype>

#include "data/chat/jinja_value.h"

namespace nnstrain::jinja {

namespace {

struct Lexer {
  const std::string& src;
  LexOptions opt;
  std::vector<Token> out;
  std::vector<size_t> line_starts{0};
  size_t pos = 0;
  bool line_starting = true;  // the last tag's text ended with a newline (or nothing came before)

  Lexer(const std::string& s, const LexOptions& o) : src(s), opt(o) {
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i] == '\n') line_starts.push_back(i + 1);
  }

  std::pair<int, int> where(size_t at) const {
    size_t lo = 0, hi = line_starts.size();
    while (hi - lo > 1) {
      const size_t mid = (lo + hi) / 2;
      (line_starts[mid] <= at ? lo : hi) = mid;
    }
    return {int(lo + 1), int(utf8_length(src.substr(line_starts[lo], at - line_starts[lo])) + 1)};
  }
  [[noreturn]] void fail(const std::string& what, size_t at) const {
    auto [l, c] = where(at);
    throw Error(what, l, c);
  }
  void push(Token::K k, std::string v, size_t at) {
    auto [l, c] = where(at);
    out.push_back({k, std::move(v), l, c});
  }

  // Template text: newlines normalised as jinja2 does ("\r\n" and "\r" to "\n").
  void text(std::string t, size_t at) {
    std::string n;
    n.reserve(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] == '\r') {
        n += '\n';
        if (i + 1 < t.size() && t[i + 1] == '\n') ++i;
      } else {
        n += t[i];
      }
    }
    if (!n.empty()) push(Token::K::text, std::move(n), at);
  }

  static bool space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

  // Where the next tag starts ({{, {% or {#), or npos.
  size_t next_tag(size_t from) const {
    for (size_t i = src.find('{', from); i != std::string::npos; i = src.find('{', i + 1))
      if (i + 1 < src.size() && (src[i + 1] == '{' || src[i + 1] == '%' || src[i + 1] == '#')) return i;
    return std::string::npos;
  }

  // The text before a tag starting at `tag`, whitespace control applied.
  void text_before(size_t start, size_t tag) {
    std::string t = src.substr(start, tag - start);
    const char kind = src[tag + 1];
    const char mod = tag + 2 < src.size() ? src[tag + 2] : 0;
    if (mod == '-') {
      size_t e = t.size();
      while (e > 0 && space(t[e - 1])) --e;
      t.resize(e);
    } else if (opt.lstrip_blocks && kind != '{' && mod != '+') {
      const size_t nl = t.rfind('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      if (nl != std::string::npos || line_starting) {
        bool blank = true;
        for (size_t i = from; i < t.size(); ++i) blank = blank && (t[i] == ' ' || t[i] == '\t');
        if (blank) t.resize(from);
      }
    }
    text(std::move(t), start);
  }

  // After a tag's closing delimiter at `end` (its length `n`, `mod` the char
  // before it): the position where text resumes.
  size_t after_tag(size_t end, size_t n, char mod, bool block) {
    size_t p = end + n;
    if (mod == '-') {
      while (p < src.size() && space(src[p])) ++p;
    } else if (block && opt.trim_blocks && mod != '+' && p < src.size() && src[p] == '\n') {
      ++p;
    } else if (block && opt.trim_blocks && mod != '+' && p + 1 < src.size() && src[p] == '\r' && src[p + 1] == '\n') {
      p += 2;
    }
    line_starting = p > 0 && p <= src.size() && (p == end + n ? false : src[p - 1] == '\n');
    return p;
  }

  void run() {
    size_t p = 0;
    while (p < src.size()) {
      const size_t tag = next_tag(p);
      if (tag == std::string::npos) {
        text(src.substr(p), p);
        break;
      }
      text_before(p, tag);
      const char kind = src[tag + 1];
      size_t q = tag + 2;
      if (q < src.size() && (src[q] == '-' || src[q] == '+')) ++q;
      if (kind == '#') {
        const size_t e = src.find("#}", q);
        if (e == std::string::npos) fail("a comment is not closed (#} missing)", tag);
        const char mod = e > q && (src[e - 1] == '-' || src[e - 1] == '+') ? src[e - 1] : 0;
        p = after_tag(e, 2, mod, true);
        continue;
      }
      push(kind == '{' ? Token::K::var_begin : Token::K::block_begin, "", tag);
      const size_t first_token = out.size();
      p = expression(q, kind == '{');
      // {% raw %}: everything up to {% endraw %} is text.
      if (kind == '%' && out.size() == first_token + 2 && out[first_token].kind == Token::K::name &&
          out[first_token].value == "raw") {
        out.resize(first_token - 1);
        size_t e = p;
        while (true) {
          e = src.find("{%", e);
          if (e == std::string::npos) fail("{% raw %} is not closed ({% endraw %} missing)", tag);
          size_t k = e + 2;
          if (k < src.size() && (src[k] == '-' || src[k] == '+')) ++k;
          while (k < src.size() && space(src[k])) ++k;
          if (src.compare(k, 6, "endraw") == 0) break;
          e += 2;
        }
        std::string body = src.substr(p, e - p);
        if (src[e + 2] == '-') {
          size_t n = body.size();
          while (n > 0 && space(body[n - 1])) --n;
          body.resize(n);
        }
        text(std::move(body), p);
        const size_t close = src.find("%}", e);
        if (close == std::string::npos) fail("{% endraw is not closed", e);
        const char mod = src[close - 1] == '-' || src[close - 1] == '+' ? src[close - 1] : 0;
        p = after_tag(close, 2, mod, true);
      }
    }
    push(Token::K::eof, "", src.size());
  }

  // Tokens of one tag's inside from `p`; returns where text resumes.
  size_t expression(size_t p, bool var) {
    std::vector<char> brackets;
    const char* close = var ? "}}" : "%}";
    while (true) {
      while (p < src.size() && space(src[p])) ++p;
      if (p >= src.size()) fail(var ? "a {{ ... }} is not closed" : "a {% ... %} is not closed", p);
      const char c = src[p];
      if (brackets.empty()) {
        // -}} / -%} / +%} / }} / %}
        if ((c == '-' || c == '+') && src.compare(p + 1, 2, close) == 0) {
          push(var ? Token::K::var_end : Token::K::block_end, "", p);
          return after_tag(p + 1, 2, c, !var);
        }
        if (src.compare(p, 2, close) == 0) {
          push(var ? Token::K::var_end : Token::K::block_end, "", p);
          return after_tag(p, 2, 0, !var);
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src.size() && (std::isalnum(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
        push(Token::K::name, src.substr(p, e - p), p);
        p = e;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        p = number(p);
        continue;
      }
      if (c == '\'' || c == '"') {
        p = string(p);
        continue;
      }
      static const char* two[] = {"==", "!=", ">=", "<=", "//", "**"};
      bool matched = false;
      for (const char* t : two)
        if (src.compare(p, 2, t) == 0) {
          push(Token::K::op, t, p);
          p += 2;
          matched = true;
          break;
        }
      if (matched) continue;
      if (std::string("+-*/%~<>=.,:|()[]{}").find(c) == std::string::npos)
        fail(std::string("unexpected character '") + c + "'", p);
      if (c == '(' || c == '[' || c == '{') brackets.push_back(c);
      if (c == ')' || c == ']' || c == '}') {
        const char want = c == ')' ? '(' : c == ']' ? '[' : '{';
        if (brackets.empty() || brackets.back() != want) fail(std::string("unexpected '") + c + "'", p);
        brackets.pop_back();
      }
      push(Token::K::op, std::string(1, c), p);
      ++p;
    }
  }

  size_t number(size_t p) {
    size_t e = p;
    auto digits = [&] {
      while (e < src.size() && (std::isdigit(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < src.size() && src[e] == '.' && std::isdigit(static_cast<unsigned char>(src[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < src.size() && (src[e] == 'e' || src[e] == 'E')) {
      size_t k = e + 1;
      if (k < src.size() && (src[k] == '+' || src[k] == '-')) ++k;
      if (k < src.size() && std::isdigit(static_cast<unsigned char>(src[k]))) {
        is_float = true;
        e = k;
        digits();
      }
    }
    std::string v;
    for (size_t i = p; i < e; ++i)
      if (src[i] != '_') v += src[i];
    push(is_float ? Token::K::floating : Token::K::integer, v, p);
    return e;
  }

  // A quoted literal with Python's escapes (jinja2 decodes them as unicode-escape).
  size_t string(size_t p) {
    const char q = src[p];
    std::string v;
    size_t i = p + 1;
    auto hexval = [&](size_t at, int n) -> uint32_t {
      uint32_t x = 0;
      for (int k = 0; k < n; ++k) {
        if (at + size_t(k) >= src.size() || !std::isxdigit(static_cast<unsigned char>(src[at + size_t(k)])))
          fail("a truncated escape in a string", at);
        const char h = src[at + size_t(k)];
        x = x * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : std::tolower(h) - 'a' + 10);
      }
      return x;
    };
    while (true) {
      if (i >= src.size()) fail("a string is not closed", p);
      const char c = src[i];
      if (c == q) break;
      if (c != '\\') {
        v += c;
        ++i;
        continue;
      }
      if (i + 1 >= src.size()) fail("a string is not closed", p);
      const char e = src[i + 1];
      i += 2;
      switch (e) {
        case 'n': v += '\n'; break;
        case 't': v += '\t'; break;
        case 'r': v += '\r'; break;
        case '\\': v += '\\'; break;
        case '\'': v += '\''; break;
        case '"': v += '"'; break;
        case 'a': v += '\a'; break;
        case 'b': v += '\b'; break;
        case 'f': v += '\f'; break;
        case 'v': v += '\v'; break;
        case '\n': break;  // a line continuation
        case 'x': utf8_append(v, hexval(i, 2)), i += 2; break;
        case 'u': utf8_append(v, hexval(i, 4)), i += 4; break;
        case 'U': utf8_append(v, hexval(i, 8)), i += 8; break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t x = uint32_t(e - '0');
            for (int k = 0; k < 2 && i < src.size() && src[i] >= '0' && src[i] <= '7'; ++k, ++i) x = x * 8 + uint32_t(src[i] - '0');
            utf8_append(v, x);
          } else {
            v += '\\';
            v += e;
          }
      }
    }
    push(Token::K::string, std::move(v), p);
    return i + 1;
  }
};

}  // namespace

std::vector<Token> lex(const std::string& source, const LexOptions& options) {
  // jinja2 drops one trailing newline of the source (keep_trailing_newline=False).
  std::string s = source;
  if (!s.empty() && s.back() == '\n') {
    s.pop_back();
    if (!s.empty() && s.back() == '\r') s.pop_back();
  } else if (!s.empty() && s.back() == '\r') {
    s.pop_back();
  }
  Lexer l(s, options);
  l.run();
  return std::move(l.out);
}

}  // namespace nnstrain::jinja
