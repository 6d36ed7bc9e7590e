#include "data/chat/jinja_parser.h"

#include <algorithm>
#include <set>

namespace nnstrain::jinja {

namespace {

using TK = Token::K;

// jinja2's built-in filters and tests (and transformers' tojson): a name outside
// these fails when jinja2 compiles the template (inside an if, when it is
// reached). A known one this engine lacks fails when it is reached.
const std::set<std::string> kJinjaFilters = {
    "abs", "attr", "batch", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape",
    "filesizeformat", "first", "float", "forceescape", "format", "groupby", "indent", "int", "items", "join",
    "last", "length", "list", "lower", "map", "max", "min", "pprint", "random", "reject", "rejectattr", "replace",
    "reverse", "round", "safe", "select", "selectattr", "slice", "sort", "string", "striptags", "sum", "title",
    "tojson", "trim", "truncate", "unique", "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"};
const std::set<std::string> kJinjaTests = {
    "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false", "filter",
    "float", "ge", "gt", "greaterthan", "in", "integer", "iterable", "le", "lessthan", "lower", "lt", "mapping",
    "ne", "none", "number", "odd", "sameas", "sequence", "string", "test", "true", "undefined", "upper", "==",
    "!=", ">", ">=", "<", "<="};

struct Parser {
  const std::vector<Token>& t;
  size_t p = 0;
  bool has_generation = false;
  int in_if = 0;  // jinja2 refuses an unknown filter or test when it compiles, except inside an if

  const Token& cur() const { return t[p]; }
  const Token& peek(size_t k = 1) const { return t[std::min(p + k, t.size() - 1)]; }
  [[noreturn]] void fail(const std::string& what, const Token& at) const { throw Error(what, at.line, at.col); }
  bool is_op(const char* o, size_t k = 0) const { return peek(k).kind == TK::op && peek(k).value == o; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).kind == TK::name && peek(k).value == n; }
  void expect_op(const char* o) {
    if (!is_op(o)) fail(std::string("expected '") + o + "'" + got(), cur());
    ++p;
  }
  std::string got() const {
    const auto& c = cur();
    switch (c.kind) {
      case TK::eof: return ", got the end of the template";
      case TK::block_end: return ", got the end of the tag";
      case TK::var_end: return ", got '}}'";
      case TK::text: return ", got template text";
      default: return ", got '" + c.value + "'";
    }
  }
  std::string expect_name() {
    if (cur().kind != TK::name) fail("expected a name" + got(), cur());
    return t[p++].value;
  }
  void expect_block_end() {
    if (cur().kind != TK::block_end) fail("expected the end of the tag" + got(), cur());
    ++p;
  }

  ExprP node(Expr::K k, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = at.line;
    e->col = at.col;
    return e;
  }

  // --- statements ---------------------------------------------------------

  // Statements up to a {% name %} in `until` (left unconsumed: p at that name).
  Body body(const std::set<std::string>& until, const Token& opened, const std::string& what) {
    Body b;
    while (true) {
      const Token& c = cur();
      if (c.kind == TK::eof) {
        if (until.empty()) return b;
        fail("{% " + what + " %} is not closed (" + *until.rbegin() + " missing)", opened);
      }
      if (c.kind == TK::text) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::K::text;
        s->line = c.line, s->col = c.col;
        s->text = c.value;
        b.push_back(std::move(s));
        ++p;
        continue;
      }
      if (c.kind == TK::var_begin) {
        ++p;
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::K::print;
        s->line = c.line, s->col = c.col;
        s->exprs.push_back(tuple(true));
        if (cur().kind != TK::var_end) fail("expected '}}'" + got(), cur());
        ++p;
        b.push_back(std::move(s));
        continue;
      }
      if (c.kind != TK::block_begin) fail("unexpected" + got().substr(5), c);
      const Token& n = peek();
      if (n.kind == TK::name && until.count(n.value)) {
        ++p;  // at the name
        return b;
      }
      ++p;
      b.push_back(statement(c));
    }
  }

