#include "data/chat/jinja_runtime.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "data/chat/jinja_strings.h"

namespace nnstrain::jinja {

namespace {

using EK = Expr::K;

// Name dispatch: the sizes first, then a compare of a size the compiler knows
// (std::string == a literal memcmps whatever the sizes).
template <size_t N>
inline bool jinja_is(const std::string& s, const char (&lit)[N]) {
  return s.size() == N - 1 && std::memcmp(s.data(), lit, N - 1) == 0;
}
using SK = Stmt::K;

// A scope: names are the template's interned symbols, compared as pointers.
struct Frame {
  std::vector<std::pair<Sym, Value>> vars;
  std::shared_ptr<Frame> parent;

  const Value* find(Sym name) const {
    for (const Frame* f = this; f; f = f->parent.get())
      for (auto it = f->vars.rbegin(); it != f->vars.rend(); ++it)
        if (it->first == name) return &it->second;
    return nullptr;
  }
  void set(Sym name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};
using FrameP = std::shared_ptr<Frame>;

enum class Flow { normal, break_, continue_ };

[[noreturn]] void undefined_error(const Value& v) {
  const auto& n = v.undefined_name();
  throw Error(n.empty() ? "an undefined value is used" : n + " is undefined");
}

[[noreturn]] void type_error(const std::string& what) { throw Error(what); }

int64_t floor_div(int64_t a, int64_t b) {
  if (b == 0) throw Error("integer division or modulo by zero");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t py_mod(int64_t a, int64_t b) {
  if (b == 0) throw Error("integer division or modulo by zero");
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

// Python's list(x) for what a for loop or a filter iterates.
List iterate(const Value& v) {
  switch (v.type()) {
    case Value::T::undefined: return {};
    case Value::T::list: return v.list();
    case Value::T::gen: {  // what is left of it
      List rest;
      Value x;
      while (v.gen().next(x)) rest.push_back(std::move(x));
      return rest;
    }
    case Value::T::dict: {
      List keys;
      for (const auto& kv : v.map().items) keys.push_back(kv.first);
      return keys;
    }
    case Value::T::string: {
      List chars;
      const auto& s = v.str();
      const auto off = utf8_offsets(s);
      for (size_t i = 0; i + 1 < off.size(); ++i) chars.emplace_back(s.substr(off[i], off[i + 1] - off[i]));
      return chars;
    }
    default: type_error("'" + v.type_name() + "' object is not iterable");
  }
}

// Python's iter(v) as a pull function (a generator's own items, a list's in
// turn, else a snapshot of what iterate() gives).
using JinjaPull = std::function<bool(Value&)>;
JinjaPull jinja_iter_of(const Value& v) {
  if (v.is_gen()) return [v](Value& out) { return v.gen().next(out); };
  Value seq = v.is_list() ? v : Value(iterate(v));
  return [seq, i = size_t(0)](Value& out) mutable {
    if (i >= seq.list().size()) return false;
    out = seq.list()[i++];
    return true;
  };
}

// A generator whose body (`start`: what runs before its first item, returning
// the pull function of its items) runs when it is first iterated, as a Python
// generator function's does: its errors surface where it is consumed.
Value jinja_lazy(std::function<JinjaPull()> start, const char* type = "generator") {
  return Value::generator(
      [start = std::move(start), pull = JinjaPull()](Value& out) mutable {
        if (start) {
          pull = start();
          start = nullptr;
        }
        return pull && pull(out);
      },
      type);
}

Value items_of(const Value& d) {
  List out;
  for (const auto& [k, v] : d.map().items) out.push_back(Value::tuple(List{k, v}));
  return Value(std::move(out));
}

// Python's normalisation of a slice or an index over n items.
int64_t index_of(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

struct Slice {
  int64_t start, stop, step;
};
std::vector<int64_t> slice_indices(int64_t n, const Value* a, const Value* b, const Value* c) {
  int64_t step = c && !c->is_none() ? c->as_int() : 1;
  if (c && !c->is_none() && !c->is_int()) type_error("slice indices must be integers or None");
  if (step == 0) throw Error("slice step cannot be zero");
  auto clamp = [&](const Value* v, int64_t def) {
    if (!v || v->is_none()) return def;
    if (!v->is_int()) type_error("slice indices must be integers or None");
    int64_t i = v->as_int();
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = clamp(a, step > 0 ? 0 : n - 1), stop = clamp(b, step > 0 ? n : -1);
  std::vector<int64_t> out;
  if (step > 0)
    for (int64_t i = start; i < stop; i += step) out.push_back(i);
  else
    for (int64_t i = start; i > stop; i += step) out.push_back(i);
  return out;
}

bool unsafe_method(const Value& obj, const std::string& name) {
  if (obj.is_list())
    return jinja_is(name, "append") || jinja_is(name, "pop") || jinja_is(name, "clear") || jinja_is(name, "extend") || jinja_is(name, "insert") ||
           jinja_is(name, "remove") || jinja_is(name, "reverse") || jinja_is(name, "sort") || jinja_is(name, "__setitem__");
  if (obj.is_dict())
    return jinja_is(name, "clear") || jinja_is(name, "pop") || jinja_is(name, "popitem") || jinja_is(name, "setdefault") || jinja_is(name, "update");
  return false;
}

bool known_method(const Value& obj, const std::string& name) {
  if (obj.is_dict()) return jinja_is(name, "items") || jinja_is(name, "keys") || jinja_is(name, "values") || jinja_is(name, "get") || jinja_is(name, "copy");
  if (obj.is_list()) return jinja_is(name, "index") || jinja_is(name, "count") || jinja_is(name, "copy");
  if (obj.is_string()) return is_string_method(name);
  return false;
}

class Interp {
 public:
  Interp(const Template& t, const Value& globals) : tpl_(t) {
    root_ = std::make_shared<Frame>();
    root_->vars.reserve(globals.map().items.size() + 8);
    // Only the names the template can look up: the others are never read.
    for (const auto& [k, v] : globals.map().items)
      if (Sym sym = k.is_string() ? tpl_.symbol(k.str()) : nullptr) root_->vars.emplace_back(sym, v);
    for (const auto& [name, fn] : builtins())
      if (Sym sym = tpl_.symbol(name); sym && !root_->find(sym)) root_->vars.emplace_back(sym, fn);
    sym_loop_ = tpl_.symbol("loop");
    sym_caller_ = tpl_.symbol("caller");
    sym_body_ = tpl_.symbol(" body");
  }

  RenderResult run() {
    RenderResult r;
    out_ = &r.text;
    top_ = &r.text;
    gen_ = &r.generation;
    exec(tpl_.body, root_);
    return r;
  }

 private:
  const Template& tpl_;
  FrameP root_;
  std::string* out_ = nullptr;
  std::string* top_ = nullptr;
  std::vector<std::pair<size_t, size_t>>* gen_ = nullptr;
  int depth_ = 0;
  Sym sym_loop_ = nullptr, sym_caller_ = nullptr, sym_body_ = nullptr;

  // range, dict, namespace, raise_exception, strftime_now: built once, shared by every rendering.
  static const std::vector<std::pair<std::string, Value>>& builtins() {
    static const auto* all = make_builtins();
    return *all;
  }
  static std::vector<std::pair<std::string, Value>>* make_builtins() {
    auto* out = new std::vector<std::pair<std::string, Value>>;
    auto def = [&](const char* name, Func f) { out->emplace_back(name, Value::func(std::move(f), name)); };
    def("range", [](CallArgs& a) {
      int64_t start = 0, stop = 0, step = 1;
      for (const auto& v : a.pos)
        if (!v.is_int()) type_error("range() takes integers, not " + v.type_name());
      if (a.pos.size() == 1) stop = a.pos[0].as_int();
      else if (a.pos.size() >= 2) start = a.pos[0].as_int(), stop = a.pos[1].as_int();
      if (a.pos.size() >= 3) step = a.pos[2].as_int();
      if (a.pos.empty() || a.pos.size() > 3) type_error("range expected 1 to 3 arguments");
      if (step == 0) throw Error("range() arg 3 must not be zero");
      List l;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        l.emplace_back(i);
        if (l.size() > 100000) throw Error("range too big");  // the sandbox's MAX_RANGE
      }
      return Value(std::move(l));
    });
    auto mapping = [](CallArgs& a, Value d) {
      if (!a.pos.empty()) {
        if (a.pos.size() > 1) type_error("expected at most 1 positional argument");
        if (a.pos[0].is_dict() || a.pos[0].is_ns()) {
          for (const auto& kv : a.pos[0].map().items) d.map().set(kv.first, kv.second);
        } else {
          for (const auto& item : iterate(a.pos[0])) {
            const List l = iterate(item);
            if (l.size() != 2) type_error("dictionary update sequence element has the wrong length");
            d.map().set(l[0], l[1]);
          }
        }
      }
      for (auto& [k, v] : a.kw) d.map().set(Value(k), v);
      return d;
    };
    def("dict", [mapping](CallArgs& a) { return mapping(a, Value::dict()); });
    def("namespace", [mapping](CallArgs& a) {
      Value n = mapping(a, Value::ns());
      for (const auto& kv : n.map().items)
        if (kv.first.is_string() && !kv.first.str().empty() && kv.first.str()[0] == '_')
          throw Error("chat templates cannot store underscore-prefixed attributes on a namespace");
      return n;
    });
    def("raise_exception", [](CallArgs& a) -> Value {
      Error e(a.pos.empty() ? "" : a.pos[0].to_str());
      e.raised = true;
      throw e;
    });
    def("strftime_now", [](CallArgs& a) -> Value {
      if (a.pos.empty() || !a.pos[0].is_string()) type_error("strftime_now() takes a format string");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      const size_t n = std::strftime(buf, sizeof buf, a.pos[0].str().c_str(), &tm);
      return Value(std::string(buf, n));
    });
    return out;
  }

  // --- statements -------------------------------------------------------------

  Flow exec(const Body& body, const FrameP& f) {
    for (const auto& s : body) {
      const Flow fl = exec(*s, f);
      if (fl != Flow::normal) return fl;
    }
    return Flow::normal;
  }

  Flow exec(const Stmt& s, const FrameP& f) {
    try {
      return exec_inner(s, f);
    } catch (Error& e) {
      if (!e.line) e.line = s.line, e.col = s.col;
      throw;
    }
  }

  std::string capture(const Body& body, const FrameP& f) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    try {
      exec(body, f);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buf;
  }

  void assign(const Stmt& s, const FrameP& f, Value v) {
    if (s.attr_target) {
      const Value* ns = f->find(s.syms[0]);
      if (!ns || !ns->is_ns()) throw Error("cannot assign attribute on non-namespace object '" + s.names[0] + "'");
      if (!s.names[1].empty() && s.names[1][0] == '_')
        throw Error("chat templates cannot store underscore-prefixed attributes on a namespace");
      ns->map().set(Value(s.names[1]), std::move(v));
      return;
    }
    if (s.names.size() == 1) {
      f->set(s.syms[0], std::move(v));
      return;
    }
    const List l = iterate(v);
    if (l.size() != s.names.size())
      throw Error("cannot unpack " + std::to_string(l.size()) + " values into " + std::to_string(s.names.size()));
    for (size_t i = 0; i < l.size(); ++i) f->set(s.syms[i], l[i]);
  }

  Flow exec_inner(const Stmt& s, const FrameP& f) {
    switch (s.kind) {
      case SK::text: *out_ += s.text; return Flow::normal;
      case SK::print: print(*s.exprs[0], f); return Flow::normal;
      case SK::if_:
        for (size_t i = 0; i < s.exprs.size(); ++i)
          if (eval(*s.exprs[i], f).truthy()) return exec(s.bodies[i], f);
        if (s.bodies.size() > s.exprs.size()) return exec(s.bodies.back(), f);
        return Flow::normal;
      case SK::for_: return exec_for(s, f);
      case SK::set: assign(s, f, eval(*s.exprs[0], f)); return Flow::normal;
      case SK::set_block: {
        Value v(capture(s.bodies[0], f));
        if (!s.exprs.empty()) v = with_body(*s.exprs[0], f, v);
        f->set(s.syms[0], std::move(v));
        return Flow::normal;
      }
      case SK::filter_block: {
        Value v(capture(s.bodies[0], f));
        with_body(*s.exprs[0], f, v).append_str(*out_);
        return Flow::normal;
      }
      case SK::macro: f->set(s.macro_sym, macro(s, f, s.macro_name)); return Flow::normal;
      case SK::call_block: {
        const Expr& c = *s.exprs[0];
        Value callee = eval(*c.args[0], f);
        CallArgs a = args_of(c, f);
        a.kw.emplace_back("caller", macro(s, f, "caller"));
        call(callee, a).append_str(*out_);
        return Flow::normal;
      }
      case SK::generation: {
        std::string body = capture(s.bodies[0], f);
        const size_t start = top_->size();  // as transformers counts: the text rendered so far
        gen_->emplace_back(start, start + body.size());
        *out_ += body;
        return Flow::normal;
      }
      case SK::break_: return Flow::break_;
      case SK::continue_: return Flow::continue_;
    }
    return Flow::normal;
  }

  // {{ a + b + c }} and {{ a ~ b }}: plain strings appended as they come, without the
  // intermediate strings; from the first operand that is not one, Python's + as usual.
  void print(const Expr& e, const FrameP& f) {
    if (e.kind == EK::concat) {
      for (const auto& a : e.args) eval(*a, f).append_str(*out_);
      return;
    }
    if (e.kind != EK::binary || !jinja_is(e.name, "+")) {
      eval(e, f).append_str(*out_);
      return;
    }
    const Expr* leaves[64];
    const Expr* nodes[64];  // nodes[k]: the + whose right operand is leaves[k]
    size_t n = 0;
    const Expr* cur = &e;
    while (cur->kind == EK::binary && jinja_is(cur->name, "+") && n < 63) {
      nodes[n] = cur;
      leaves[n++] = cur->args[1].get();
      cur = cur->args[0].get();
    }
    leaves[n++] = cur;  // the leftmost operand
    const size_t start = out_->size();
    Value acc;
    bool plain = true;  // the operands so far: plain strings, appended
    for (size_t k = n; k-- > 0;) {
      Value v = eval(*leaves[k], f);
      try {
        if (plain) {
          if (v.is_string() && !v.is_markup()) {
            *out_ += v.str();
            continue;
          }
          plain = false;
          if (k == n - 1) {
            acc = std::move(v);
            continue;
          }
          acc = binary("+", Value(out_->substr(start)), v);
          out_->resize(start);
          continue;
        }
        acc = binary("+", acc, v);
      } catch (Error& x) {
        if (!x.line) x.line = nodes[k]->line, x.col = nodes[k]->col;
        throw;
      }
    }
    if (!plain) acc.append_str(*out_);
  }

  // The filter chain of a block set or {% filter %}, its subject the block's text.
  Value with_body(const Expr& chain, const FrameP& f, const Value& body) {
    auto inner = std::make_shared<Frame>();
    inner->parent = f;
    inner->vars.emplace_back(sym_body_, body);
    return eval(chain, inner);
  }

  Flow exec_for(const Stmt& s, const FrameP& f) {
    const Value seq = eval(*s.exprs[0], f);
    if (seq.is_none() || seq.is_int() || seq.type() == Value::T::floating || seq.is_func() || seq.is_ns())
      type_error("'" + seq.type_name() + "' object is not iterable");
    List items = iterate(seq);
    auto bind = [&](Frame& fr, const Value& item) {
      if (s.names.size() == 1) {
        fr.set(s.syms[0], item);
        return;
      }
      const List parts = iterate(item);
      if (parts.size() != s.names.size())
        throw Error("cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(s.names.size()));
      for (size_t k = 0; k < parts.size(); ++k) fr.set(s.syms[k], parts[k]);
    };
    if (s.exprs[1]) {  // for x in xs if cond: the loop sees the items that pass
      List kept;
      for (const auto& item : items) {
        auto fr = std::make_shared<Frame>();
        fr->parent = f;
        bind(*fr, item);
        if (eval(*s.exprs[1], fr).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (!s.bodies[1].empty()) return exec(s.bodies[1], f);
      return Flow::normal;
    }
    const int64_t n = int64_t(items.size());
    Value loop = Value::dict();
    auto index0 = std::make_shared<int64_t>(0);
    auto& d = loop.map().items;
    d.reserve(12);
    static const std::vector<Value> keys = {"index0", "index",    "revindex", "revindex0", "first", "last",
                                            "length", "previtem", "nextitem", "depth",     "depth0", "cycle"};
    for (size_t k = 0; k + 1 < keys.size(); ++k) d.emplace_back(keys[k], Value());
    d[6].second = Value(n);
    d[9].second = Value(int64_t(1));
    d[10].second = Value(int64_t(0));
    d.emplace_back(keys.back(), Value::func(
                                       [index0](CallArgs& a) -> Value {
                                         if (a.pos.empty()) type_error("no items for cycling given");
                                         return a.pos[size_t(*index0 % int64_t(a.pos.size()))];
                                       },
                                       "loop.cycle"));
    FrameP fr;
    for (int64_t i = 0; i < n; ++i) {
      *index0 = i;
      d[0].second = Value(i);
      d[1].second = Value(i + 1);
      d[2].second = Value(n - i);
      d[3].second = Value(n - i - 1);
      d[4].second = Value(i == 0);
      d[5].second = Value(i == n - 1);
      static const Value no_prev = Value::undefined("there is no previous item");
      static const Value no_next = Value::undefined("there is no next item");
      d[7].second = i > 0 ? items[size_t(i - 1)] : no_prev;
      d[8].second = i + 1 < n ? items[size_t(i + 1)] : no_next;
      if (!fr || fr.use_count() > 1) {  // a fresh scope unless nothing (a macro) kept the last one
        fr = std::make_shared<Frame>();
        fr->parent = f;
        fr->vars.reserve(4);
      } else {
        fr->vars.clear();
      }
      fr->vars.emplace_back(sym_loop_, loop);
      bind(*fr, items[size_t(i)]);
      const Flow fl = exec(s.bodies[0], fr);
      if (fl == Flow::break_) break;
    }
    return Flow::normal;
  }

  Value macro(const Stmt& s, const FrameP& defined_in, const std::string& name) {
    const Stmt* sp = &s;
    return Value::func(
        [this, sp, defined_in, name](CallArgs& a) -> Value {
          if (a.pos.size() > sp->params.size())
            throw Error("macro '" + name + "' takes not more than " + std::to_string(sp->params.size()) +
                        " argument(s)");
          if (++depth_ > 200) throw Error("macro recursion too deep");
          auto fr = std::make_shared<Frame>();
          fr->parent = defined_in;
          for (size_t i = 0; i < sp->params.size(); ++i) {
            const auto& [pname, def] = sp->params[i];
            const Value* given = a.get(i, pname.c_str());
            const Sym psym = sp->param_syms[i];
            if (given) fr->vars.emplace_back(psym, *given);
            else if (def) fr->vars.emplace_back(psym, eval(*def, fr));
            else fr->vars.emplace_back(psym, Value::undefined("'" + pname + "'"));
          }
          for (const auto& [k, v] : a.kw) {
            bool known = jinja_is(k, "caller");
            for (const auto& pr : sp->params) known = known || pr.first == k;
            if (!known) throw Error("macro '" + name + "' takes no keyword argument '" + k + "'");
            if (jinja_is(k, "caller")) fr->vars.emplace_back(sym_caller_, v);
          }
          std::string body;
          try {
            body = capture(sp->bodies[0], fr);
          } catch (...) {
            --depth_;
            throw;
          }
          --depth_;
          return Value(std::move(body));
        },
        name);
  }

  // --- expressions ---------------------------------------------------------------

  Value eval(const Expr& e, const FrameP& f) {
    try {
      return eval_inner(e, f);
    } catch (Error& x) {
      if (!x.line) x.line = e.line, x.col = e.col;
      throw;
    }
  }

  CallArgs args_of(const Expr& e, const FrameP& f, size_t skip = 1) {
    CallArgs a;
    for (size_t i = skip; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], f));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v, f));
    return a;
  }

  Value call(const Value& callee, CallArgs& a) {
    if (callee.is_undefined()) undefined_error(callee);
    if (!callee.is_func()) type_error("'" + callee.type_name() + "' object is not callable");
    return callee.fn()(a);
  }

  // dict_miss: the Undefined for a dict without `name`, when the caller has it built.
  Value attribute(const Value& obj, const std::string& name, const Value* dict_miss = nullptr) {
    if (obj.is_undefined()) undefined_error(obj);
    if (!name.empty() && name[0] == '_') return Value::undefined("'" + name + "'");
    if (obj.is_dict()) {
      if (known_method(obj, name) || unsafe_method(obj, name)) return bound_method(obj, name);
      if (const Value* v = obj.map().find(name)) return *v;
      if (dict_miss && !dict_miss->undefined_name().empty()) return *dict_miss;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    if (obj.is_ns()) {
      if (const Value* v = obj.map().find(name)) return *v;
      return Value::undefined("'Namespace' has no attribute '" + name + "'");
    }
    if (obj.is_group() && (jinja_is(name, "grouper") || jinja_is(name, "list"))) return obj.list()[jinja_is(name, "list")];
    if (known_method(obj, name) || unsafe_method(obj, name)) return bound_method(obj, name);
    return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'");
  }

  Value item(const Value& obj, const Value& key, const Value* dict_miss = nullptr) {
    if (obj.is_undefined()) undefined_error(obj);
    if (obj.is_dict()) {
      if (const Value* v = obj.map().find(key)) return *v;
      if (key.is_string()) return attribute(obj, key.str(), dict_miss);
      return Value::undefined("'dict object' has no attribute " + key.repr());
    }
    if (obj.is_list() && key.is_int()) {
      const int64_t n = int64_t(obj.list().size()), i = index_of(key.as_int(), n);
      if (i < 0 || i >= n) return Value::undefined("list index out of range");
      return obj.list()[size_t(i)];
    }
    if (obj.is_string() && key.is_int()) {
      const auto off = utf8_offsets(obj.str());
      const int64_t n = int64_t(off.size()) - 1, i = index_of(key.as_int(), n);
      if (i < 0 || i >= n) return Value::undefined("string index out of range");
      return Value(obj.str().substr(off[size_t(i)], off[size_t(i) + 1] - off[size_t(i)]));
    }
    if (key.is_string()) return attribute(obj, key.str());
    return Value::undefined("no item " + key.repr());
  }

  Value bound_method(const Value& obj, const std::string& name) {
    return Value::func([this, obj, name](CallArgs& a) { return method(obj, name, a); }, name);
  }

  Value method(const Value& obj, const std::string& name, CallArgs& a) {
    if (unsafe_method(obj, name))
      throw Error("access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe");
    if (obj.is_string()) return string_method(obj.str(), name, a);
    if (obj.is_dict()) {
      if (jinja_is(name, "items")) return items_of(obj);
      if (jinja_is(name, "keys")) return Value(iterate(obj));
      if (jinja_is(name, "values")) {
        List l;
        for (const auto& kv : obj.map().items) l.push_back(kv.second);
        return Value(std::move(l));
      }
      if (jinja_is(name, "get")) {
        if (a.pos.empty()) type_error("get expected at least 1 argument");
        const Value* v = obj.map().find(a.pos[0]);
        return v ? *v : a.pos.size() > 1 ? a.pos[1] : Value::none();
      }
      if (jinja_is(name, "copy")) {
        Value d = Value::dict();
        d.map().items = obj.map().items;
        return d;
      }
    }
    if (obj.is_list()) {
      if (jinja_is(name, "copy")) return Value(obj.list());
      if (a.pos.empty()) type_error(name + "() takes exactly one argument");
      int64_t n = 0;
      for (size_t i = 0; i < obj.list().size(); ++i)
        if (equal(obj.list()[i], a.pos[0])) {
          if (jinja_is(name, "index")) return Value(int64_t(i));
          ++n;
        }
      if (jinja_is(name, "index")) throw Error(a.pos[0].repr() + " is not in list");
      return Value(n);
    }
    throw Error("'" + obj.type_name() + "' object has no attribute '" + name + "'");
  }

  Value eval_inner(const Expr& e, const FrameP& f) {
    switch (e.kind) {
      case EK::literal: return e.value;
      case EK::name: {
        if (const Value* v = f->find(e.sym)) return *v;
        return e.value;
      }
      case EK::attr: return attribute(eval(*e.args[0], f), e.name, &e.value);
      case EK::item: return item(eval(*e.args[0], f), eval(*e.args[1], f), &e.value);
      case EK::slice: {
        const Value obj = eval(*e.args[0], f);
        Value parts[3];
        for (int i = 0; i < 3; ++i)
          if (e.has[i]) parts[i] = eval(*e.args[size_t(i) + 1], f);
        auto p = [&](int i) -> const Value* { return e.has[i] ? &parts[i] : nullptr; };
        if (obj.is_undefined()) undefined_error(obj);
        if (obj.is_list()) {
          List out;
          for (int64_t i : slice_indices(int64_t(obj.list().size()), p(0), p(1), p(2)))
            out.push_back(obj.list()[size_t(i)]);
          return obj.is_tuple() ? Value::tuple(std::move(out)) : Value(std::move(out));
        }
        if (obj.is_string()) {
          const auto& s = obj.str();
          const auto off = utf8_offsets(s);
          const int64_t n = int64_t(off.size()) - 1;
          const auto idx = slice_indices(n, p(0), p(1), p(2));
          std::string out;
          const bool step1 = !e.has[2] || (parts[2].is_int() && parts[2].as_int() == 1);
          if (step1 && !idx.empty()) return Value(s.substr(off[size_t(idx.front())], off[size_t(idx.back()) + 1] - off[size_t(idx.front())]));
          for (int64_t i : idx) out.append(s, off[size_t(i)], off[size_t(i) + 1] - off[size_t(i)]);
          return Value(std::move(out));
        }
        return Value::undefined("'" + obj.type_name() + "' object is not subscriptable");
      }
      case EK::call: {
        const Expr& callee = *e.args[0];
        if (callee.kind == EK::attr) {  // a method call: no bound closure built
          const Value obj = eval(*callee.args[0], f);
          if (obj.is_undefined()) undefined_error(obj);
          if (known_method(obj, callee.name) || unsafe_method(obj, callee.name)) {
            CallArgs a = args_of(e, f);
            return method(obj, callee.name, a);
          }
          Value fn = attribute(obj, callee.name);
          CallArgs a = args_of(e, f);
          return call(fn, a);
        }
        Value fn = eval(callee, f);
        CallArgs a = args_of(e, f);
        return call(fn, a);
      }
      case EK::filter: {
        Value subject = eval(*e.args[0], f);
        CallArgs a = args_of(e, f);
        return apply_filter(e.name, subject, a);
      }
      case EK::test: {
        Value subject = eval(*e.args[0], f);
        CallArgs a = args_of(e, f);
        const bool r = apply_test(e.name, subject, a);
        return Value(e.negated ? !r : r);
      }
      case EK::neg:
      case EK::pos: {
        const Value v = eval(*e.args[0], f);
        if (v.is_undefined()) undefined_error(v);
        if (!v.is_number()) type_error("bad operand type for unary " + std::string(e.kind == EK::neg ? "-" : "+") + ": '" + v.type_name() + "'");
        if (e.kind == EK::pos) return v.is_bool() ? Value(v.as_int()) : v;
        return v.type() == Value::T::floating ? Value(-v.as_double()) : Value(-v.as_int());
      }
      case EK::not_: return Value(!eval(*e.args[0], f).truthy());
      case EK::and_: {
        Value a = eval(*e.args[0], f);
        return a.truthy() ? eval(*e.args[1], f) : a;
      }
      case EK::or_: {
        Value a = eval(*e.args[0], f);
        return a.truthy() ? a : eval(*e.args[1], f);
      }
      case EK::cond:
        if (eval(*e.args[0], f).truthy()) return eval(*e.args[1], f);
        return e.args[2] ? eval(*e.args[2], f) : Value::undefined();
      case EK::binary: return binary(e.name, eval(*e.args[0], f), eval(*e.args[1], f));
      case EK::compare: {
        Value left = eval(*e.args[0], f);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], f);
          if (!compare(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case EK::concat: {
        std::string s;
        for (const auto& a : e.args) eval(*a, f).append_str(s);
        return Value(std::move(s));
      }
      case EK::list:
      case EK::tuple: {
        List l;
        l.reserve(e.args.size());
        for (const auto& a : e.args) l.push_back(eval(*a, f));
        return e.kind == EK::tuple ? Value::tuple(std::move(l)) : Value(std::move(l));
      }
      case EK::dict: {
        Value d = Value::dict();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) d.map().set(eval(*e.args[i], f), eval(*e.args[i + 1], f));
        return d;
      }
    }
    return Value();
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (jinja_is(op, "==")) return equal(a, b);
    if (jinja_is(op, "!=")) return !equal(a, b);
    if (jinja_is(op, "in") || jinja_is(op, "notin")) {
      bool in = false;
      if (b.is_string()) {
        if (!a.is_string()) type_error("'in <string>' requires string as left operand, not " + a.type_name());
        in = b.str().find(a.str()) != std::string::npos;
      } else if (b.is_list()) {
        for (const auto& x : b.list()) in = in || equal(x, a);
      } else if (b.is_dict() || b.is_ns()) {
        in = b.map().find(a) != nullptr;
      } else if (b.is_gen()) {  // consumes it up to the match, as Python does
        Value x;
        while (!in && b.gen().next(x)) in = equal(x, a);
      } else if (b.is_undefined()) {
        in = false;
      } else {
        type_error("argument of type '" + b.type_name() + "' is not iterable");
      }
      return jinja_is(op, "in") ? in : !in;
    }
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    if (jinja_is(op, "<")) return less(a, b);
    if (jinja_is(op, ">")) return less(b, a);
    if (jinja_is(op, "<=")) return less(a, b) || equal(a, b);
    return less(b, a) || equal(a, b);  // >=
  }

  static Value binary(const std::string& op, const Value& a, const Value& b) {
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    const bool ints = a.is_int() && b.is_int(), nums = a.is_number() && b.is_number();
    auto unsupported = [&]() -> Value {
      type_error("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
    };
    if (jinja_is(op, "+")) {
      if (ints) return Value(a.as_int() + b.as_int());
      if (nums) return Value(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) {
        if (a.is_markup() != b.is_markup())
          return Value::markup(a.is_markup() ? a.str() + html_escape(b.str()) : html_escape(a.str()) + b.str());
        return a.is_markup() ? Value::markup(a.str() + b.str()) : Value(a.str() + b.str());
      }
      if (a.is_list() && b.is_list()) {
        if (a.is_tuple() != b.is_tuple())
          type_error(std::string("can only concatenate ") + (a.is_tuple() ? "tuple" : "list") + " (not \"" +
                     b.type_name() + "\") to " + (a.is_tuple() ? "tuple" : "list"));
        List l = a.list();
        l.insert(l.end(), b.list().begin(), b.list().end());
        return a.is_tuple() ? Value::tuple(std::move(l)) : Value(std::move(l));
      }
      if (a.is_string() || b.is_string())
        type_error("can only concatenate str (not \"" + (a.is_string() ? b : a).type_name() + "\") to str");
      return unsupported();
    }
    if (jinja_is(op, "-")) {
      if (ints) return Value(a.as_int() - b.as_int());
      if (nums) return Value(a.as_double() - b.as_double());
      return unsupported();
    }
    if (jinja_is(op, "*")) {
      if (ints) return Value(a.as_int() * b.as_int());
      if (nums) return Value(a.as_double() * b.as_double());
      const Value* seq = a.is_int() ? &b : &a;
      const Value* count = a.is_int() ? &a : &b;
      if (count->is_int() && (seq->is_string() || seq->is_list())) {
        const int64_t n = std::max<int64_t>(0, count->as_int());
        if (seq->is_string()) {
          std::string s;
          for (int64_t i = 0; i < n; ++i) s += seq->str();
          return Value(std::move(s));
        }
        List l;
        for (int64_t i = 0; i < n; ++i) l.insert(l.end(), seq->list().begin(), seq->list().end());
        return seq->is_tuple() ? Value::tuple(std::move(l)) : Value(std::move(l));
      }
      return unsupported();
    }
    if (jinja_is(op, "/")) {
      if (!nums) return unsupported();
      if (b.as_double() == 0) throw Error("division by zero");
      return Value(a.as_double() / b.as_double());
    }
    if (jinja_is(op, "//")) {
      if (ints) return Value(floor_div(a.as_int(), b.as_int()));
      if (!nums) return unsupported();
      if (b.as_double() == 0) throw Error("float floor division by zero");
      return Value(std::floor(a.as_double() / b.as_double()));
    }
    if (jinja_is(op, "%")) {
      if (a.is_string()) return Value(percent_format(a.str(), b));
      if (ints) return Value(py_mod(a.as_int(), b.as_int()));
      if (!nums) return unsupported();
      if (b.as_double() == 0) throw Error("float modulo");
      double r = std::fmod(a.as_double(), b.as_double());
      if (r != 0 && ((r < 0) != (b.as_double() < 0))) r += b.as_double();
      return Value(r);
    }
    if (jinja_is(op, "**")) {
      if (ints && b.as_int() >= 0) {
        int64_t r = 1;
        for (int64_t i = 0; i < b.as_int(); ++i) r *= a.as_int();
        return Value(r);
      }
      if (!nums) return unsupported();
      return Value(std::pow(a.as_double(), b.as_double()));
    }
    return unsupported();
  }

  // --- filters and tests ------------------------------------------------------

  bool apply_test(const std::string& name, const Value& v, CallArgs& a) {
    auto arg = [&](size_t i) -> const Value& {
      if (i >= a.pos.size()) type_error("test '" + name + "' needs an argument");
      return a.pos[i];
    };
    if (jinja_is(name, "defined")) return !v.is_undefined();
    if (jinja_is(name, "undefined")) return v.is_undefined();
    if (jinja_is(name, "none")) return v.is_none();
    if (jinja_is(name, "boolean")) return v.is_bool();
    if (jinja_is(name, "true")) return v.is_bool() && v.as_int();
    if (jinja_is(name, "false")) return v.is_bool() && !v.as_int();
    if (jinja_is(name, "integer")) return v.type() == Value::T::integer;
    if (jinja_is(name, "float")) return v.type() == Value::T::floating;
    if (jinja_is(name, "number")) return v.is_number();
    if (jinja_is(name, "string")) return v.is_string();
    if (jinja_is(name, "mapping")) return v.is_dict();
    if (jinja_is(name, "iterable")) return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined() || v.is_gen();
    if (jinja_is(name, "sequence")) return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
    if (jinja_is(name, "callable")) return v.is_func();
    if (jinja_is(name, "escaped")) return false;
    if (jinja_is(name, "odd") || jinja_is(name, "even")) {
      if (!v.is_int()) type_error("not all arguments converted during string formatting");
      return (py_mod(v.as_int(), 2) == 1) == (jinja_is(name, "odd"));
    }
    if (jinja_is(name, "divisibleby")) {
      const Value& d = arg(0);
      if (!v.is_int() || !d.is_int()) type_error("divisibleby takes integers");
      return py_mod(v.as_int(), d.as_int()) == 0;
    }
    if (jinja_is(name, "eq") || jinja_is(name, "equalto") || jinja_is(name, "==")) return equal(v, arg(0));
    if (jinja_is(name, "ne") || jinja_is(name, "!=")) return !equal(v, arg(0));
    if (jinja_is(name, "lt") || jinja_is(name, "lessthan") || jinja_is(name, "<")) return compare("<", v, arg(0));
    if (jinja_is(name, "le") || jinja_is(name, "<=")) return compare("<=", v, arg(0));
    if (jinja_is(name, "gt") || jinja_is(name, "greaterthan") || jinja_is(name, ">")) return compare(">", v, arg(0));
    if (jinja_is(name, "ge") || jinja_is(name, ">=")) return compare(">=", v, arg(0));
    if (jinja_is(name, "in")) return compare("in", v, arg(0));
    if (jinja_is(name, "sameas")) {
      const Value& o = arg(0);
      if (v.is_none() || o.is_none() || v.is_bool() || o.is_bool())
        return v.type() == o.type() && (v.is_none() || v.as_int() == o.as_int());
      if (v.is_list() && o.is_list()) return &v.list() == &o.list();
      if ((v.is_dict() || v.is_ns() || v.is_gen() || v.is_func()) && v.type() == o.type())
        return v.identity() == o.identity();
      return v.is_string() && o.is_string() && &v.str() == &o.str();
    }
    if (jinja_is(name, "lower") || jinja_is(name, "upper")) {
      if (!v.is_string()) return false;
      CallArgs none;
      return string_method(v.str(), jinja_is(name, "lower") ? "islower" : "isupper", none).truthy();
    }
    if (jinja_is(name, "filter")) return v.is_string() && is_filter_name(v.str());
    if (jinja_is(name, "test")) return v.is_string() && is_test_name(v.str());
    throw Error("no test named '" + name + "'");
  }

  static bool is_filter_name(const std::string& n) {
    static const char* names[] = {"abs", "attr", "batch", "capitalize", "center", "count", "d", "default",
                                  "dictsort", "e", "escape", "filesizeformat", "first", "float", "forceescape",
                                  "format", "groupby", "indent", "int", "items", "join", "last", "length", "list",
                                  "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse",
                                  "round", "safe", "select", "selectattr", "slice", "sort", "string", "sum",
                                  "title", "tojson", "trim", "truncate", "unique", "upper", "urlencode",
                                  "wordcount"};
    for (const char* x : names)
      if (n == x) return true;
    return false;
  }
  static bool is_jinja_filter(const std::string& n) {
    // pprint (pformat's line breaking), random (not reproducible), striptags (HTML entities), urlize,
    // wordwrap (textwrap), xmlattr: no chat template needs them.
    static const char* names[] = {"pprint", "random", "striptags", "urlize", "wordwrap", "xmlattr"};
    for (const char* x : names)
      if (n == x) return true;
    return false;
  }
  static bool is_test_name(const std::string& n) {
    static const char* names[] = {"boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped",
                                  "even", "false", "float", "ge", "gt", "greaterthan", "in", "integer", "iterable",
                                  "le", "lessthan", "lower", "lt", "mapping", "ne", "none", "number", "odd",
                                  "sameas", "sequence", "string", "true", "undefined", "upper"};
    for (const char* x : names)
      if (n == x) return true;
    return false;
  }

  // An item's attribute for map/selectattr/sort/...: "a.b" and "0" as jinja2 reads them.
  Value attr_path(const Value& v, const std::string& path) {
    Value cur = v;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      cur = digits ? item(cur, Value(int64_t(std::stoll(part)))) : item(cur, Value(part));
      if (dot == std::string::npos) return cur;
      start = dot + 1;
    }
  }

  static std::string key_text(const Value& v, bool case_sensitive) {
    if (!v.is_string() || case_sensitive) return {};
    return ascii_lower(v.str());
  }
  static bool sort_less(const Value& a, const Value& b, bool case_sensitive) {
    if (!case_sensitive && a.is_string() && b.is_string()) return ascii_lower(a.str()) < ascii_lower(b.str());
    return less(a, b);
  }

  Value apply_filter(const std::string& name, const Value& v, CallArgs& a) {
    auto opt = [&](size_t i, const char* key) -> const Value* { return a.get(i, key); };
    auto flag = [&](size_t i, const char* key, bool def) {
      const Value* x = opt(i, key);
      return x ? x->truthy() : def;
    };
    auto need_str = [&](const Value& x) {
      if (x.is_undefined()) return std::string();
      return x.to_str();
    };
    if (jinja_is(name, "safe")) return v.is_string() ? Value::markup(v.str()) : Value::markup(v.to_str());
    if (jinja_is(name, "string")) return v.is_string() ? v : Value(v.to_str());
    if (jinja_is(name, "tojson")) {
      // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      const Value* ascii = opt(0, "ensure_ascii");
      const Value* indent = opt(1, "indent");
      const Value* seps = opt(2, "separators");
      const Value* sort = opt(3, "sort_keys");
      if (v.is_undefined()) throw Error("Object of type Undefined is not JSON serializable");
      int ind = -1;
      std::string istr;
      const std::string* ip = nullptr;
      if (indent && !indent->is_none()) {
        if (indent->is_string()) istr = indent->str(), ip = &istr;
        else if (indent->is_int()) ind = int(std::max<int64_t>(0, indent->as_int()));
        else type_error("indent must be an int or a string");
        if (!ip) istr = std::string(size_t(ind), ' '), ip = &istr;
      }
      std::string is, ks;
      const std::string *isp = nullptr, *ksp = nullptr;
      if (seps && !seps->is_none()) {
        const List l = iterate(*seps);
        if (l.size() != 2 || !l[0].is_string() || !l[1].is_string()) type_error("separators must be (item, key)");
        is = l[0].str(), ks = l[1].str();
        isp = &is, ksp = &ks;
      }
      return Value(v.to_json(ind, ip, isp, ksp, sort && sort->truthy(), ascii && ascii->truthy()));
    }
    if (jinja_is(name, "length") || jinja_is(name, "count")) {
      switch (v.type()) {
        case Value::T::undefined: return Value(int64_t(0));
        case Value::T::string: return Value(int64_t(utf8_length(v.str())));
        case Value::T::list: return Value(int64_t(v.list().size()));
        case Value::T::dict: return Value(int64_t(v.map().items.size()));
        default: type_error("object of type '" + v.type_name() + "' has no len()");
      }
    }
    if (jinja_is(name, "trim")) {
      const Value* chars = opt(0, "chars");
      return Value(py_strip(need_str(v), chars && !chars->is_none() ? &chars->str() : nullptr, true, true));
    }
    if (jinja_is(name, "upper")) return Value(ascii_upper(need_str(v)));
    if (jinja_is(name, "lower")) return Value(ascii_lower(need_str(v)));
    if (jinja_is(name, "capitalize")) return Value(capitalize(need_str(v)));
    if (jinja_is(name, "title")) {
      CallArgs none;
      return string_method(need_str(v), "title", none);
    }
    if (jinja_is(name, "default") || jinja_is(name, "d")) {
      const Value* def = opt(0, "default_value");
      const bool boolean = flag(1, "boolean", false);
      if (v.is_undefined() || (boolean && !v.truthy())) return def ? *def : Value(std::string());
      return v;
    }
    if (jinja_is(name, "join")) {
      const Value* sep = opt(0, "d");
      const Value* attr = opt(1, "attribute");
      std::string out;
      bool first = true;
      for (const auto& x : iterate(v)) {
        if (!first) out += sep ? sep->to_str() : "";
        first = false;
        (attr ? attr_path(x, attr->to_str()) : x).append_str(out);
      }
      return Value(std::move(out));
    }
    if (jinja_is(name, "first")) {
      if (v.is_string()) return v.str().empty() ? Value::undefined("No first item") : item(v, Value(int64_t(0)));
      if (v.is_gen()) {  // next(iter(seq)): one item taken
        Value x;
        return v.gen().next(x) ? x : Value::undefined("No first item, sequence was empty.");
      }
      const List l = iterate(v);
      return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
    }
    if (jinja_is(name, "last")) {
      if (v.is_undefined()) undefined_error(v);
      if (v.is_gen()) type_error("'" + v.type_name() + "' object is not reversible");
      const List l = iterate(v);
      return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
    }
    if (jinja_is(name, "list")) return Value(iterate(v));
    if (jinja_is(name, "items")) {  // a generator in jinja2: a non-mapping raises when it is iterated
      return jinja_lazy([v]() -> JinjaPull {
        if (v.is_undefined()) return nullptr;
        if (!v.is_dict()) type_error("Can only get item pairs from a mapping.");
        return jinja_iter_of(items_of(v));
      });
    }
    if (jinja_is(name, "reverse")) {
      if (v.is_string()) {
        const auto off = utf8_offsets(v.str());
        std::string out;
        for (size_t i = off.size() - 1; i > 0; --i) out.append(v.str(), off[i - 1], off[i] - off[i - 1]);
        return Value(std::move(out));
      }
      // reversed(value): an iterator over a list or a dict's keys; anything else (a generator) as a list
      if (v.is_list() || v.is_dict()) {
        Value seq = v.is_list() ? v : Value(iterate(v));
        return Value::generator(
            [seq, i = seq.list().size()](Value& out) mutable {
              if (i == 0) return false;
              out = seq.list()[--i];
              return true;
            },
            v.is_list() ? "list_reverseiterator" : "dict_reversekeyiterator");
      }
      List l = iterate(v);
      std::reverse(l.begin(), l.end());
      return Value(std::move(l));
    }
    if (jinja_is(name, "map")) {  // jinja2: `if value: for item in value: yield func(item)`, all of it lazy
      return jinja_lazy([this, v, a]() -> JinjaPull {
        if (!v.truthy()) return nullptr;
        std::function<Value(const Value&)> func;
        const Value* attr = nullptr;
        const Value* def = nullptr;
        for (const auto& [k, x] : a.kw) {
          if (jinja_is(k, "attribute")) attr = &x;
          if (jinja_is(k, "default")) def = &x;
        }
        if (attr && a.pos.empty()) {  // make_attrgetter(attribute, default): a None default is none
          const std::string path = attr->to_str();
          const Value fallback = def ? *def : Value();
          const bool has_def = def && !def->is_none();
          func = [this, path, fallback, has_def](const Value& x) {
            Value r = attr_path(x, path);
            return r.is_undefined() && has_def ? fallback : r;
          };
        } else {
          if (a.pos.empty()) type_error("map requires a filter argument");
          const std::string fname = a.pos[0].to_str();
          const bool known = is_filter_name(fname);
          CallArgs rest;
          rest.pos.assign(a.pos.begin() + 1, a.pos.end());
          rest.kw = a.kw;
          func = [this, fname, known, rest](const Value& x) {
            if (!known) throw Error("No filter named '" + fname + "'.");  // per item, as jinja2's call_filter
            CallArgs r = rest;
            return apply_filter(fname, x, r);
          };
        }
        return [func, in = jinja_iter_of(v)](Value& out) {
          Value x;
          if (!in(x)) return false;
          out = func(x);
          return true;
        };
      });
    }
    if (jinja_is(name, "select") || jinja_is(name, "reject") || jinja_is(name, "selectattr") || jinja_is(name, "rejectattr")) {
      return jinja_lazy([this, v, a, name]() -> JinjaPull {
        if (!v.truthy()) return nullptr;
        const bool attr = name.back() == 'r';
        const bool keep_if = name[0] == 's';
        size_t at = 0;
        std::string path;
        if (attr) {
          if (a.pos.empty()) type_error("Missing parameter for attribute name");
          path = a.pos[0].to_str();
          at = 1;
        }
        std::string test;
        CallArgs targs;
        bool known = true;
        if (a.pos.size() > at) {
          test = a.pos[at].to_str();
          known = is_test_name(test);
          targs.pos.assign(a.pos.begin() + long(at) + 1, a.pos.end());
          targs.kw = a.kw;
        }
        return [this, attr, keep_if, path, test, known, targs, in = jinja_iter_of(v)](Value& out) {
          Value x;
          while (in(x)) {
            const Value subject = attr ? attr_path(x, path) : x;
            bool r;
            if (test.empty()) {
              r = subject.truthy();
            } else {
              if (!known) throw Error("No test named '" + test + "'.");
              CallArgs t = targs;
              r = apply_test(test, subject, t);
            }
            if (r == keep_if) {
              out = std::move(x);
              return true;
            }
          }
          return false;
        };
      });
    }
    if (jinja_is(name, "unique")) {  // a generator in jinja2; keys go into a set (lists and dicts are unhashable)
      const bool cs = flag(0, "case_sensitive", false);
      const Value* attr_arg = opt(1, "attribute");
      const bool has_attr = attr_arg != nullptr;
      const std::string path = attr_arg ? attr_arg->to_str() : "";
      return jinja_lazy([this, v, cs, has_attr, path]() -> JinjaPull {
        auto seen = std::make_shared<List>();
        return [this, cs, has_attr, path, seen, in = jinja_iter_of(v)](Value& out) {
          Value x;
          while (in(x)) {
            Value key = has_attr ? attr_path(x, path) : x;
            if (!cs && key.is_string()) key = Value(ascii_lower(key.str()));
            if (key.is_list() || key.is_dict() || key.is_ns())
              type_error("unhashable type: '" + key.type_name() + "'");
            bool dup = false;
            for (const auto& k : *seen) dup = dup || equal(k, key);
            if (!dup) {
              seen->push_back(std::move(key));
              out = std::move(x);
              return true;
            }
          }
          return false;
        };
      });
    }
    if (jinja_is(name, "sort")) {
      const bool rev = flag(0, "reverse", false), cs = flag(1, "case_sensitive", false);
      const Value* attr = opt(2, "attribute");
      List l = iterate(v);
      // attribute="a,b.c": make_multi_attrgetter, the keys compared in turn
      std::vector<std::string> paths;
      if (attr) {
        const std::string all = attr->to_str();
        for (size_t at = 0;;) {
          const size_t comma = all.find(',', at);
          paths.push_back(all.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
          if (comma == std::string::npos) break;
          at = comma + 1;
        }
      }
      std::vector<std::pair<List, Value>> keyed;
      keyed.reserve(l.size());
      for (auto& x : l) {
        List key;
        if (paths.empty()) key.push_back(x);
        for (const auto& p : paths) key.push_back(attr_path(x, p));
        keyed.emplace_back(std::move(key), std::move(x));
      }
      auto key_less = [&](const List& kx, const List& ky) {
        for (size_t i = 0; i < kx.size(); ++i) {
          if (sort_less(kx[i], ky[i], cs)) return true;
          if (sort_less(ky[i], kx[i], cs)) return false;
        }
        return false;
      };
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
        return rev ? key_less(y.first, x.first) : key_less(x.first, y.first);
      });
      for (size_t i = 0; i < l.size(); ++i) l[i] = std::move(keyed[i].second);
      return Value(std::move(l));
    }
    if (jinja_is(name, "dictsort")) {
      if (!v.is_dict()) type_error("dictsort expects a mapping");
      const bool cs = flag(0, "case_sensitive", false);
      const Value* by = opt(1, "by");
      const bool rev = flag(2, "reverse", false);
      const bool by_value = by && by->is_string() && by->str() == "value";
      List l = items_of(v).list();
      std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
        const Value& kx = x.list()[by_value ? 1 : 0];
        const Value& ky = y.list()[by_value ? 1 : 0];
        return rev ? sort_less(ky, kx, cs) : sort_less(kx, ky, cs);
      });
      return Value(std::move(l));
    }
    if (jinja_is(name, "max") || jinja_is(name, "min")) {
      const bool cs = flag(0, "case_sensitive", false);
      const Value* attr = opt(1, "attribute");
      const List l = iterate(v);
      if (l.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      size_t best = 0;
      for (size_t i = 1; i < l.size(); ++i) {
        const Value ki = attr ? attr_path(l[i], attr->to_str()) : l[i];
        const Value kb = attr ? attr_path(l[best], attr->to_str()) : l[best];
        if (jinja_is(name, "max") ? sort_less(kb, ki, cs) : sort_less(ki, kb, cs)) best = i;
      }
      return l[best];
    }
    if (jinja_is(name, "sum")) {
      const Value* attr = opt(0, "attribute");
      const Value* start = opt(1, "start");
      Value total = start ? *start : Value(int64_t(0));
      for (const auto& x : iterate(v)) total = binary("+", total, attr ? attr_path(x, attr->to_str()) : x);
      return total;
    }
    if (jinja_is(name, "int")) {
      const Value* def = opt(0, "default");
      const Value fallback = def ? *def : Value(int64_t(0));
      if (v.is_int()) return Value(v.as_int());
      if (v.type() == Value::T::floating) return Value(int64_t(v.as_double()));
      if (v.is_string()) {
        const std::string s = py_strip(v.str(), nullptr, true, true);
        try {
          size_t used = 0;
          const long long x = std::stoll(s, &used, 10);
          if (used == s.size()) return Value(int64_t(x));
          const double d = std::stod(s, &used);
          if (used == s.size()) return Value(int64_t(d));
        } catch (const std::exception&) {
        }
      }
      return fallback;
    }
    if (jinja_is(name, "float")) {
      const Value* def = opt(0, "default");
      if (v.is_number()) return Value(v.as_double());
      if (v.is_string()) {
        try {
          size_t used = 0;
          const std::string s = py_strip(v.str(), nullptr, true, true);
          const double d = std::stod(s, &used);
          if (used == s.size()) return Value(d);
        } catch (const std::exception&) {
        }
      }
      return def ? *def : Value(0.0);
    }
    if (jinja_is(name, "abs")) {
      if (v.type() == Value::T::floating) return Value(std::fabs(v.as_double()));
      if (v.is_int()) return Value(int64_t(std::llabs(v.as_int())));
      type_error("bad operand type for abs(): '" + v.type_name() + "'");
    }
    if (jinja_is(name, "round")) {
      const Value* prec = opt(0, "precision");
      const Value* method = opt(1, "method");
      const int64_t p = prec ? prec->as_int() : 0;
      const std::string m = method ? method->to_str() : "common";
      if (!v.is_number()) type_error("round() of a " + v.type_name());
      if (jinja_is(m, "common") && v.is_int()) return Value(v.as_int());
      if (jinja_is(m, "common") && p >= 0 && p < 300 && std::isfinite(v.as_double())) {
        // Python's round(x, p): the exact binary value rounded half to even, as printf rounds it
        char buf[400];
        std::snprintf(buf, sizeof buf, "%.*f", int(p), v.as_double());
        return Value(std::strtod(buf, nullptr));
      }
      const double scale = std::pow(10.0, double(p));
      const double x = v.as_double() * scale;
      const double r = jinja_is(m, "ceil") ? std::ceil(x) : jinja_is(m, "floor") ? std::floor(x) : std::nearbyint(x);
      return Value(r / scale);
    }
    if (jinja_is(name, "replace")) {
      if (a.pos.size() < 2) type_error("replace() needs old and new");
      CallArgs r;
      r.pos = a.pos;
      return string_method(need_str(v), "replace", r);
    }
    if (jinja_is(name, "indent")) return Value(indent(need_str(v), opt(0, "width"), flag(1, "first", false), flag(2, "blank", false)));
    if (jinja_is(name, "center")) {
      CallArgs r;
      const Value* w = opt(0, "width");
      r.pos.push_back(w ? *w : Value(int64_t(80)));
      return string_method(need_str(v), "center", r);
    }
    if (jinja_is(name, "wordcount")) return Value(int64_t(py_split(need_str(v), nullptr, -1).size()));
    if (jinja_is(name, "e") || jinja_is(name, "escape") || jinja_is(name, "forceescape"))
      return v.is_markup() && name != "forceescape" ? v : Value::markup(html_escape(need_str(v)));
    if (jinja_is(name, "format")) {
      if (!a.pos.empty()) return Value(percent_format(need_str(v), Value::tuple(List(a.pos))));  // str % args
      return Value(need_str(v));
    }
    if (jinja_is(name, "attr")) {
      if (a.pos.empty()) type_error("attr() needs a name");
      const std::string n = a.pos[0].to_str();
      if (v.is_dict() && !known_method(v, n) && !unsafe_method(v, n))  // getattr only: no dict keys
        return Value::undefined("'dict object' has no attribute '" + n + "'");
      return attribute(v, n);
    }
    if (jinja_is(name, "batch")) {  // a generator of lists of linecount items, the last filled up with fill_with
      const Value count = a.pos.empty() ? (opt(0, "linecount") ? *opt(0, "linecount") : Value()) : a.pos[0];
      if (count.is_undefined()) type_error("do_batch() missing 1 required positional argument: 'linecount'");
      const Value* fill = opt(1, "fill_with");
      const Value fill_with = fill ? *fill : Value::none();
      return jinja_lazy([v, count, fill_with]() -> JinjaPull {
        auto pending = std::make_shared<List>();
        return [count, fill_with, pending, in = jinja_iter_of(v), ended = false](Value& out) mutable {
          Value x;
          while (!ended && in(x)) {
            if (equal(Value(pending->size()), count)) {
              out = Value(std::move(*pending));
              *pending = List{std::move(x)};
              return true;
            }
            pending->push_back(std::move(x));
          }
          ended = true;
          if (pending->empty()) return false;
          if (!fill_with.is_none() && count.is_int())
            while (int64_t(pending->size()) < count.as_int()) pending->push_back(fill_with);
          out = Value(std::move(*pending));
          pending->clear();
          return true;
        };
      });
    }
    if (jinja_is(name, "slice")) {  // a generator of `slices` lists, the first ones one longer, the rest filled up
      const Value* n_arg = opt(0, "slices");
      if (!n_arg) type_error("sync_do_slice() missing 1 required positional argument: 'slices'");
      const Value slices = *n_arg;
      const Value* fill = opt(1, "fill_with");
      const Value fill_with = fill ? *fill : Value::none();
      return jinja_lazy([v, slices, fill_with]() -> JinjaPull {
        const List seq = iterate(v);
        if (!slices.is_int()) type_error("'" + slices.type_name() + "' object cannot be interpreted as an integer");
        const int64_t n = slices.as_int(), length = int64_t(seq.size());
        const int64_t per = floor_div(length, n), extra = py_mod(length, n);
        auto parts = std::make_shared<List>();
        int64_t offset = 0;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t start = offset + k * per;
          if (k < extra) ++offset;
          const int64_t end = offset + (k + 1) * per;
          List part;  // seq[start:end]
          for (int64_t i = start; i < std::min(end, length); ++i) part.push_back(seq[size_t(i)]);
          if (!fill_with.is_none() && k >= extra) part.push_back(fill_with);
          parts->push_back(Value(std::move(part)));
        }
        return jinja_iter_of(Value(std::move(*parts)));
      });
    }
    if (jinja_is(name, "truncate")) {  // truncate(length=255, killwords=False, end='...', leeway=None): leeway 5
      const Value* len_arg = opt(0, "length");
      const Value* end_arg = opt(2, "end");
      const Value* lee_arg = opt(3, "leeway");
      const int64_t length = len_arg ? len_arg->as_int() : 255;
      const bool killwords = flag(1, "killwords", false);
      const std::string end = end_arg ? end_arg->to_str() : "...";
      const int64_t leeway = lee_arg && !lee_arg->is_none() ? lee_arg->as_int() : 5;  // policies["truncate.leeway"]
      const int64_t end_len = int64_t(utf8_length(end));
      if ((len_arg && !len_arg->is_int()) || (lee_arg && !lee_arg->is_none() && !lee_arg->is_int()))
        type_error("truncate() takes integer length and leeway");
      if (length < end_len) throw Error("expected length >= " + std::to_string(end_len) + ", got " + std::to_string(length));
      if (leeway < 0) throw Error("expected leeway >= 0, got " + std::to_string(leeway));
      if (v.is_undefined()) return v;
      if (!v.is_string()) {  // len(s) of a list or dict: kept when short, else (slicing then rsplit) refused
        CallArgs none;
        const Value len = apply_filter("length", v, none);
        if (len.as_int() <= length + leeway) return v;
        type_error("truncate() of a " + v.type_name());
      }
      const auto off = utf8_offsets(v.str());
      const int64_t n = int64_t(off.size()) - 1;
      if (n <= length + leeway) return v;
      std::string head = v.str().substr(0, off[size_t(length - end_len)]);
      if (killwords) return Value(head + end);
      const size_t sp = head.rfind(' ');  // rsplit(" ", 1)[0]
      if (sp != std::string::npos) head.resize(sp);
      return Value(head + end);
    }
    if (jinja_is(name, "groupby")) {  // sorted by the attribute, then grouped: a list of (grouper, list) tuples
      const Value* attr_arg = opt(0, "attribute");
      if (!attr_arg) type_error("sync_do_groupby() missing 1 required positional argument: 'attribute'");
      const std::string path = attr_arg->to_str();
      const Value* def = opt(1, "default");
      const bool cs = flag(2, "case_sensitive", false);
      auto key_of = [&](const Value& x, bool fold) {  // make_attrgetter(attribute, postprocess, default)
        Value cur = x;
        size_t start = 0;
        while (true) {
          const size_t dot = path.find('.', start);
          cur = attr_path(cur, path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
          if (def && !def->is_none() && cur.is_undefined()) cur = *def;
          if (dot == std::string::npos) break;
          start = dot + 1;
        }
        if (fold && cur.is_string()) return Value(ascii_lower(cur.str()));
        return cur;
      };
      List items = iterate(v);
      std::vector<std::pair<Value, Value>> keyed;
      keyed.reserve(items.size());
      for (auto& x : items) keyed.emplace_back(key_of(x, !cs), std::move(x));
      std::stable_sort(keyed.begin(), keyed.end(), [](const auto& p, const auto& q) { return less(p.first, q.first); });
      List out;
      for (size_t i = 0; i < keyed.size();) {
        size_t j = i;
        List group;
        while (j < keyed.size() && equal(keyed[j].first, keyed[i].first)) group.push_back(keyed[j++].second);
        Value grouper = cs ? keyed[i].first : key_of(group.front(), false);  // the first item's own case
        out.push_back(Value::tuple(List{std::move(grouper), Value(std::move(group))}, true));
        i = j;
      }
      return Value(std::move(out));
    }
    if (jinja_is(name, "filesizeformat")) {
      const bool binary = flag(0, "binary", false);
      CallArgs none;
      const Value as_float = apply_filter("float", v, none);
      if (!v.is_number() && !(v.is_string() && !as_float.is_undefined()))
        type_error("float() argument must be a string or a real number, not '" + v.type_name() + "'");
      const double bytes = as_float.as_double(), base = binary ? 1024 : 1000;
      static const char* dec[] = {"kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
      static const char* bin[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
      if (bytes == 1) return Value("1 Byte");
      if (bytes < base) return Value(std::to_string(int64_t(bytes)) + " Bytes");
      double unit = base;
      char buf[64];
      for (int i = 0; i < 8; ++i) {
        unit *= base;
        if (bytes < unit || i == 7) {
          std::snprintf(buf, sizeof buf, "%.1f %s", base * bytes / unit, binary ? bin[i] : dec[i]);
          return Value(std::string(buf));
        }
      }
    }
    if (jinja_is(name, "urlencode")) {  // urllib.parse.quote (a string: "/" kept) or key=value&... (for_qs: "+")
      auto quote = [](const std::string& s, bool qs) {
        std::string out;
        char buf[4];
        for (unsigned char c : s) {
          if (std::isalnum(c) || c == '_' || c == '.' || c == '-' || c == '~' || (c == '/' && !qs)) out += char(c);
          else if (c == ' ' && qs) out += '+';
          else std::snprintf(buf, sizeof buf, "%%%02X", c), out += buf;
        }
        return out;
      };
      if (v.is_string() || !(v.is_list() || v.is_dict() || v.is_gen())) return Value(quote(v.to_str(), false));
      std::string out;
      for (const auto& kv : v.is_dict() ? iterate(items_of(v)) : iterate(v)) {
        const List pair = iterate(kv);
        if (pair.size() != 2) type_error("cannot unpack a " + kv.type_name() + " into key, value");
        out += (out.empty() ? "" : "&") + quote(pair[0].to_str(), true) + "=" + quote(pair[1].to_str(), true);
      }
      return Value(std::move(out));
    }
    if (is_jinja_filter(name)) throw Error("the filter '" + name + "' is not supported");
    throw Error("no filter named '" + name + "'");
  }

  static std::string indent(const std::string& s0, const Value* width, bool first, bool blank) {
    std::string ind = width ? (width->is_string() ? width->str() : std::string(size_t(std::max<int64_t>(0, width->as_int())), ' '))
                            : std::string(4, ' ');
    const std::string s = s0 + "\n";
    const std::vector<std::string> lines = py_splitlines(s);
    std::string rv;
    if (blank) {
      for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
    } else {
      rv = lines.empty() ? "" : lines[0];
      for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind) + lines[i];
    }
    if (first) rv = ind + rv;
    return rv;
  }

  Value string_method(const std::string& s, const std::string& name, CallArgs& a) {
    return call_string_method(s, name, a);
  }
};

}  // namespace

RenderResult render(const Template& tpl, const Value& globals) {
  Interp in(tpl, globals);
  return in.run();
}

}  // namespace nnstrain::jinja
