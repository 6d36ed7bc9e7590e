#include "data/chat/jinja_strings.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string_view>

namespace nnstrain::jinja {

namespace {

// Method dispatch: the sizes first, then a compare of a size the compiler knows.
template <size_t N>
inline bool jinja_strings_is(const std::string& s, const char (&lit)[N]) {
  return s.size() == N - 1 && std::memcmp(s.data(), lit, N - 1) == 0;
}

[[noreturn]] void fail(const std::string& what) { throw Error(what); }

bool in_chars(uint32_t cp, const std::string& chars) {
  for (size_t i = 0; i < chars.size();) {
    auto [c, n] = utf8_decode(chars, i);
    if (c == cp) return true;
    i += n;
  }
  return false;
}

// Byte offset -> code-point index.
int64_t cp_index(const std::string& s, size_t byte) { return int64_t(utf8_length(s.substr(0, byte))); }

// A code-point position (Python's start/end argument, negative from the end) -> byte offset.
size_t byte_at(const std::string& s, const Value* v, bool is_end) {
  const auto off = utf8_offsets(s);
  const int64_t n = int64_t(off.size()) - 1;
  if (!v || v->is_none()) return is_end ? s.size() : 0;
  if (!v->is_int()) fail("slice indices must be integers or None");
  int64_t i = v->as_int();
  if (i < 0) i += n;
  i = std::clamp<int64_t>(i, 0, n);
  return off[size_t(i)];
}

std::string str_arg(const CallArgs& a, size_t i, const char* key, const std::string& method) {
  const Value* v = a.get(i, key);
  if (!v) fail(method + "() is missing an argument");
  if (!v->is_string()) fail(method + "() argument must be str, not " + v->type_name());
  return v->str();
}

bool is_cased_lower(char c) { return c >= 'a' && c <= 'z'; }
bool is_cased_upper(char c) { return c >= 'A' && c <= 'Z'; }

std::string pad(const std::string& s, int64_t width, const std::string& fill, char how) {
  const int64_t n = int64_t(utf8_length(s));
  if (width <= n) return s;
  const int64_t total = width - n;
  int64_t left = how == 'l' ? 0 : how == 'r' ? total : total / 2 + (total & width & 1);
  int64_t right = total - left;
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < right; ++i) out += fill;
  return out;
}

std::string format_method(const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      out += '}';
      ++i;
      continue;
    }
    if (c == '}') fail("Single '}' encountered in format string");
    if (c != '{') {
      out += c;
      continue;
    }
    const size_t close = fmt.find('}', i);
    if (close == std::string::npos) fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    char conv = 0;
    std::string spec;
    if (const size_t colon = field.find(':'); colon != std::string::npos) spec = field.substr(colon + 1), field.resize(colon);
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conv = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    const Value* v = nullptr;
    if (field.empty()) {
      v = auto_index < a.pos.size() ? &a.pos[auto_index] : nullptr;
      ++auto_index;
    } else if (std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
      const size_t k = size_t(std::stoul(field));
      v = k < a.pos.size() ? &a.pos[k] : nullptr;
    } else {
      for (const auto& [k, x] : a.kw)
        if (k == field) v = &x;
      if (!v) fail("KeyError: '" + field + "'");
    }
    if (!v) fail("Replacement index out of range for positional args tuple");
    if (!spec.empty()) fail("format specifications ('" + spec + "') are not supported in str.format");
    out += conv == 'r' ? v->repr() : v->to_str();
  }
  return out;
}

}  // namespace

std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  auto drop = [&](uint32_t cp) { return chars ? in_chars(cp, *chars) : is_py_space(cp); };
  size_t begin = 0, end = s.size();
  if (left)
    while (begin < end) {
      auto [cp, n] = utf8_decode(s, begin);
      if (!drop(cp)) break;
      begin += n;
    }
  if (right)
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
      auto [cp, n] = utf8_decode(s, start);
      if (start + n != end || !drop(cp)) break;
      end = start;
    }
  return s.substr(begin, end - begin);
}

std::vector<std::string> py_split(const std::string& s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t at = 0;
    while (maxsplit < 0 || int64_t(out.size()) < maxsplit) {
      const size_t k = s.find(*sep, at);
      if (k == std::string::npos) break;
      out.push_back(s.substr(at, k - at));
      at = k + sep->size();
    }
    out.push_back(s.substr(at));
    return out;
  }
  size_t i = 0;
  while (true) {
    while (i < s.size()) {
      auto [cp, n] = utf8_decode(s, i);
      if (!is_py_space(cp)) break;
      i += n;
    }
    if (i >= s.size()) break;
    if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) {
      out.push_back(py_strip(s.substr(i), nullptr, false, true));
      break;
    }
    size_t j = i;
    while (j < s.size()) {
      auto [cp, n] = utf8_decode(s, j);
      if (is_py_space(cp)) break;
      j += n;
    }
    out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

