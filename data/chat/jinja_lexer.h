// Jinja source -> tokens, with the whitespace rules Hugging Face renders chat
// templates under: trim_blocks and lstrip_blocks on (as transformers'
// environment sets them), `-` and `+` on tags, a single trailing newline of the
// source dropped, template text's newlines normalised to "\n". Torch-free.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::jinja {

struct Token {
  enum class K : uint8_t {
    text,         // template text between tags
    var_begin,    // {{
    var_end,      // }}
    block_begin,  // {%
    block_end,    // %}
    name,
    string,  // value: the literal's text, escapes resolved
    integer,
    floating,
    op,   // operators and punctuation, value: its text
    eof,
  };
  K kind;
  std::string value;
  int line = 1, col = 1;
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
};

// Throws jinja::Error with the line and column of what it cannot read.
std::vector<Token> lex(const std::string& source, const LexOptions& options = {});

}  // namespace nnstrain::jinja
