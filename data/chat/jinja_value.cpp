#include "data/chat/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

namespace nnstrain::jinja {

const Value* CallArgs::get(size_t i, const char* name) const {
  if (i < pos.size()) return &pos[i];
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

namespace {
struct FuncBox {
  Func f;
  std::string name;
};
}  // namespace

Value Value::dict() {
  Value v = make(T::dict);
  v.p_ = std::make_shared<Dict>();
  return v;
}

Value Value::ns() {
  Value v = make(T::ns);
  v.p_ = std::make_shared<Dict>();
  return v;
}

Value Value::func(Func f, std::string name) {
  Value v = make(T::func);
  v.p_ = std::make_shared<const FuncBox>(FuncBox{std::move(f), std::move(name)});
  return v;
}

const Func& Value::fn() const { return static_cast<const FuncBox*>(p_.get())->f; }
const std::string& Value::fn_name() const { return static_cast<const FuncBox*>(p_.get())->name; }

Value Value::generator(std::function<bool(Value&)> next, const char* type) {
  Value v = make(T::gen);
  auto g = std::make_shared<Generator>();
  g->next_fn = std::move(next);
  g->type = type;
  v.p_ = std::move(g);
  return v;
}

bool Generator::next(Value& out) {
  if (done) return false;
  try {
    if (next_fn(out)) return true;
  } catch (...) {
    done = true;
    next_fn = nullptr;
    throw;
  }
  done = true;
  next_fn = nullptr;  // what it holds (its source) is released
  return false;
}

const std::string& Value::undefined_name() const {
  static const std::string empty;
  return p_ ? str() : empty;
}

bool Value::truthy() const {
  switch (t_) {
    case T::undefined:
    case T::none: return false;
    case T::boolean:
    case T::integer: return i_ != 0;
    case T::floating: return f_ != 0;
    case T::string: return !str().empty();
    case T::list: return !list().empty();
    case T::dict: return !map().items.empty();
    default: return true;
  }
}

std::string Value::type_name() const {
  switch (t_) {
    case T::undefined: return "Undefined";
    case T::none: return "NoneType";
    case T::boolean: return "bool";
    case T::integer: return "int";
    case T::floating: return "float";
    case T::string: return "str";
    case T::list: return !is_tuple() ? "list" : is_group() ? "_GroupTuple" : "tuple";
    case T::dict: return "dict";
    case T::func: return "function";
    case T::ns: return "Namespace";
    case T::gen: return gen().type;
  }
  return "?";
}

// --- UTF-8 -------------------------------------------------------------------

std::pair<uint32_t, size_t> utf8_decode(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  uint32_t cp = n == 1 ? c : c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return {cp, n};
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

size_t utf8_length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

std::vector<size_t> utf8_offsets(const std::string& s) {
  std::vector<size_t> o;
  o.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xc0) != 0x80) o.push_back(i);
  o.push_back(s.size());
  return o;
}

bool is_py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

namespace {

// Python's str.isprintable() for the code points templates meet (controls,
// format characters, separators other than the space).
bool printable(uint32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c != 0x20 && is_py_space(c)) return false;
  if ((c >= 0x200b && c <= 0x200f) || (c >= 0x202a && c <= 0x202e) || (c >= 0x2060 && c <= 0x2064) ||
      c == 0xfeff || (c >= 0xd800 && c <= 0xdfff) || (c >= 0xe000 && c <= 0xf8ff))
    return false;
  return true;
}

void hex(std::string& out, const char* prefix, uint32_t v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s%0*x", prefix, digits, v);
  out += buf;
}

void repr_string(std::string& out, const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  out += q;
  for (size_t i = 0; i < s.size();) {
    auto [cp, n] = utf8_decode(s, i);
    if (cp == uint32_t(q) || cp == '\\') out += '\\', out += char(cp);
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (printable(cp)) out.append(s, i, n);
    else if (cp < 0x100) hex(out, "\\x", cp, 2);
    else if (cp < 0x10000) hex(out, "\\u", cp, 4);
    else hex(out, "\\U", cp, 8);
    i += n;
  }
  out += q;
}

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    // A run that needs no escaping (printable ASCII but " and \, and UTF-8 unless ensure_ascii) at once.
    size_t j = i;
    while (j < s.size()) {
      const auto b = static_cast<unsigned char>(s[j]);
      if (b < 0x20 || b == '"' || b == '\\' || (b >= 0x80 && ensure_ascii)) break;
      ++j;
    }
    if (j > i) {
      out.append(s, i, j - i);
      i = j;
      continue;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (c < 0x20) hex(out, "\\u", c, 4);
          else out += char(c);
      }
      ++i;
      continue;
    }
    auto [cp, n] = utf8_decode(s, i);
    if (!ensure_ascii) {
      out.append(s, i, n);
    } else if (cp < 0x10000) {
      hex(out, "\\u", cp, 4);
    } else {
      const uint32_t v = cp - 0x10000;
      hex(out, "\\u", 0xd800 + (v >> 10), 4);
      hex(out, "\\u", 0xdc00 + (v & 0x3ff), 4);
    }
    i += n;
  }
  out += '"';
}

}  // namespace

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  int p = 1;
  for (; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*e", p - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  // buf: [-]D[.DDD]e[+-]XX
  std::string s(buf);
  const bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  const size_t e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string digits = s.substr(0, 1) + (e > 2 ? s.substr(2, e - 2) : "");
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(size_t(-exp - 1), '0') + digits;
    } else if (size_t(exp) + 1 >= digits.size()) {
      out += digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return out;
}