  std::unique_ptr<Stmt> statement(const Token& open) {
    const Token& n = cur();
    if (n.kind != TK::name) fail("expected a tag name" + got(), n);
    const std::string tag = n.value;
    ++p;
    auto s = std::make_unique<Stmt>();
    s->line = open.line, s->col = open.col;
    if (tag == "if") {
      s->kind = Stmt::K::if_;
      ++in_if;
      s->exprs.push_back(tuple(true));
      expect_block_end();
      while (true) {
        s->bodies.push_back(body({"elif", "else", "endif"}, open, "if"));
        const std::string k = expect_name();
        if (k == "elif") {
          s->exprs.push_back(tuple(true));
          expect_block_end();
          continue;
        }
        expect_block_end();
        if (k == "else") {
          s->bodies.push_back(body({"endif"}, open, "if"));
          expect_name();
          expect_block_end();
        }
        break;
      }
      --in_if;
    } else if (tag == "for") {
      s->kind = Stmt::K::for_;
      s->names.push_back(expect_name());
      while (is_op(",")) {
        ++p;
        s->names.push_back(expect_name());
      }
      if (!is_name("in")) fail("expected 'in'" + got(), cur());
      ++p;
      s->exprs.push_back(tuple(false));
      if (is_name("if")) {
        ++p;
        s->exprs.push_back(expression(true));
      } else {
        s->exprs.emplace_back();
      }
      if (is_name("recursive")) fail("recursive for loops are not supported", cur());
      expect_block_end();
      s->bodies.push_back(body({"else", "endfor"}, open, "for"));
      if (expect_name() == "else") {
        expect_block_end();
        s->bodies.push_back(body({"endfor"}, open, "for"));
        expect_name();
      } else {
        s->bodies.emplace_back();
      }
      expect_block_end();
    } else if (tag == "set") {
      const std::string first = expect_name();
      s->names.push_back(first);
      if (is_op(".")) {
        ++p;
        s->names.push_back(expect_name());
        s->attr_target = true;
      } else {
        while (is_op(",")) {
          ++p;
          s->names.push_back(expect_name());
        }
      }
      if (is_op("=")) {
        ++p;
        s->kind = Stmt::K::set;
        s->exprs.push_back(tuple(true));
        expect_block_end();
      } else {
        s->kind = Stmt::K::set_block;
        if (s->names.size() != 1 || s->attr_target) fail("a block set takes one name", n);
        if (is_op("|")) s->exprs.push_back(filter_chain_on_body());
        expect_block_end();
        s->bodies.push_back(body({"endset"}, open, "set"));
        expect_name();
        expect_block_end();
      }
    } else if (tag == "macro") {
      s->kind = Stmt::K::macro;
      s->macro_name = expect_name();
      params(s->params);
      expect_block_end();
      s->bodies.push_back(body({"endmacro"}, open, "macro"));
      expect_name();
      if (cur().kind == TK::name) ++p;
      expect_block_end();
    } else if (tag == "call") {
      s->kind = Stmt::K::call_block;
      if (is_op("(")) params(s->params);
      auto c = expression(true);
      if (c->kind != Expr::K::call) fail("{% call %} expects a macro call", n);
      s->exprs.push_back(std::move(c));
      expect_block_end();
      s->bodies.push_back(body({"endcall"}, open, "call"));
      expect_name();
      expect_block_end();
    } else if (tag == "filter") {
      s->kind = Stmt::K::filter_block;
      s->exprs.push_back(filter_chain_on_body(true));
      expect_block_end();
      s->bodies.push_back(body({"endfilter"}, open, "filter"));
      expect_name();
      expect_block_end();
    } else if (tag == "generation") {
      s->kind = Stmt::K::generation;
      has_generation = true;
      expect_block_end();
      s->bodies.push_back(body({"endgeneration"}, open, "generation"));
      expect_name();
      expect_block_end();
    } else if (tag == "break" || tag == "continue") {
      s->kind = tag == "break" ? Stmt::K::break_ : Stmt::K::continue_;
      expect_block_end();
    } else {
      fail("unsupported tag '" + tag + "'", n);
    }
    return s;
  }

