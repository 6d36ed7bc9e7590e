// Renders a parsed Jinja template as jinja2's ImmutableSandboxedEnvironment
// does for Hugging Face chat templates: Python semantics for the values,
// jinja2's Undefined, scoping (a for loop's body starts each iteration from the
// enclosing scope; if/else does not open one), loop.*, macros and call blocks,
// the built-in filters and tests, the sandbox's refusal of methods that modify
// a list or dict. Torch-free.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "data/chat/jinja_parser.h"
#include "data/chat/jinja_value.h"

namespace nnstrain::jinja {

struct RenderResult {
  std::string text;
  // Byte ranges of text that {% generation %} blocks rendered, in order.
  std::vector<std::pair<size_t, size_t>> generation;
};

// `globals`: a dict of the names the template sees (messages, tools, ...);
// range, dict and namespace are added. Throws jinja::Error (line, column set).
RenderResult render(const Template& tpl, const Value& globals);

}  // namespace nnstrain::jinja
