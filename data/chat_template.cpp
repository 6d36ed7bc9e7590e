#include "data/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace nnstrain::data {

namespace {

namespace fs = std::filesystem;

// The models' own template texts, byte for byte as their tokenizer_config.json
// holds them (SHA-256 ba03a121... llama3, 79320228... chatml, 79685317... mistral).
struct Builtin {
  const char* name;
  const char* text;
};
const Builtin kBuiltins[] = {
    {"llama3", R"({% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %})"},
    {"chatml", R"({% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful assistant.<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %})"},
    {"mistral", R"({%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
)"},
};

struct BuiltinTokens {
  const char* name;
  std::vector<std::pair<std::string, std::string>> specials;
  std::vector<std::string> needs;
};
const std::vector<BuiltinTokens>& builtin_tokens() {
  static const std::vector<BuiltinTokens> t = {
      {"llama3", {{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"}},
       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}},
      {"chatml", {{"eos_token", "<|im_end|>"}}, {"<|im_start|>", "<|im_end|>"}},
      {"mistral", {{"bos_token", "<s>"}, {"eos_token", "</s>"}}, {"<s>", "</s>"}},
  };
  return t;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw ChatError("cannot read the chat template " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::ordered_json read_config(const fs::path& p) {
  try {
    return nlohmann::ordered_json::parse(read_text(p));
  } catch (const nlohmann::json::exception& e) {
    throw ChatError(p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// tokenizer_config.json's chat_template: one text, or named ones (the "default").
std::optional<std::string> config_template(const fs::path& file) {
  const auto j = read_config(file);
  if (!j.contains("chat_template") || j["chat_template"].is_null()) return std::nullopt;
  const auto& t = j["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    for (const auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        return e["template"].get<std::string>();
    throw ChatError(file.string() + ": chat_template names templates but none is \"default\"");
  }
  throw ChatError(file.string() + ": chat_template is neither a string nor a list of named templates");
}

// The special tokens transformers' special_tokens_map holds, from tokenizer_config.json.
std::vector<std::pair<std::string, std::string>> config_specials(const fs::path& file) {
  std::vector<std::pair<std::string, std::string>> out;
  const auto j = read_config(file);
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!j.contains(k)) continue;
    const auto& v = j[k];
    if (v.is_string()) out.emplace_back(k, v.get<std::string>());
    else if (v.is_object() && v.contains("content") && v["content"].is_string())
      out.emplace_back(k, v["content"].get<std::string>());
  }
  return out;
}

fs::path folder_of(const std::string& path) {
  if (path.empty()) return {};
  return fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
}

// A folder's template: chat_template.jinja first (what transformers writes), then tokenizer_config.json's.
std::optional<ChatTemplateSpec> from_folder(const fs::path& dir) {
  if (fs::exists(dir / "chat_template.jinja"))
    return ChatTemplateSpec{read_text(dir / "chat_template.jinja"), (dir / "chat_template.jinja").string(), {}, {}};
  if (fs::exists(dir / "tokenizer_config.json"))
    if (auto t = config_template(dir / "tokenizer_config.json"))
      return ChatTemplateSpec{*t, (dir / "tokenizer_config.json").string(), {}, {}};
  return std::nullopt;
}

}  // namespace

const std::vector<std::string>& builtin_chat_templates() {
  static const std::vector<std::string> n{"llama3", "chatml", "mistral"};
  return n;
}

std::optional<ChatTemplateSpec> find_chat_template(const std::string& given, const std::string& tokenizer_path) {
  std::optional<ChatTemplateSpec> spec;
  const BuiltinTokens* builtin = nullptr;
  if (given.empty()) {
    const fs::path dir = folder_of(tokenizer_path);
    if (!dir.empty()) spec = from_folder(dir);
    if (!spec) return std::nullopt;
  } else if (const auto it = std::find_if(std::begin(kBuiltins), std::end(kBuiltins),
                                          [&](const Builtin& b) { return given == b.name; });
             it != std::end(kBuiltins)) {
    spec = ChatTemplateSpec{it->text, std::string("built-in ") + it->name, {}, {}};
    for (const auto& b : builtin_tokens())
      if (given == b.name) builtin = &b;
  } else if (fs::is_directory(given)) {
    spec = from_folder(given);
    if (!spec) throw ChatError("'" + given + "' holds no chat_template.jinja and no tokenizer_config.json chat_template");
  } else if (fs::is_regular_file(given)) {
    if (fs::path(given).extension() == ".json") {
      auto t = config_template(given);
      if (!t) throw ChatError(given + ": no chat_template");
      spec = ChatTemplateSpec{*t, given, {}, {}};
    } else {
      spec = ChatTemplateSpec{read_text(given), given, {}, {}};
    }
  } else {
    throw ChatError("chat template '" + given +
                    "' is not known (expected llama3, chatml, mistral, a .jinja file, a tokenizer_config.json "
                    "or a Hugging Face folder)");
  }
  const fs::path dir = folder_of(tokenizer_path);
  if (!dir.empty() && fs::exists(dir / "tokenizer_config.json")) spec->special_tokens = config_specials(dir / "tokenizer_config.json");
  else if (builtin) spec->special_tokens = builtin->specials;
  if (builtin) spec->needs = builtin->needs;
  return spec;
}

std::vector<std::pair<std::string, std::string>> chat_special_tokens(const std::string& tokenizer_path) {
  const fs::path dir = folder_of(tokenizer_path);
  if (dir.empty() || !fs::exists(dir / "tokenizer_config.json")) return {};
  return config_specials(dir / "tokenizer_config.json");
}

ChatTemplate make_chat_template(const ChatTemplateSpec& spec, const tok::Tokenizer& tokenizer,
                                ChatTemplateOptions options) {
  for (const auto& t : spec.needs)
    if (!tokenizer.token_id(t))
      throw ChatError("chat template " + spec.source.substr(spec.source.rfind(' ') + 1) + " needs the special token " +
                      t + ", which the tokenizer lacks");
  options.special_tokens = spec.special_tokens;
  return ChatTemplate(spec.text, spec.source, tokenizer, std::move(options));
}

}  // namespace nnstrain::data
