#include "base/config/arg_map.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <sstream>

#include "base/config/arg_map_impl.h"
#include "base/text.h"

namespace nnstrain::config {

namespace {

using util::quote_prefix;

bool is_unset(const YAML::Node& v) { return !v.IsDefined() || v.IsNull(); }

std::string describe(const YAML::Node& v) {
  if (v.IsMap()) return "a mapping";
  if (v.IsSequence()) return "a list";
  return quote_prefix(v.Scalar());
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Optimal string alignment distance: a swap of two neighbours ("gtp") counts as one edit.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// YAML 1.2 core-schema style integers (decimal, optional sign); the whole text must parse.
bool parse_int(const std::string& text, int64_t& out, bool& overflow) {
  overflow = false;
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;
  if (b == e) return false;
  auto [p, ec] = std::from_chars(b, e, out);
  if (ec == std::errc::result_out_of_range) overflow = true;
  return ec == std::errc() && p == e;
}

bool parse_double(const std::string& text, double& out) {
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;
  if (b == e) return false;
  auto [p, ec] = std::from_chars(b, e, out);
  return ec == std::errc() && p == e;
}

bool parse_bool(const std::string& text, bool& out) {
  const std::string t = lower(text);
  if (t == "true" || t == "yes" || t == "on") return out = true, true;
  if (t == "false" || t == "no" || t == "off") return out = false, true;
  return false;
}

// Substitute references everywhere in a value except inside mappings (a child
// ArgMap substitutes its own values when they are read, so lines stay exact).
YAML::Node substitute_deep(const YAML::Node& v, const YAML::Node& vars,
                           const std::function<void(const std::string&)>& fail, bool into_maps = false) {
  if (v.IsScalar()) return substitute_vars(v, vars, fail);
  if (v.IsMap() && into_maps) {
    YAML::Node map(YAML::NodeType::Map);
    for (const auto& kv : v) map[kv.first.Scalar()] = substitute_deep(kv.second, vars, fail, true);
    map.SetStyle(v.Style());
    return map;
  }
  if (!v.IsSequence()) return v;
  YAML::Node seq(YAML::NodeType::Sequence);
  for (const auto& item : v) seq.push_back(substitute_deep(item, vars, fail, into_maps));
  seq.SetStyle(v.Style());
  return seq;
}

std::string range_text(std::optional<double> min, std::optional<double> max) {
  if (min && max) return "between " + format_double(*min) + " and " + format_double(*max);
  if (min) return ">= " + format_double(*min);
  return "<= " + format_double(*max);
}

std::string range_text_int(std::optional<int64_t> min, std::optional<int64_t> max) {
  if (min && max) return "between " + std::to_string(*min) + " and " + std::to_string(*max);
  if (min) return ">= " + std::to_string(*min);
  return "<= " + std::to_string(*max);
}

}  // namespace

// ---- helpers shared with load.cpp -------------------------------------------

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
  return s;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  // Fewer edits than letters, or any one-letter word would "match" any other.
  const size_t limit = std::min<size_t>(word.size() <= 3 ? 1 : word.size() <= 6 ? 2 : 3, word.size() - 1);
  if (word.empty()) return "";
  const std::string* best = nullptr;
  size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(lower(word), lower(c));
    if (d < best_d) best_d = d, best = &c;
  }
  return best ? " (did you mean '" + *best + "'?)" : "";
}

std::string format_double(double v) {
  // Shortest text that reads back exactly: fixed notation for everyday magnitudes
  // ("0.0003"), scientific with a mantissa dot otherwise ("1.0e-08"), so that
  // YAML 1.1 readers (PyYAML) see a float too.
  char buf[400];
  const double a = std::fabs(v);
  const bool fixed = a == 0 || (a >= 1e-4 && a < 1e15);
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v,
                               fixed ? std::chars_format::fixed : std::chars_format::scientific);
  std::string s(buf, ec == std::errc() ? p : buf);
  if (fixed) {
    if (s.find('.') == std::string::npos) s += ".0";
  } else {
    const size_t e = s.find('e');
    if (e != std::string::npos && s.find('.') == std::string::npos) s.insert(e, ".0");
  }
  return s;
}

