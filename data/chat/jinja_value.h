// The values a Jinja template computes with, behaving as the Python objects
// jinja2 hands a Hugging Face chat template: None, bool, int, float, str (UTF-8,
// indexed by code point), list, dict (insertion order), callables, namespace(),
// and Undefined (a missing name or key: prints as "", fails when used further).
// Torch-free; docs/chat_templates.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace nnstrain::jinja {

// A failure while rendering; `line`/`col` 0 until the node it happened in adds them.
struct Error : std::runtime_error {
  Error(const std::string& what, int line = 0, int col = 0) : std::runtime_error(what), line(line), col(col) {}
  int line, col;
  bool raised = false;  // raise_exception() in the template: its message is the user's
};

class Value;
using List = std::vector<Value>;
struct Dict;

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t i, const char* name) const;  // positional i or keyword `name`, else null
};
using Func = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class T : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, func, ns };

  Value() = default;  // Undefined
  static Value undefined(std::string name = "") {
    Value v;
    if (!name.empty()) v.s_ = std::make_shared<const std::string>(std::move(name));
    return v;
  }
  static Value none() { return make(T::none); }
  Value(bool b) : t_(T::boolean), i_(b) {}
  Value(int v) : t_(T::integer), i_(v) {}
  Value(int64_t v) : t_(T::integer), i_(v) {}
  Value(size_t v) : t_(T::integer), i_(int64_t(v)) {}
  Value(double v) : t_(T::floating), f_(v) {}
  Value(std::string s) : t_(T::string), s_(std::make_shared<const std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l) : t_(T::list), l_(std::make_shared<List>(std::move(l))) {}
  // Markup: what |safe and |escape return; `+` with a plain string escapes that string (markupsafe).
  static Value markup(std::string s) {
    Value v(std::move(s));
    v.i_ = 1;
    return v;
  }
  bool is_markup() const { return t_ == T::string && i_ == 1; }
  static Value dict();
  static Value ns();
  static Value func(Func f, std::string name);

  T type() const { return t_; }
  bool is_undefined() const { return t_ == T::undefined; }
  bool is_none() const { return t_ == T::none; }
  bool is_bool() const { return t_ == T::boolean; }
  bool is_int() const { return t_ == T::integer || t_ == T::boolean; }  // Python: bool is an int
  bool is_number() const { return is_int() || t_ == T::floating; }
  bool is_string() const { return t_ == T::string; }
  bool is_list() const { return t_ == T::list; }
  bool is_dict() const { return t_ == T::dict; }
  bool is_ns() const { return t_ == T::ns; }
  bool is_func() const { return t_ == T::func; }

  int64_t as_int() const { return i_; }
  double as_double() const { return t_ == T::floating ? f_ : double(i_); }
  const std::string& str() const { return *s_; }  // a string (or Undefined's name, when it has one)
  const std::string& undefined_name() const;
  List& list() const { return *l_; }
  Dict& map() const { return *d_; }  // dict or namespace
  const Func& fn() const { return *fn_; }
  const std::string& fn_name() const { return *s_; }

  bool truthy() const;
  std::string type_name() const;  // as Python names it: str, int, list, dict, NoneType, ...

  // str(v) as Python gives it (None, True, 1.5, ['a'], {'k': 1}); Undefined is "".
  std::string to_str() const;
  void append_str(std::string& out) const;
  std::string repr() const;  // repr(v)
  // json.dumps(v, ensure_ascii=False, indent=..., separators=..., sort_keys=...).
  // indent < 0: none; indent_str set: that string per level.
  std::string to_json(int indent = -1, const std::string* indent_str = nullptr, const std::string* item_sep = nullptr,
                      const std::string* key_sep = nullptr, bool sort_keys = false, bool ensure_ascii = false) const;

  static Value from_json(const nlohmann::ordered_json& j);

 private:
  static Value make(T t) {
    Value v;
    v.t_ = t;
    return v;
  }
  void json_into(std::string& out, int indent, const std::string* istr, const std::string& item_sep,
                 const std::string& key_sep, bool sort_keys, bool ascii, int depth) const;

  T t_ = T::undefined;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<List> l_;
  std::shared_ptr<Dict> d_;
  std::shared_ptr<const Func> fn_;
};

// A dict: keys in insertion order (Python 3.7+), found by a linear scan (chat
// messages hold a handful of keys).
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  void set(const Value& key, Value v);
  bool erase(const Value& key);
};

// Python's ==, and < where Python defines it (else Error).
bool equal(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);

// Python's float repr (shortest text that reads back the same).
std::string float_repr(double d);

// UTF-8 helpers: Python strings count code points.
size_t utf8_length(const std::string& s);
std::vector<size_t> utf8_offsets(const std::string& s);  // byte offset of each code point, then s.size()
bool is_py_space(uint32_t cp);
std::pair<uint32_t, size_t> utf8_decode(const std::string& s, size_t i);
void utf8_append(std::string& out, uint32_t cp);

}  // namespace nnstrain::jinja