  void params(std::vector<std::pair<std::string, ExprP>>& out) {
    expect_op("(");
    while (!is_op(")")) {
      if (!out.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string name = expect_name();
      ExprP def;
      if (is_op("=")) {
        ++p;
        def = expression(true);
      }
      out.emplace_back(std::move(name), std::move(def));
    }
    ++p;
  }

  // `| f(args) | g` (or `f | g` for {% filter %}) applied to a placeholder for the block's text.
  ExprP filter_chain_on_body(bool bare_first = false) {
    auto subject = node(Expr::K::name, cur());
    subject->name = " body";
    ExprP e = std::move(subject);
    bool first = true;
    while (is_op("|") || (first && bare_first)) {
      if (!(first && bare_first)) ++p;
      first = false;
      e = filter(std::move(e));
    }
    return e;
  }

  // --- expressions ---------------------------------------------------------

  ExprP tuple(bool condexpr) {
    const Token& at = cur();
    ExprP first = expression(condexpr);
    if (!is_op(",")) return first;
    auto tup = node(Expr::K::tuple, at);
    tup->args.push_back(std::move(first));
    while (is_op(",")) {
      ++p;
      if (cur().kind == TK::block_end || cur().kind == TK::var_end || is_name("if")) break;
      tup->args.push_back(expression(condexpr));
    }
    return tup;
  }

  ExprP expression(bool condexpr) { return condexpr ? cond() : or_(); }

  ExprP cond() {
    ExprP a = or_();
    while (is_name("if")) {
      const Token& at = cur();
      ++p;
      auto e = node(Expr::K::cond, at);
      ExprP c = or_();
      ExprP b;
      if (is_name("else")) {
        ++p;
        b = cond();
      }
      e->args.push_back(std::move(c));
      e->args.push_back(std::move(a));
      e->args.push_back(std::move(b));
      a = std::move(e);
    }
    return a;
  }

  ExprP or_() {
    ExprP a = and_();
    while (is_name("or")) {
      auto e = node(Expr::K::or_, cur());
      ++p;
      e->args.push_back(std::move(a));
      e->args.push_back(and_());
      a = std::move(e);
    }
    return a;
  }

  ExprP and_() {
    ExprP a = not_();
    while (is_name("and")) {
      auto e = node(Expr::K::and_, cur());
      ++p;
      e->args.push_back(std::move(a));
      e->args.push_back(not_());
      a = std::move(e);
    }
    return a;
  }

  ExprP not_() {
    if (is_name("not")) {
      auto e = node(Expr::K::not_, cur());
      ++p;
      e->args.push_back(not_());
      return e;
    }
    return compare();
  }

  ExprP compare() {
    const Token& at = cur();
    ExprP a = math1();
    std::vector<std::string> ops;
    std::vector<ExprP> operands;
    while (true) {
      std::string op;
      if (cur().kind == TK::op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                   cur().value == ">" || cur().value == "<=" || cur().value == ">=")) {
        op = cur().value;
        ++p;
      } else if (is_name("in")) {
        op = "in";
        ++p;
      } else if (is_name("not") && is_name("in", 1)) {
        op = "notin";
        p += 2;
      } else {
        break;
      }
      ops.push_back(op);
      operands.push_back(math1());
    }
    if (ops.empty()) return a;
    auto e = node(Expr::K::compare, at);
    e->args.push_back(std::move(a));
    for (auto& o : operands) e->args.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }

  ExprP binary(ExprP a, const Token& at, const std::string& op, ExprP b) {
    auto e = node(Expr::K::binary, at);
    e->name = op;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprP math1() {
    ExprP a = concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = cur();
      ++p;
      a = binary(std::move(a), at, at.value, concat());
    }
    return a;
  }

  ExprP concat() {
    const Token& at = cur();
    ExprP a = math2();
    if (!is_op("~")) return a;
    auto e = node(Expr::K::concat, at);
    e->args.push_back(std::move(a));
    while (is_op("~")) {
      ++p;
      e->args.push_back(math2());
    }
    return e;
  }