YAML::Node substitute_vars(const YAML::Node& node, const YAML::Node& vars,
                           const std::function<void(const std::string&)>& fail) {
  if (!node.IsScalar()) return node;
  const std::string& s = node.Scalar();
  if (s.find("$(") == std::string::npos) return node;

  // A reference as messages show it: "$(vars.x)", cut short if it is long.
  auto shown = [](const std::string& ref) {
    return "$(" + (ref.size() > 48 ? ref.substr(0, 48) + "..." : ref) + ")";
  };
  auto lookup = [&](const std::string& ref) -> YAML::Node {
    const std::string prefix = "vars.";
    if (ref.compare(0, prefix.size(), prefix) != 0 || ref.size() == prefix.size())
      fail("unknown reference " + shown(ref) + ": only $(vars.NAME) references are supported");
    YAML::Node cur = vars;
    std::stringstream parts(ref.substr(prefix.size()));
    std::string part;
    while (std::getline(parts, part, '.')) {
      const YAML::Node parent = cur;
      YAML::Node next;
      bool found = false;
      std::vector<std::string> names;
      if (parent.IsMap()) {
        for (const auto& kv : parent) {
          names.push_back(kv.first.Scalar());
          if (kv.first.Scalar() == part) next.reset(kv.second), found = true;
        }
      }
      if (!found) {
        std::string hint = did_you_mean(part, names);
        fail("unknown variable " + shown(ref) + hint +
             (names.empty() ? "; no variables are defined under vars" : ""));
      }
      cur.reset(next);
    }
    return cur;
  };

  // A whole-scalar reference keeps the variable's node (its type, or a list).
  if (s.size() > 3 && s.compare(0, 2, "$(") == 0 && s.back() == ')' &&
      s.find(')') == s.size() - 1 && s.find("$(", 2) == std::string::npos)
    return YAML::Clone(lookup(s.substr(2, s.size() - 3)));

  std::string out;
  size_t pos = 0;
  while (true) {
    size_t start = s.find("$(", pos);
    if (start == std::string::npos) break;
    size_t end = s.find(')', start);
    if (end == std::string::npos) fail("unterminated reference in " + quote_prefix(s) + " (expected $(vars.NAME))");
    const std::string ref = s.substr(start + 2, end - start - 2);
    YAML::Node v = lookup(ref);
    if (!v.IsScalar())
      fail(shown(ref) + " is " + describe(v) + ", which can only be used as a whole value, not inside " +
           quote_prefix(s));
    out += s.substr(pos, start - pos) + v.Scalar();
    pos = end + 1;
  }
  out += s.substr(pos);
  return YAML::Node(out);
}

// ---- ArgMap::Impl -----------------------------------------------------------

std::shared_ptr<ArgMap::Impl> ArgMap::Impl::make(std::shared_ptr<ConfigContext> ctx, std::string path,
                                                 std::string loc, const YAML::Node& node) {
  auto impl = std::make_shared<Impl>();
  impl->ctx = std::move(ctx);
  impl->path = std::move(path);
  impl->loc = std::move(loc);
  impl->out = YAML::Node(YAML::NodeType::Map);
  if (is_unset(node)) return impl;
  for (const auto& kv : node) {
    if (!kv.first.IsScalar())
      throw ConfigError(impl->ctx->file + ": " + impl->key_path("?") + " (line " +
                        std::to_string(kv.first.Mark().line + 1) + "): keys must be plain names");
    const std::string key = kv.first.Scalar();
    if (impl->find(key))
      throw ConfigError(impl->ctx->file + ": " + impl->where(key) + ": duplicate key (also at line " +
                        std::to_string(kv.first.Mark().line + 1) + ")");
    impl->entries.push_back({key, kv.first, kv.second});
  }
  return impl;
}

std::string ArgMap::Impl::key_path(const std::string& key) const {
  return path.empty() ? key : path + "." + key;
}

const ArgMap::Impl::Entry* ArgMap::Impl::find(const std::string& key) const {
  for (const auto& e : entries)
    if (e.key == key) return &e;
  return nullptr;
}

bool ArgMap::Impl::from_cmdline(const std::string& full_path) const {
  std::string p = full_path;
  while (!p.empty()) {
    if (ctx->cmdline_paths.count(p)) return true;
    size_t cut = p.find_last_of(".[");
    if (cut == std::string::npos) break;
    p.resize(cut);
  }
  return false;
}

std::string ArgMap::Impl::loc_of(const std::string& key) const {
  if (from_cmdline(key_path(key))) return "command line";
  const Entry* e = find(key);
  if (e && e->key_node.Mark().line >= 0) return "line " + std::to_string(e->key_node.Mark().line + 1);
  return "";
}

std::string ArgMap::Impl::where(const std::string& key) const {
  const std::string full = key_path(key.size() > 48 ? key.substr(0, 48) + "..." : key);  // a stray key may be long
  const std::string l = loc_of(key);
  if (!l.empty()) return full + " (" + l + ")";
  if (find(key)) return full;
  if (!path.empty() && loc == "command line") return full + " (not set; " + path + " comes from the command line)";
  if (!path.empty() && !loc.empty()) return full + " (not set; " + path + " is at " + loc + ")";
  return full + " (not set)";
}

