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
struct Generator;

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t i, const char* name) const;  // positional i or keyword `name`, else null
};
using Func = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class T : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, func, ns, gen };

  Value() = default;  // Undefined
  static Value undefined(std::string name = "") {
    Value v;
    if (!name.empty()) v.p_ = std::make_shared<const std::string>(std::move(name));
    return v;
  }
  static Value none() { return make(T::none); }
  Value(bool b) : t_(T::boolean), i_(b) {}
  Value(int v) : t_(T::integer), i_(v) {}
  Value(int64_t v) : t_(T::integer), i_(v) {}
  Value(size_t v) : t_(T::integer), i_(int64_t(v)) {}
  Value(double v) : t_(T::floating), f_(v) {}
  Value(std::string s) : t_(T::string), p_(std::make_shared<const std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l) : t_(T::list), p_(std::make_shared<List>(std::move(l))) {}
  // Markup: what |safe and |escape return; `+` with a plain string escapes that string (markupsafe).
  static Value markup(std::string s) {
    Value v(std::move(s));
    v.markup_ = true;
    return v;
  }
  bool is_markup() const { return t_ == T::string && markup_; }
  // A tuple: a list that prints as (a, b) and equals no list; `group`: jinja2's groupby
  // (grouper, list) namedtuple, with those two attributes.
  static Value tuple(List l, bool group = false) {
    Value v(std::move(l));
    v.markup_ = true;
    v.i_ = group;
    return v;
  }
  bool is_tuple() const { return t_ == T::list && markup_; }
  bool is_group() const { return is_tuple() && i_ == 1; }
  static Value dict();
  static Value ns();
  static Value func(Func f, std::string name);
  // A Python generator: `next` yields the next item into its argument, false when done.
  // `type` is its Python type name in error messages (generator, list_reverseiterator).
  static Value generator(std::function<bool(Value&)> next, const char* type = "generator");

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
  bool is_gen() const { return t_ == T::gen; }

  int64_t as_int() const { return i_; }
  double as_double() const { return t_ == T::floating ? f_ : double(i_); }
  const std::string& str() const { return *static_cast<const std::string*>(p_.get()); }  // a string
  const std::string& undefined_name() const;
  List& list() const { return *static_cast<List*>(const_cast<void*>(p_.get())); }
  Dict& map() const { return *static_cast<Dict*>(const_cast<void*>(p_.get())); }  // dict or namespace
  const Func& fn() const;
  const std::string& fn_name() const;
  Generator& gen() const { return *static_cast<Generator*>(const_cast<void*>(p_.get())); }
  const void* identity() const { return p_.get(); }  // Python's id() for lists, dicts, strings, ...

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
  // JSON text straight to a value (what from_json(parse(text)) gives, without the
  // JSON tree); false (out untouched) when the text is not JSON.
  static bool parse_json(const std::string& text, Value& out);

 private:
  static Value make(T t) {
    Value v;
    v.t_ = t;
    return v;
  }
  void json_into(std::string& out, int indent, const std::string* istr, const std::string& item_sep,
                 const std::string& key_sep, bool sort_keys, bool ascii, int depth) const;

  T t_ = T::undefined;
  bool markup_ = false;  // a string: Markup; a list: a tuple
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const void> p_;
};

// A generator's state, shared by the values that name it (Python references).
struct Generator {
  std::function<bool(Value&)> next_fn;
  const char* type = "generator";
  bool done = false;
  // The next item; false once exhausted (also after it raised, as Python's are).
  bool next(Value& out);
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