  ExprP math2() {
    ExprP a = pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = cur();
      ++p;
      a = binary(std::move(a), at, at.value, pow());
    }
    return a;
  }

  ExprP pow() {
    ExprP a = unary(true);
    while (is_op("**")) {
      const Token& at = cur();
      ++p;
      a = binary(std::move(a), at, "**", unary(true));
    }
    return a;
  }

  ExprP unary(bool with_filter) {
    ExprP e;
    if (is_op("-") || is_op("+")) {
      auto u = node(is_op("-") ? Expr::K::neg : Expr::K::pos, cur());
      ++p;
      u->args.push_back(unary(false));
      e = std::move(u);
    } else {
      e = postfix(primary());
    }
    if (with_filter) e = filter_expr(std::move(e));
    return e;
  }

  ExprP primary() {
    const Token& c = cur();
    switch (c.kind) {
      case TK::name: {
        ++p;
        auto e = node(Expr::K::literal, c);
        if (c.value == "true" || c.value == "True") e->value = Value(true);
        else if (c.value == "false" || c.value == "False") e->value = Value(false);
        else if (c.value == "none" || c.value == "None") e->value = Value::none();
        else e->kind = Expr::K::name, e->name = c.value;
        return e;
      }
      case TK::string: {
        std::string s;
        while (cur().kind == TK::string) s += t[p++].value;  // adjacent literals join
        auto e = node(Expr::K::literal, c);
        e->value = Value(std::move(s));
        return e;
      }
      case TK::integer: {
        ++p;
        auto e = node(Expr::K::literal, c);
        try {
          e->value = Value(int64_t(std::stoll(c.value)));
        } catch (const std::exception&) {
          fail("integer literal out of range", c);
        }
        return e;
      }
      case TK::floating: {
        ++p;
        auto e = node(Expr::K::literal, c);
        e->value = Value(std::stod(c.value));
        return e;
      }
      case TK::op:
        if (c.value == "(") {
          ++p;
          if (is_op(")")) {
            ++p;
            return node(Expr::K::tuple, c);
          }
          ExprP first = expression(true);
          if (is_op(")")) {
            ++p;
            return first;
          }
          auto tup = node(Expr::K::tuple, c);
          tup->args.push_back(std::move(first));
          while (is_op(",")) {
            ++p;
            if (is_op(")")) break;
            tup->args.push_back(expression(true));
          }
          expect_op(")");
          return tup;
        }
        if (c.value == "[") {
          ++p;
          auto l = node(Expr::K::list, c);
          while (!is_op("]")) {
            if (!l->args.empty()) expect_op(",");
            if (is_op("]")) break;
            l->args.push_back(expression(true));
          }
          ++p;
          return l;
        }
        if (c.value == "{") {
          ++p;
          auto d = node(Expr::K::dict, c);
          while (!is_op("}")) {
            if (!d->args.empty()) expect_op(",");
            if (is_op("}")) break;
            d->args.push_back(expression(true));
            expect_op(":");
            d->args.push_back(expression(true));
          }
          ++p;
          return d;
        }
        break;
      default: break;
    }
    fail("unexpected" + got().substr(5), c);
  }

  ExprP postfix(ExprP e) {
    while (true) {
      const Token& at = cur();
      if (is_op(".")) {
        ++p;
        if (cur().kind == TK::name) {
          auto a = node(Expr::K::attr, at);
          a->name = t[p++].value;
          a->args.push_back(std::move(e));
          e = std::move(a);
        } else if (cur().kind == TK::integer) {
          auto a = node(Expr::K::item, at);
          a->args.push_back(std::move(e));
          auto k = node(Expr::K::literal, cur());
          k->value = Value(int64_t(std::stoll(t[p++].value)));
          a->args.push_back(std::move(k));
          e = std::move(a);
        } else {
          fail("expected an attribute name" + got(), cur());
        }
      } else if (is_op("[")) {
        ++p;
        e = subscript(std::move(e), at);
      } else if (is_op("(")) {
        e = call(std::move(e), at);
      } else {
        return e;
      }
    }
  }

  ExprP subscript(ExprP subject, const Token& at) {
    ExprP parts[3];
    bool has[3] = {false, false, false};
    bool slice = false;
    int k = 0;
    while (true) {
      if (is_op("]")) break;
      if (is_op(":")) {
        ++p;
        slice = true;
        if (++k > 2) fail("a slice takes at most start:stop:step", at);
        continue;
      }
      if (has[k]) fail("expected ']'" + got(), cur());
      parts[k] = expression(true);
      has[k] = true;
    }
    ++p;
    if (!slice) {
      if (!has[0]) fail("an empty subscript", at);
      auto e = node(Expr::K::item, at);
      e->args.push_back(std::move(subject));
      e->args.push_back(std::move(parts[0]));
      return e;
    }
    auto e = node(Expr::K::slice, at);
    e->args.push_back(std::move(subject));
    for (int i = 0; i < 3; ++i) {
      e->has[i] = has[i];
      e->args.push_back(std::move(parts[i]));
    }
    return e;
  }

  void call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (cur().kind == TK::name && is_op("=", 1)) {
        std::string k = t[p].value;
        p += 2;
        e.kwargs.emplace_back(std::move(k), expression(true));
      } else {
        if (is_op("*")) fail("*args in a call are not supported", cur());
        if (!e.kwargs.empty()) fail("a positional argument follows a keyword argument", cur());
        e.args.push_back(expression(true));
      }
      if (is_op(",")) {
        ++p;
        continue;
      }
      if (!is_op(")")) fail("expected ',' or ')'" + got(), cur());
    }
    ++p;
  }

  ExprP call(ExprP subject, const Token& at) {
    auto e = node(Expr::K::call, at);
    e->args.push_back(std::move(subject));
    call_args(*e);
    return e;
  }

  std::string dotted_name() {
    std::string n = expect_name();
    while (is_op(".") && peek().kind == TK::name) {
      p += 2;
      n += "." + t[p - 1].value;
    }
    return n;
  }

  ExprP filter(ExprP subject) {
    const Token& at = cur();
    auto e = node(Expr::K::filter, at);
    e->name = dotted_name();
    if (!kJinjaFilters.count(e->name) && !in_if) fail("no filter named '" + e->name + "'", at);
    e->args.push_back(std::move(subject));
    if (is_op("(")) call_args(*e);
    return e;
  }

  ExprP filter_expr(ExprP e) {
    while (true) {
      if (is_op("|")) {
        ++p;
        e = filter(std::move(e));
      } else if (is_name("is")) {
        const Token& at = cur();
        ++p;
        auto x = node(Expr::K::test, at);
        if (is_name("not")) {
          ++p;
          x->negated = true;
        }
        const Token& nt = cur();
        if (nt.kind == TK::name) {
          x->name = dotted_name();
        } else if (nt.kind == TK::op && kJinjaTests.count(nt.value)) {
          x->name = nt.value;
          ++p;
        } else {
          fail("expected a test name" + got(), nt);
        }
        if (!kJinjaTests.count(x->name) && !in_if) fail("no test named '" + x->name + "'", nt);
        x->args.push_back(std::move(e));
        if (is_op("(")) {
          call_args(*x);
        } else {
          const Token& c = cur();
          const bool arg = (c.kind == TK::name && c.value != "else" && c.value != "or" && c.value != "and") ||
                           c.kind == TK::string || c.kind == TK::integer || c.kind == TK::floating ||
                           is_op("[") || is_op("{");
          if (arg) x->args.push_back(postfix(primary()));
        }
        e = std::move(x);
      } else if (is_op("(")) {
        e = call(std::move(e), cur());
      } else {
        return e;
      }
    }
  }
};

}  // namespace