void ArgMap::Impl::fail(const std::string& key, const std::string& message) const {
  throw ConfigError(ctx->file + ": " + where(key) + ": " + message);
}

YAML::Node ArgMap::Impl::value(const std::string& key, bool consume) {
  if (std::find(known.begin(), known.end(), key) == known.end()) known.push_back(key);
  if (consume) consumed.insert(key);
  const Entry* e = find(key);
  if (!e || is_unset(e->value)) return YAML::Node();
  return substitute_deep(e->value, ctx->vars, [&](const std::string& m) { fail(key, m); });
}

void ArgMap::Impl::record(const std::string& key, const YAML::Node& resolved) { out[key] = resolved; }

std::shared_ptr<ArgMap::Impl> ArgMap::Impl::child(const std::string& key, bool required) {
  YAML::Node v = value(key);
  if (is_unset(v)) {
    if (required) fail(key, find(key) ? "required mapping has no value" : "required key is missing");
    v = YAML::Node();
  } else if (!v.IsMap()) {
    fail(key, "expected a mapping (key: value pairs), got " + describe(v));
  }
  auto c = make(ctx, key_path(key), loc_of(key), v);
  record(key, c->out);
  children.push_back(c);
  return c;
}

std::vector<std::shared_ptr<ArgMap::Impl>> ArgMap::Impl::child_list(const std::string& key) {
  std::vector<std::shared_ptr<Impl>> items;
  const YAML::Node v = value(key);
  if (is_unset(v)) return items;
  if (!v.IsSequence()) fail(key, "expected a list, got " + describe(v));
  YAML::Node seq(YAML::NodeType::Sequence);
  for (size_t i = 0; i < v.size(); ++i) {
    const YAML::Node item = v[i];
    const std::string item_path = key_path(key) + "[" + std::to_string(i) + "]";
    std::string item_loc = loc_of(key);
    if (item_loc != "command line" && item.Mark().line >= 0)
      item_loc = "line " + std::to_string(item.Mark().line + 1);
    if (!item.IsMap())
      throw ConfigError(ctx->file + ": " + item_path + (item_loc.empty() ? "" : " (" + item_loc + ")") +
                        ": expected a mapping, got " + describe(item));
    auto c = make(ctx, item_path, item_loc, item);
    seq.push_back(c->out);
    children.push_back(c);
    items.push_back(c);
  }
  record(key, seq);
  return items;
}

void ArgMap::Impl::take_raw(const std::string& key) {
  const YAML::Node v = value(key);
  if (!is_unset(v))
    record(key, substitute_deep(YAML::Clone(v), ctx->vars, [&](const std::string& m) { fail(key, m); }, true));
}

void ArgMap::Impl::collect_unknown(std::vector<std::string>& errors) const {
  for (const auto& e : entries) {
    if (consumed.count(e.key)) continue;
    std::string hint = did_you_mean(e.key, known);
    if (hint.empty())
      hint = known.empty() ? " (" + (path.empty() ? std::string("the top level") : path) + " takes no keys)"
                           : "; known keys here: " + join(known);
    errors.push_back(ctx->file + ": " + where(e.key) + ": unknown key " + quote_prefix(e.key) + hint);
  }
  for (const auto& c : children) c->collect_unknown(errors);
}

// ---- ArgMap -----------------------------------------------------------------

