// A model's chat template as Hugging Face applies it: the Jinja text rendered
// with the globals transformers' apply_chat_template passes (messages, tools,
// documents, add_generation_prompt, the special tokens, raise_exception,
// strftime_now, keyword arguments), the text tokenized as tokenize=True does,
// and each token flagged as a target or context. Targets: where the template
// has {% generation %} blocks, the tokens they render (transformers'
// return_assistant_tokens_mask); elsewhere what each assistant message adds to
// the rendering, found by rendering the conversation prefix by prefix.
// Torch-free. docs/chat_templates.md states the rules.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/chat/jinja_value.h"
#include "data/tokenizer/tokenizer.h"

namespace nnstrain::jinja {
struct Template;
}

namespace nnstrain::data {

// A template that cannot be compiled, or a conversation it cannot render; one line.
struct ChatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ChatMessage {
  std::string role;
  std::string content;
};

// One conversation as the template sees it: messages (dicts with any fields:
// role, content, tool_calls, reasoning_content, ...), and tools / documents
// (None when absent), normalised as transformers does (keys whose value is
// null dropped; reasoning_content / thinking / reasoning aliased).
struct Conversation {
  jinja::Value messages = jinja::Value(jinja::List{});
  jinja::Value tools = jinja::Value::none();
  jinja::Value documents = jinja::Value::none();
  jinja::Value kwargs = jinja::Value::dict();  // keyword arguments of this rendering (over the template's)
  size_t size() const { return messages.list().size(); }
  static Conversation from_json(const nlohmann::ordered_json& messages, const nlohmann::ordered_json* tools = nullptr,
                                const nlohmann::ordered_json* documents = nullptr);
  // The same from values (Value::parse_json's): `messages` a list of dicts.
  static Conversation from_values(const jinja::Value& messages, const jinja::Value* tools = nullptr,
                                  const jinja::Value* documents = nullptr);
  static Conversation from_messages(const std::vector<ChatMessage>& messages);
  Conversation prefix(size_t n) const;  // the first n messages
  std::string role(size_t i) const;     // "" when message i has no string role
};

enum class TrainOn { all_assistant, last_assistant };

struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> target;      // per id: 1 = the loss counts it
  std::vector<size_t> turn_starts;  // ids indices where a user message begins (cut points for splitting)
};

struct ChatTemplateOptions {
  // Special-token text inside the conversation's own strings: `text` encodes it
  // as plain text (transformers' sanitize_control_tokens=True), `special` as the
  // token (apply_chat_template's default), `error` refuses the conversation.
  tok::SpecialPolicy content_specials = tok::SpecialPolicy::text;
  // bos_token, eos_token, ... as the template sees them (tokenizer_config.json's).
  std::vector<std::pair<std::string, std::string>> special_tokens;
  // Extra keyword arguments the template reads (enable_thinking, ...), a JSON object.
  std::string kwargs_json;
};

class ChatTemplate {
 public:
  // Compiles `text`; `source` names it in errors ("FILE:LINE:COL: what").
  // Throws ChatError.
  ChatTemplate(const std::string& text, std::string source, const tok::Tokenizer& tokenizer,
               ChatTemplateOptions options = {});
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  const std::string& source() const { return source_; }
  const std::string& sha256() const { return sha256_; }
  bool has_generation_blocks() const;

  // The rendered text (apply_chat_template(..., tokenize=False)).
  std::string render(const Conversation& c, bool add_generation_prompt) const;
  // The rendered text's ids (tokenize=True), no targets.
  std::vector<int32_t> tokens(const Conversation& c, bool add_generation_prompt) const;
  // The rendered text's ids and target flags (none without an assistant turn).
  ChatTokens encode(const Conversation& c, bool add_generation_prompt, TrainOn train_on = TrainOn::all_assistant,
                    bool with_turn_starts = true) const;
  // The token that ends an assistant turn as this template renders one (the
  // first added token after a probe answer), else the tokenizer's EOS; -1: none.
  int32_t end_of_turn() const { return end_of_turn_; }

 private:
  struct Rendered {
    std::string text;  // with markers around special-token text from the conversation (content_specials text)
    std::vector<std::pair<size_t, size_t>> generation;
  };
  Rendered render_marked(const Conversation& c, bool add_generation_prompt) const;
  jinja::Value globals(const Conversation& c, bool add_generation_prompt) const;
  Conversation marked(const Conversation& c) const;
  void tokenize(const std::string& marked_text, std::vector<int32_t>& ids, std::vector<size_t>& starts,
                std::vector<size_t>& ends) const;
  std::vector<std::pair<size_t, size_t>> assistant_spans(const Conversation& c, const Rendered& full,
                                                         TrainOn train_on) const;
  [[noreturn]] void rethrow(const std::exception& e) const;

  std::unique_ptr<jinja::Template> tpl_;
  std::string source_, sha256_;
  const tok::Tokenizer* tok_;
  ChatTemplateOptions opt_;
  jinja::Value kwargs_;
  std::vector<std::string> control_tokens_;  // longest first
  int32_t end_of_turn_ = -1;
  // What encode() reuses across calls and threads: encode caches (one per thread
  // at a time), each id's decoded byte length, control tokens by first byte.
  struct Scratch;
  std::unique_ptr<Scratch> scratch_;
};

// Python's str.strip(): Unicode whitespace off both ends (Jinja's `trim`).
std::string strip_unicode_whitespace(const std::string& s);

}  // namespace nnstrain::data