void Value::append_str(std::string& out) const {
  switch (t_) {
    case T::undefined: return;
    case T::string: out += str(); return;
    default: out += to_str();
  }
}

std::string Value::to_str() const {
  switch (t_) {
    case T::undefined: return "";
    case T::none: return "None";
    case T::boolean: return i_ ? "True" : "False";
    case T::integer: return std::to_string(i_);
    case T::floating: return float_repr(f_);
    case T::string: return str();
    case T::func: return "<function " + fn_name() + ">";
    case T::ns: {
      Value d = dict();
      d.p_ = p_;
      return "<Namespace " + d.repr() + ">";
    }
    case T::gen:
      // jinja2 prints "<generator object ... at 0x...>": an address, never reproducible.
      throw Error("a " + type_name() + " is printed (jinja2 would print its address); convert it with |list");
    default: return repr();
  }
}

std::string Value::repr() const {
  std::string out;
  switch (t_) {
    case T::string: repr_string(out, str()); return out;
    case T::list: {
      const List& l = list();
      out += is_tuple() ? '(' : '[';
      for (size_t i = 0; i < l.size(); ++i) out += (i ? ", " : "") + l[i].repr();
      if (is_tuple()) return out + (l.size() == 1 ? ",)" : ")");
      return out + ']';
    }
    case T::dict: {
      const auto& items = map().items;
      out += '{';
      for (size_t i = 0; i < items.size(); ++i)
        out += (i ? ", " : "") + items[i].first.repr() + ": " + items[i].second.repr();
      return out + '}';
    }
    default: return to_str();
  }
}

std::string Value::to_json(int indent, const std::string* indent_str, const std::string* item_sep,
                           const std::string* key_sep, bool sort_keys, bool ensure_ascii) const {
  std::string out;
  const bool lines = indent >= 0 || indent_str;
  const std::string is = item_sep ? *item_sep : lines ? "," : ", ", ks = key_sep ? *key_sep : ": ";
  std::string istr = indent_str ? *indent_str : std::string(size_t(std::max(indent, 0)), ' ');
  json_into(out, lines ? 1 : -1, &istr, is, ks, sort_keys, ensure_ascii, 0);
  return out;
}

