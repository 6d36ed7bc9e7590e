// Jinja tokens -> a syntax tree of statements and expressions, with jinja2's
// operator precedence. What Hugging Face chat templates use is parsed; any other
// tag, or a filter or test jinja2 does not know, is refused here (jinja2 refuses
// those when it compiles the template, before rendering). Torch-free.
#pragma once

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "data/chat/jinja_lexer.h"
#include "data/chat/jinja_value.h"

namespace nnstrain::jinja {

struct Expr;
struct Stmt;
using ExprP = std::unique_ptr<Expr>;
using Body = std::vector<std::unique_ptr<Stmt>>;
// A name interned in its template: equal names are the same pointer (scopes compare those).
using Sym = const std::string*;

struct Expr {
  enum class K : uint8_t {
    literal, name, attr, item, slice, call, filter, test, neg, pos, not_, binary, and_, or_, compare, cond,
    list, tuple, dict, concat
  };
  K kind;
  int line = 0, col = 0;
  Value value;              // literal; name, attr, item: the Undefined a miss gives (dict's, for attr/item)
  std::string name;         // name, attr, filter, test; binary: the operator
  Sym sym = nullptr;        // name: interned
  std::vector<ExprP> args;  // operands / elements / positional arguments (args[0]: the subject for attr,
                            // item, slice, call, filter, test); dict: key, value, key, value, ...
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // compare: the operators between args
  bool negated = false;          // test: `is not`
  bool has[3] = {false, false, false};  // slice: which of start, stop, step are given (args[1..3])
};

struct Stmt {
  enum class K : uint8_t {
    text, print, if_, for_, set, set_block, macro, call_block, filter_block, generation, break_, continue_
  };
  K kind;
  int line = 0, col = 0;
  std::string text;                // text
  std::vector<ExprP> exprs;        // print: [e]; if: conditions; for: [iter, filter?]; set: [value];
                                   // call_block: [call]; filter_block: filters as exprs over a null subject
  std::vector<Body> bodies;        // if: one per condition, + else; for: [body, else]; others: [body]
  std::vector<std::string> names;  // for/set targets; set ns.attr: [ns, attr] with attr_target
  std::vector<Sym> syms;           // names, interned
  bool attr_target = false;        // set ns.attr = ...
  std::string macro_name;
  Sym macro_sym = nullptr;
  std::vector<std::pair<std::string, ExprP>> params;  // macro / call block: names, defaults (null: none)
  std::vector<Sym> param_syms;
};

struct Template {
  Body body;
  std::string source_name;
  bool has_generation = false;  // {% generation %} blocks (transformers' assistant mask)
  // Every name the template can look up (its own, the runtime's: loop, caller, range, ...);
  // a node-based set, so the pointers stay valid when the template moves.
  std::unordered_set<std::string> symbols;
  Sym symbol(const std::string& n) const {
    const auto it = symbols.find(n);
    return it == symbols.end() ? nullptr : &*it;
  }
};

// Throws jinja::Error with the line and column of the construct.
Template parse(const std::vector<Token>& tokens);

}  // namespace nnstrain::jinja
