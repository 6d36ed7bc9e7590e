// Where a chat template comes from: one of the three built-in texts (llama3,
// chatml, mistral: Meta-Llama-3-Instruct's, Qwen2's and Mistral-7B-Instruct-
// v0.1's own templates), a .jinja file, a tokenizer_config.json, or a Hugging
// Face folder (its chat_template.jinja, else tokenizer_config.json's
// chat_template), with the special tokens the template sees from that folder's
// tokenizer_config.json. The engine is data/chat/ (chat_template.h).
// Torch-free. docs/chat_templates.md states the rules.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/chat/chat_template.h"

namespace nnstrain::data {

struct ChatTemplateSpec {
  std::string text;    // the Jinja source
  std::string source;  // "built-in llama3", or the file it was read from
  std::vector<std::pair<std::string, std::string>> special_tokens;  // bos_token, eos_token, ...
  std::vector<std::string> needs;  // a built-in's special tokens, which the tokenizer must hold
};

const std::vector<std::string>& builtin_chat_templates();

// `given`: a built-in name, a file (.jinja text, or a tokenizer_config.json),
// or a folder; "" means the tokenizer's folder (nullopt when it has no
// template). The special tokens come from the tokenizer folder's
// tokenizer_config.json (a built-in's own when there is none). Throws ChatError.
std::optional<ChatTemplateSpec> find_chat_template(const std::string& given, const std::string& tokenizer_path);

// The special tokens (bos_token, eos_token, ...) of the tokenizer folder's tokenizer_config.json.
std::vector<std::pair<std::string, std::string>> chat_special_tokens(const std::string& tokenizer_path);

// The compiled template; a built-in whose tokens the tokenizer lacks is refused,
// naming the token. Throws ChatError.
ChatTemplate make_chat_template(const ChatTemplateSpec& spec, const tok::Tokenizer& tokenizer,
                                ChatTemplateOptions options = {});

}  // namespace nnstrain::data