namespace {

std::vector<std::string> py_rsplit(const std::string& s, const std::string* sep, int64_t maxsplit) {
  if (maxsplit < 0) return py_split(s, sep, -1);
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    size_t end = s.size();
    while (int64_t(out.size()) < maxsplit) {
      if (end < sep->size()) break;
      const size_t k = s.rfind(*sep, end - sep->size());
      if (k == std::string::npos) break;
      out.push_back(s.substr(k + sep->size(), end - k - sep->size()));
      end = k;
    }
    out.push_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  std::string rest = py_strip(s, nullptr, false, true);
  while (!rest.empty() && int64_t(out.size()) < maxsplit) {
    size_t j = rest.size();
    while (j > 0) {
      size_t st = j - 1;
      while (st > 0 && (static_cast<unsigned char>(rest[st]) & 0xc0) == 0x80) --st;
      if (is_py_space(utf8_decode(rest, st).first)) break;
      j = st;
    }
    out.push_back(rest.substr(j));
    rest = py_strip(rest.substr(0, j), nullptr, false, true);
  }
  if (!rest.empty()) out.push_back(rest);
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  while (i < s.size()) {
    auto [cp, n] = utf8_decode(s, i);
    size_t brk = 0;
    if (cp == '\r' && i + 1 < s.size() && s[i + 1] == '\n') brk = 2;
    else if (cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || cp == 0x1c || cp == 0x1d || cp == 0x1e ||
             cp == 0x85 || cp == 0x2028 || cp == 0x2029)
      brk = n;
    if (brk) {
      out.push_back(s.substr(start, (keepends ? i + brk : i) - start));
      i += brk;
      start = i;
    } else {
      i += n;
    }
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

std::string ascii_lower(std::string s) {
  for (auto& c : s)
    if (is_cased_upper(c)) c = char(c - 'A' + 'a');
  return s;
}

std::string ascii_upper(std::string s) {
  for (auto& c : s)
    if (is_cased_lower(c)) c = char(c - 'a' + 'A');
  return s;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty() && is_cased_lower(out[0])) out[0] = char(out[0] - 'a' + 'A');
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string percent_format(const std::string& fmt, const Value& args) {
  List vals = args.is_tuple() ? args.list() : List{args};  // Python: only a tuple is the arguments
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    size_t j = i + 1;
    std::string spec = "%";
    while (j < fmt.size() && std::string("-+ 0#").find(fmt[j]) != std::string::npos) spec += fmt[j++];
    while (j < fmt.size() && ((fmt[j] >= '0' && fmt[j] <= '9') || fmt[j] == '.')) spec += fmt[j++];
    if (j >= fmt.size()) fail("incomplete format");
    const char conv = fmt[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= vals.size()) fail("not enough arguments for format string");
    const Value& v = vals[next++];
    char buf[512];
    if (conv == 's' || conv == 'r') {
      const std::string text = conv == 's' ? v.to_str() : v.repr();
      std::snprintf(buf, sizeof buf, (spec + "s").c_str(), text.c_str());
      out += text.size() < 400 ? std::string(buf) : text;
    } else if (conv == 'd' || conv == 'i' || conv == 'x' || conv == 'X' || conv == 'o') {
      if (!v.is_number()) fail("%" + std::string(1, conv) + " format: a real number is required, not " + v.type_name());
      std::snprintf(buf, sizeof buf, (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(),
                    static_cast<long long>(v.is_int() ? v.as_int() : int64_t(v.as_double())));
      out += buf;
    } else if (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'E' || conv == 'g' || conv == 'G') {
      if (!v.is_number()) fail("must be real number, not " + v.type_name());
      std::snprintf(buf, sizeof buf, (spec + conv).c_str(), v.as_double());
      out += buf;
    } else {
      fail(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (next < vals.size() && args.is_list()) fail("not all arguments converted during string formatting");
  return out;
}

bool is_string_method(const std::string& n) {
  static const char* names[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith",
                                "endswith", "replace", "lower", "upper", "title", "capitalize", "find", "rfind",
                                "index", "rindex", "count", "join", "format", "isdigit", "isalpha", "isalnum",
                                "isspace", "islower", "isupper", "isnumeric", "isdecimal", "zfill", "ljust",
                                "rjust", "center", "partition", "rpartition", "removeprefix", "removesuffix",
                                "swapcase", "casefold"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

Value call_string_method(const std::string& s, const std::string& name, CallArgs& a) {
  auto opt_str = [&](size_t i, const char* key) -> const std::string* {
    const Value* v = a.get(i, key);
    if (!v || v->is_none()) return nullptr;
    if (!v->is_string()) fail(name + "() argument must be str or None, not " + v->type_name());
    return &v->str();
  };
  auto to_list = [](const std::vector<std::string>& parts) {
    List l;
    l.reserve(parts.size());
    for (const auto& p : parts) l.emplace_back(p);
    return Value(std::move(l));
  };
  if (jinja_strings_is(name, "strip") || jinja_strings_is(name, "lstrip") || jinja_strings_is(name, "rstrip"))
    return Value(py_strip(s, opt_str(0, "chars"), name[0] != 'r', name[0] != 'l'));
  if (jinja_strings_is(name, "split") || jinja_strings_is(name, "rsplit")) {
    const Value* m = a.get(1, "maxsplit");
    const int64_t maxsplit = m ? m->as_int() : -1;
    return to_list(jinja_strings_is(name, "split") ? py_split(s, opt_str(0, "sep"), maxsplit) : py_rsplit(s, opt_str(0, "sep"), maxsplit));
  }
  if (jinja_strings_is(name, "splitlines")) {
    const Value* k = a.get(0, "keepends");
    return to_list(py_splitlines(s, k && k->truthy()));
  }
  if (jinja_strings_is(name, "startswith") || jinja_strings_is(name, "endswith")) {
    const Value* p = a.get(0, "prefix");
    if (!p) fail(name + "() takes at least 1 argument");
    const size_t b = byte_at(s, a.get(1, "start"), false), e = byte_at(s, a.get(2, "end"), true);
    const std::string sub = b <= e ? s.substr(b, e - b) : std::string();
    const List options = p->is_list() ? p->list() : List{*p};
    for (const auto& o : options) {
      if (!o.is_string()) fail(name + " first arg must be str or a tuple of str, not " + o.type_name());
      const auto& x = o.str();
      if (b > e) continue;
      if (jinja_strings_is(name, "startswith") ? sub.compare(0, x.size(), x) == 0 && sub.size() >= x.size()
                               : sub.size() >= x.size() && sub.compare(sub.size() - x.size(), x.size(), x) == 0)
        return Value(true);
    }
    return Value(false);
  }
  if (jinja_strings_is(name, "replace")) {
    const std::string old = str_arg(a, 0, "old", name), rep = str_arg(a, 1, "new", name);
    const Value* c = a.get(2, "count");
    int64_t count = c ? c->as_int() : -1;
    std::string out;
    if (old.empty()) {
      const auto off = utf8_offsets(s);
      for (size_t i = 0; i + 1 < off.size(); ++i) {
        if (count != 0) out += rep, --count;
        out.append(s, off[i], off[i + 1] - off[i]);
      }
      if (count != 0) out += rep;
      return Value(std::move(out));
    }
    size_t at = 0;
    while (count != 0) {
      const size_t k = s.find(old, at);
      if (k == std::string::npos) break;
      out.append(s, at, k - at);
      out += rep;
      at = k + old.size();
      --count;
    }
    out.append(s, at, std::string::npos);
    return Value(std::move(out));
  }
  if (jinja_strings_is(name, "lower") || jinja_strings_is(name, "casefold")) return Value(ascii_lower(s));
  if (jinja_strings_is(name, "upper")) return Value(ascii_upper(s));
  if (jinja_strings_is(name, "capitalize")) return Value(capitalize(s));
  if (jinja_strings_is(name, "swapcase")) {
    std::string out = s;
    for (auto& c : out) c = is_cased_lower(c) ? char(c - 32) : is_cased_upper(c) ? char(c + 32) : c;
    return Value(std::move(out));
  }
  if (jinja_strings_is(name, "title")) {
    std::string out = s;
    bool prev_cased = false;
    for (auto& c : out) {
      const bool cased = is_cased_lower(c) || is_cased_upper(c);
      if (cased) c = prev_cased ? (is_cased_upper(c) ? char(c + 32) : c) : (is_cased_lower(c) ? char(c - 32) : c);
      prev_cased = cased;
    }
    return Value(std::move(out));
  }
  if (jinja_strings_is(name, "find") || jinja_strings_is(name, "rfind") || jinja_strings_is(name, "index") || jinja_strings_is(name, "rindex") || jinja_strings_is(name, "count")) {
    const std::string sub = str_arg(a, 0, "sub", name);
    const size_t b = byte_at(s, a.get(1, "start"), false), e = byte_at(s, a.get(2, "end"), true);
    if (jinja_strings_is(name, "count")) {
      if (b > e) return Value(int64_t(0));
      const std::string hay = s.substr(b, e - b);
      if (sub.empty()) return Value(int64_t(utf8_length(hay)) + 1);
      int64_t n = 0;
      for (size_t k = hay.find(sub); k != std::string::npos; k = hay.find(sub, k + sub.size())) ++n;
      return Value(n);
    }
    size_t k = std::string::npos;
    if (b <= e && e - b >= sub.size()) {
      const std::string hay = s.substr(b, e - b);
      k = name[0] == 'r' ? hay.rfind(sub) : hay.find(sub);
    }
    if (k == std::string::npos) {
      if (jinja_strings_is(name, "index") || jinja_strings_is(name, "rindex")) fail("substring not found");
      return Value(int64_t(-1));
    }
    return Value(cp_index(s, b + k));
  }
  if (jinja_strings_is(name, "join")) {
    const Value* it = a.get(0, "iterable");
    if (!it) fail("join() takes exactly one argument");
    List items;
    if (it->is_list()) items = it->list();
    else if (it->is_string()) {
      const auto off = utf8_offsets(it->str());
      for (size_t i = 0; i + 1 < off.size(); ++i) items.emplace_back(it->str().substr(off[i], off[i + 1] - off[i]));
    } else if (it->is_dict()) {
      for (const auto& kv : it->map().items) items.push_back(kv.first);
    } else {
      fail("can only join an iterable");
    }
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string())
        fail("sequence item " + std::to_string(i) + ": expected str instance, " + items[i].type_name() + " found");
      if (i) out += s;
      out += items[i].str();
    }
    return Value(std::move(out));
  }
  if (jinja_strings_is(name, "format")) return Value(format_method(s, a));
  if (jinja_strings_is(name, "isdigit") || jinja_strings_is(name, "isnumeric") || jinja_strings_is(name, "isdecimal") || jinja_strings_is(name, "isalpha") || jinja_strings_is(name, "isalnum") ||
      jinja_strings_is(name, "isspace")) {
    if (s.empty()) return Value(false);
    for (size_t i = 0; i < s.size();) {
      auto [cp, n] = utf8_decode(s, i);
      const bool digit = cp >= '0' && cp <= '9';
      const bool alpha = (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= 0xc0 && !is_py_space(cp));
      bool ok = jinja_strings_is(name, "isspace") ? is_py_space(cp) : jinja_strings_is(name, "isalpha") ? alpha : jinja_strings_is(name, "isalnum") ? alpha || digit : digit;
      if (!ok) return Value(false);
      i += n;
    }
    return Value(true);
  }
  if (jinja_strings_is(name, "islower") || jinja_strings_is(name, "isupper")) {
    bool any = false;
    for (char c : s) {
      if (jinja_strings_is(name, "islower") ? is_cased_upper(c) : is_cased_lower(c)) return Value(false);
      any = any || is_cased_lower(c) || is_cased_upper(c);
    }
    return Value(any);
  }
  if (jinja_strings_is(name, "zfill") || jinja_strings_is(name, "ljust") || jinja_strings_is(name, "rjust") || jinja_strings_is(name, "center")) {
    const Value* w = a.get(0, "width");
    if (!w || !w->is_int()) fail(name + "() needs an integer width");
    if (jinja_strings_is(name, "zfill")) {
      const int64_t n = int64_t(utf8_length(s));
      if (w->as_int() <= n) return Value(s);
      const bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
      return Value((sign ? s.substr(0, 1) : "") + std::string(size_t(w->as_int() - n), '0') + s.substr(sign ? 1 : 0));
    }
    const std::string* fill = opt_str(1, "fillchar");
    return Value(pad(s, w->as_int(), fill ? *fill : " ", jinja_strings_is(name, "ljust") ? 'l' : jinja_strings_is(name, "rjust") ? 'r' : 'c'));
  }
  if (jinja_strings_is(name, "partition") || jinja_strings_is(name, "rpartition")) {
    const std::string sep = str_arg(a, 0, "sep", name);
    if (sep.empty()) fail("empty separator");
    const size_t k = jinja_strings_is(name, "partition") ? s.find(sep) : s.rfind(sep);
    if (k == std::string::npos)
      return jinja_strings_is(name, "partition") ? Value(List{Value(s), Value(""), Value("")}) : Value(List{Value(""), Value(""), Value(s)});
    return Value(List{Value(s.substr(0, k)), Value(sep), Value(s.substr(k + sep.size()))});
  }
  if (jinja_strings_is(name, "removeprefix") || jinja_strings_is(name, "removesuffix")) {
    const std::string x = str_arg(a, 0, "prefix", name);
    if (jinja_strings_is(name, "removeprefix")) return Value(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
    return Value(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0 ? s.substr(0, s.size() - x.size()) : s);
  }
  fail("'str' object has no attribute '" + name + "'");
}

}  // namespace nnstrain::jinja