ArgMap::ArgMap(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
ArgMap::~ArgMap() = default;

bool ArgMap::has(const std::string& key) const {
  return !is_unset(impl_->value(key, /*consume=*/false));
}

int64_t ArgMap::get_int(const std::string& key, std::optional<int64_t> def, std::optional<int64_t> min,
                        std::optional<int64_t> max) {
  YAML::Node v = impl_->value(key);
  int64_t x = 0;
  if (is_unset(v)) {
    if (!def) impl_->fail(key, "required key is missing (expected an integer)");
    x = *def;
  } else {
    bool overflow = false;
    if (!v.IsScalar()) impl_->fail(key, "expected an integer, got " + describe(v));
    if (!parse_int(v.Scalar(), x, overflow))
      impl_->fail(key, overflow ? "integer " + quote_prefix(v.Scalar()) + " is out of range"
                                : "expected an integer, got " + describe(v));
    if ((min && x < *min) || (max && x > *max))
      impl_->fail(key, "must be " + range_text_int(min, max) + ", got " + std::to_string(x));
  }
  impl_->record(key, YAML::Node(std::to_string(x)));
  return x;
}

double ArgMap::get_float(const std::string& key, std::optional<double> def, std::optional<double> min,
                         std::optional<double> max) {
  YAML::Node v = impl_->value(key);
  double x = 0;
  if (is_unset(v)) {
    if (!def) impl_->fail(key, "required key is missing (expected a number)");
    x = *def;
  } else {
    if (!v.IsScalar() || !parse_double(v.Scalar(), x))
      impl_->fail(key, "expected a number, got " + describe(v));
    if (!std::isfinite(x)) impl_->fail(key, "expected a finite number, got " + describe(v));
    if ((min && x < *min) || (max && x > *max))
      impl_->fail(key, "must be " + range_text(min, max) + ", got " + format_double(x));
  }
  impl_->record(key, YAML::Node(format_double(x)));
  return x;
}

bool ArgMap::get_bool(const std::string& key, std::optional<bool> def) {
  YAML::Node v = impl_->value(key);
  bool x = false;
  if (is_unset(v)) {
    if (!def) impl_->fail(key, "required key is missing (expected true or false)");
    x = *def;
  } else if (!v.IsScalar() || !parse_bool(v.Scalar(), x)) {
    impl_->fail(key, "expected true or false, got " + describe(v));
  }
  impl_->record(key, YAML::Node(x ? "true" : "false"));
  return x;
}

std::string ArgMap::get_string(const std::string& key, std::optional<std::string> def,
                               const std::vector<std::string>& choices) {
  YAML::Node v = impl_->value(key);
  std::string x;
  if (is_unset(v)) {
    if (!def)
      impl_->fail(key, choices.empty() ? "required key is missing"
                                       : "required key is missing (one of: " + join(choices) + ")");
    x = *def;
  } else {
    if (!v.IsScalar()) impl_->fail(key, "expected a string, got " + describe(v));
    x = v.Scalar();
    if (!choices.empty() && std::find(choices.begin(), choices.end(), x) == choices.end())
      impl_->fail(key, quote_prefix(x) + " is not one of: " + join(choices) + did_you_mean(x, choices));
  }
  impl_->record(key, YAML::Node(x));
  return x;
}

std::vector<double> ArgMap::get_float_list(const std::string& key, std::optional<std::vector<double>> def) {
  const YAML::Node v = impl_->value(key);
  std::vector<double> xs;
  if (is_unset(v)) {
    if (!def) impl_->fail(key, "required key is missing (expected a list of numbers)");
    xs = *def;
  } else {
    if (!v.IsSequence()) impl_->fail(key, "expected a list of numbers like [0.9, 0.95], got " + describe(v));
    for (size_t i = 0; i < v.size(); ++i) {
      double x = 0;
      if (!v[i].IsScalar() || !parse_double(v[i].Scalar(), x) || !std::isfinite(x))
        impl_->fail(key, "element " + std::to_string(i) + ": expected a number, got " + describe(v[i]));
      xs.push_back(x);
    }
  }
  YAML::Node seq(YAML::NodeType::Sequence);
  for (double x : xs) seq.push_back(format_double(x));
  seq.SetStyle(YAML::EmitterStyle::Flow);
  impl_->record(key, seq);
  return xs;
}

std::vector<std::string> ArgMap::get_string_list(const std::string& key,
                                                 std::optional<std::vector<std::string>> def) {
  const YAML::Node v = impl_->value(key);
  std::vector<std::string> xs;
  if (is_unset(v)) {
    if (!def) impl_->fail(key, "required key is missing (expected a list of strings)");
    xs = *def;
  } else {
    if (!v.IsSequence()) impl_->fail(key, "expected a list of strings like [\"a\", \"b\"], got " + describe(v));
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].IsScalar() || v[i].Scalar().empty())
        impl_->fail(key, "element " + std::to_string(i) + ": expected a non-empty string, got " + describe(v[i]));
      xs.push_back(v[i].Scalar());
    }
  }
  YAML::Node seq(YAML::NodeType::Sequence);
  for (const auto& x : xs) seq.push_back(x);
  seq.SetStyle(YAML::EmitterStyle::Flow);
  impl_->record(key, seq);
  return xs;
}

ArgMap ArgMap::child(const std::string& key, bool required) { return ArgMap(impl_->child(key, required)); }

std::string ArgMap::where(const std::string& key) const { return impl_->where(key); }

void ArgMap::fail(const std::string& key, const std::string& message) const { impl_->fail(key, message); }

void ArgMap::finish() {
  std::vector<std::string> errors;
  impl_->collect_unknown(errors);
  constexpr size_t kShown = 20;  // a file of thousands of stray keys gets a readable message
  if (errors.size() > kShown) {
    const size_t more = errors.size() - kShown;
    errors.resize(kShown);
    errors.push_back("... and " + std::to_string(more) + " more unknown keys");
  }
  if (!errors.empty()) throw ConfigError(join(errors, "\n"));
}

}  // namespace nnstrain::config