namespace {

// Names interned once the tree is built: the runtime's scopes compare pointers.
struct JinjaInterner {
  Template& tpl;
  Sym intern(const std::string& n) { return &*tpl.symbols.insert(n).first; }
  void expr(Expr& e) {
    // The Undefined a miss gives, built once (its text is only read by an error).
    if (e.kind == Expr::K::name) e.sym = intern(e.name), e.value = Value::undefined("'" + e.name + "'");
    if (e.kind == Expr::K::attr) e.value = Value::undefined("'dict object' has no attribute '" + e.name + "'");
    if (e.kind == Expr::K::item && e.args.size() > 1 && e.args[1]->kind == Expr::K::literal &&
        e.args[1]->value.is_string())
      e.value = Value::undefined("'dict object' has no attribute '" + e.args[1]->value.str() + "'");
    for (auto& a : e.args)
      if (a) expr(*a);
    for (auto& kv : e.kwargs)
      if (kv.second) expr(*kv.second);
  }
  void body(Body& b) {
    for (auto& st : b) stmt(*st);
  }
  void stmt(Stmt& st) {
    for (auto& e : st.exprs)
      if (e) expr(*e);
    for (auto& b : st.bodies) body(b);
    for (const auto& n : st.names) st.syms.push_back(intern(n));
    if (!st.macro_name.empty()) st.macro_sym = intern(st.macro_name);
    for (auto& [n, def] : st.params) {
      st.param_syms.push_back(intern(n));
      if (def) expr(*def);
    }
  }
};

}  // namespace

Template parse(const std::vector<Token>& tokens) {
  Parser ps{tokens};
  Template tpl;
  tpl.body = ps.body({}, tokens.front(), "");
  if (ps.cur().kind != TK::eof) ps.fail("unexpected tag", ps.cur());
  tpl.has_generation = ps.has_generation;
  JinjaInterner in{tpl};
  for (const char* n : {"loop", "caller", " body", "range", "dict", "namespace", "raise_exception", "strftime_now"})
    in.intern(n);
  in.body(tpl.body);
  return tpl;
}

}  // namespace nnstrain::jinja
