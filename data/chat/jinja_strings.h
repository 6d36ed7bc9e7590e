// Python's str methods as chat templates call them (strip, split, startswith,
// replace, find, format, ...), over UTF-8 text with code-point positions, and
// the string helpers the filters share. Case mapping is ASCII's. Torch-free.
#pragma once

#include <string>
#include <vector>

#include "data/chat/jinja_value.h"

namespace nnstrain::jinja {

bool is_string_method(const std::string& name);
// s.name(*args, **kwargs); throws Error for bad arguments.
Value call_string_method(const std::string& s, const std::string& name, CallArgs& a);

// str.strip([chars]) on either end; chars null: Unicode whitespace.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right);
// str.split(sep=None, maxsplit=-1).
std::vector<std::string> py_split(const std::string& s, const std::string* sep, int64_t maxsplit);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends = false);
std::string ascii_lower(std::string s);
std::string ascii_upper(std::string s);
std::string capitalize(const std::string& s);
std::string html_escape(const std::string& s);
// "fmt" % args (args a list: several values).
std::string percent_format(const std::string& fmt, const Value& args);

}  // namespace nnstrain::jinja