void Value::json_into(std::string& out, int indent, const std::string* istr, const std::string& item_sep,
                      const std::string& key_sep, bool sort_keys, bool ascii, int depth) const {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    for (int k = 0; k < d; ++k) out += *istr;
  };
  switch (t_) {
    case T::none: out += "null"; return;
    case T::boolean: out += i_ ? "true" : "false"; return;
    case T::integer: out += std::to_string(i_); return;
    case T::floating:
      out += std::isnan(f_) ? "NaN" : std::isinf(f_) ? (f_ < 0 ? "-Infinity" : "Infinity") : float_repr(f_);
      return;
    case T::string: json_string(out, str(), ascii); return;
    case T::list: {
      const List& l = list();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        l[i].json_into(out, indent, istr, item_sep, key_sep, sort_keys, ascii, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case T::dict: {
      if (map().items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : map().items) items.push_back(&kv);
      auto key_text = [](const Value& k) {
        switch (k.t_) {
          case T::string: return k.str();
          case T::none: return std::string("null");
          case T::boolean: return std::string(k.i_ ? "true" : "false");
          case T::integer: return std::to_string(k.i_);
          case T::floating: return float_repr(k.f_);
          default: throw Error("keys must be str, int, float, bool or None, not " + k.type_name());
        }
      };
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [&](const auto* a, const auto* b) { return less(a->first, b->first); });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        json_string(out, key_text(items[i]->first), ascii);
        out += key_sep;
        items[i]->second.json_into(out, indent, istr, item_sep, key_sep, sort_keys, ascii, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default: throw Error("Object of type " + type_name() + " is not JSON serializable");
  }
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(from_json(e));
      return Value(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = dict();
      d.map().items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.map().items.emplace_back(Value(it.key()), from_json(it.value()));
      return d;
    }
    default: throw Error("unsupported JSON value");
  }
}

namespace {

// nlohmann's SAX events into values: the containers being filled, innermost last.
struct JinjaJsonSax {
  using json = nlohmann::ordered_json;
  std::vector<Value> stack;
  std::vector<Value> keys;  // per open dict: the key whose value comes next
  Value root;
  bool done = false;

  bool put(Value v) {
    if (stack.empty()) {
      root = std::move(v);
      done = true;
    } else if (stack.back().is_list()) {
      stack.back().list().push_back(std::move(v));
    } else {
      stack.back().map().set(keys.back(), std::move(v));  // a repeated key: the last value, first place
    }
    return true;
  }
  bool null() { return put(Value::none()); }
  bool boolean(bool b) { return put(Value(b)); }
  bool number_integer(json::number_integer_t v) { return put(Value(int64_t(v))); }
  bool number_unsigned(json::number_unsigned_t v) { return put(Value(int64_t(v))); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(Value(double(v))); }
  bool string(json::string_t& v) { return put(Value(std::move(v))); }
  bool binary(json::binary_t&) { return false; }
  bool start_object(std::size_t) {
    stack.push_back(Value::dict());
    keys.emplace_back();
    return true;
  }
  bool key(json::string_t& k) {
    keys.back() = Value(std::move(k));
    return true;
  }
  bool end_object() {
    Value v = std::move(stack.back());
    stack.pop_back();
    keys.pop_back();
    return put(std::move(v));
  }
  bool start_array(std::size_t) {
    stack.push_back(Value(List{}));
    return true;
  }
  bool end_array() {
    Value v = std::move(stack.back());
    stack.pop_back();
    return put(std::move(v));
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }
};

}  // namespace

bool Value::parse_json(const std::string& text, Value& out) {
  JinjaJsonSax sax;
  if (!nlohmann::ordered_json::sax_parse(text, &sax) || !sax.done) return false;
  out = std::move(sax.root);
  return true;
}

// --- dict ----------------------------------------------------------------------

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(key.str());
  for (const auto& [k, v] : items)
    if (equal(k, key)) return &v;
  return nullptr;
}

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k.is_string() && k.str() == key) return &v;
  return nullptr;
}

void Dict::set(const Value& key, Value v) {
  for (auto& [k, old] : items)
    if (equal(k, key)) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

bool Dict::erase(const Value& key) {
  for (auto it = items.begin(); it != items.end(); ++it)
    if (equal(it->first, key)) {
      items.erase(it);
      return true;
    }
  return false;
}

// --- comparisons ------------------------------------------------------------------

bool equal(const Value& a, const Value& b) {
  using T = Value::T;
  if (a.is_number() && b.is_number()) {
    if (a.type() == T::floating || b.type() == T::floating) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case T::undefined:
    case T::none: return true;
    case T::string: return a.str() == b.str();
    case T::list: {
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!equal(a.list()[i], b.list()[i])) return false;
      return true;
    }
    case T::dict: {
      if (a.map().items.size() != b.map().items.size()) return false;
      for (const auto& [k, v] : a.map().items) {
        const Value* o = b.map().find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    }
    case T::ns:
    case T::func:
    case T::gen: return a.identity() == b.identity();
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.type() == Value::T::floating || b.type() == Value::T::floating) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 bytes sort as code points
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const auto &x = a.list(), &y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equal(x[i], y[i])) return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  throw Error("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

}  // namespace nnstrain::jinja
